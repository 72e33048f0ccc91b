"""Django's stock middleware, run on the event loop for API requests (paths under /v1/).

Under ASGI, Django runs each hook of a sync-only middleware (`process_request`,
`process_response`, `process_view`) through `sync_to_async(thread_sensitive=True)`: one hop to
asgiref's single sync thread per hook, about 14 per request with the stock stack. In a burst
those hops queue behind each other (and behind any ORM call), so a refusal that needs no
database still waited ~3 ms per request ahead of it. For API requests these hooks do no I/O:
the session is never loaded (API keys, not cookies), views are CSRF-exempt and no message is
ever queued, so they run inline on the loop. Every other path (admin, pages) keeps Django's
own behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.contrib.auth.middleware import AuthenticationMiddleware
from django.contrib.messages.middleware import MessageMiddleware
from django.contrib.sessions.middleware import SessionMiddleware
from django.core.checks import CheckMessage, Warning
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.common import CommonMiddleware
from django.middleware.csrf import CsrfViewMiddleware
from django.middleware.security import SecurityMiddleware
from django.utils.deprecation import MiddlewareMixin
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from django.http import HttpRequest, HttpResponseBase

API_PREFIX = "/v1/"


class DualMiddleware:
    """The base of this project's own middleware: sync and async capable, as Django's docs lay
    it out, written once. A subclass defines `_call` (a sync chain) and `_acall` (an async one).
    """

    async_capable = True
    sync_capable = True

    def __init__(
        self, get_response: Callable[[HttpRequest], HttpResponseBase | Awaitable[HttpResponseBase]]
    ) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        # `self` passed to iscoroutinefunction would narrow it to a plain callable (a TypeGuard),
        # hiding `_acall`: the check and the call are kept apart.
        is_async = iscoroutinefunction(self)
        if is_async:
            return self._acall(request)
        return self._call(request)

    def _call(self, request: HttpRequest) -> HttpResponseBase:
        raise NotImplementedError

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        raise NotImplementedError


def is_api(request: HttpRequest) -> bool:
    return request.path.startswith(API_PREFIX)


class _InlineForApi(MiddlewareMixin):
    """Mixin for a `MiddlewareMixin` subclass: hooks run inline for API paths, hopped otherwise.

    Listed before the stock class, so `MiddlewareMixin` stays last in the MRO as it was.
    """

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        if not is_api(request):
            return await super().__acall__(request)
        # Django calls __acall__ only on an async chain, so the next handler is a coroutine function.
        get_response = cast("Callable[[HttpRequest], Awaitable[HttpResponseBase]]", self.get_response)
        response: HttpResponseBase | None = None
        if hasattr(self, "process_request"):
            response = self.process_request(request)
        response = response or await get_response(request)
        if hasattr(self, "process_response"):
            response = self.process_response(request, response)
        return response


class InlineSecurityMiddleware(_InlineForApi, SecurityMiddleware):
    pass


class InlineSessionMiddleware(_InlineForApi, SessionMiddleware):
    pass


class InlineCommonMiddleware(_InlineForApi, CommonMiddleware):
    pass


class InlineCsrfViewMiddleware(_InlineForApi, CsrfViewMiddleware):
    # An async `process_view` is called as is; Django would hop a sync one to the thread.
    async def process_view(  # type: ignore[override]  # Django awaits an async hook; stubs say sync
        self, request: HttpRequest, callback: Any, callback_args: Any, callback_kwargs: Any
    ) -> HttpResponseBase | None:
        if is_api(request):
            return super().process_view(request, callback, callback_args, callback_kwargs)
        hook = sync_to_async(super().process_view, thread_sensitive=True)
        return await hook(request, callback, callback_args, callback_kwargs)


class InlineAuthenticationMiddleware(_InlineForApi, AuthenticationMiddleware):
    pass


class InlineMessageMiddleware(_InlineForApi, MessageMiddleware):
    pass


class InlineXFrameOptionsMiddleware(_InlineForApi, XFrameOptionsMiddleware):
    pass


# Django's deploy checks look these three up by dotted path (security.W001, W002, W003), so the
# settings silence them and this check stands in: each must be present as itself or a subclass.
_PROTECTIONS = {
    "mlxhost.W001": SecurityMiddleware,
    "mlxhost.W002": XFrameOptionsMiddleware,
    "mlxhost.W003": CsrfViewMiddleware,
}


def check_protections(**_kwargs: Any) -> list[CheckMessage]:
    """A warning for each protecting middleware missing from MIDDLEWARE (in any subclass)."""
    loaded = [import_string(path) for path in settings.MIDDLEWARE]
    return [
        Warning(f"No {base.__module__}.{base.__name__} (or a subclass) in MIDDLEWARE.", id=check_id)
        for check_id, base in _PROTECTIONS.items()
        if not any(isinstance(cls, type) and issubclass(cls, base) for cls in loaded)
    ]
