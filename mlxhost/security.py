"""HTTP hardening shared by every page: the default Content-Security-Policy and the client address."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from django.conf import settings

from mlxhost.middleware import DualMiddleware

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from django.http import HttpRequest, HttpResponse

# Scripts and styles from this site only, no inline code, no framing. The Django admin has no
# inline script (its data travels in data-* attributes of <script src>), so it runs under this.
DEFAULT_CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)


class ContentSecurityPolicyMiddleware(DualMiddleware):
    """Give every HTML response a Content-Security-Policy; a view's own policy wins (the dashboard
    names its WebSocket origins)."""

    def _call(self, request: HttpRequest) -> HttpResponse:
        return with_default_csp(cast("HttpResponse", self.get_response(request)))  # a sync chain

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        # markcoroutinefunction(self) ran, so the chain is async and get_response a coroutine function.
        return with_default_csp(await cast("Awaitable[HttpResponse]", self.get_response(request)))


def with_default_csp(response: HttpResponse) -> HttpResponse:
    if response.get("Content-Type", "").startswith("text/html"):
        response.headers.setdefault("Content-Security-Policy", DEFAULT_CSP)
    return response


def client_ip(request: HttpRequest) -> str | None:
    """The client's address for the login throttle (AXES_CLIENT_IP_CALLABLE).

    Behind MLXHOST_BEHIND_TLS_PROXY the last X-Forwarded-For entry, which our proxy appended;
    the entries before it are whatever the client sent and could be forged to dodge a lockout.
    """
    forwarded: str = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if settings.MLXHOST_BEHIND_TLS_PROXY and forwarded:
        return forwarded.split(",")[-1].strip()
    return request.META.get("REMOTE_ADDR")
