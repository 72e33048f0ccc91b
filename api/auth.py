"""API key authentication for the REST surfaces, and the decorator every API view wears."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponseBase

from api.errors import INVALID_KEY_MESSAGE, ApiError, Dialect, as_api_error, dialect_of, error_response
from api.parsing import loads_object, read_body
from models_app.accounting import usage
from models_app.accounting.apikeys import key_hash
from models_app.accounting.identity import KeyIdentity
from models_app.catalogue import hotcache, selectors
from models_app.catalogue.lookups import single_flight

# A coroutine function, as django-stubs' `path()` accepts one; a streaming answer is a response too.
AsyncView = Callable[..., Coroutine[Any, Any, HttpResponseBase]]
# The one attribute this module sets on a request: its typed `RequestContext`.
CONTEXT_ATTR = "mlxhost_context"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a request: the tenant that owns its data (PER-6, SES-3) and how it proved it."""

    owner_id: int
    key_id: int | None  # None for a browser session (the WebSocket)
    auth: Literal["api_key", "session"]
    key: KeyIdentity | None = None  # the key its turns count against, with its limits (KEY-2/4)

    @classmethod
    def of_key(cls, key: KeyIdentity) -> Caller:
        return cls(owner_id=key.owner_id, key_id=key.key_id, auth="api_key", key=key)


@dataclass(slots=True)
class RequestContext:
    """What the API layer learned about a request: its caller (None on a public endpoint) and the
    model it named, for a 404 that names it even when the body fails validation later."""

    caller: Caller | None = None
    requested_model: str | None = None


def request_context(request: HttpRequest) -> RequestContext:
    """The request's context, made on first use (the only accessor; never read the attribute)."""
    context = getattr(request, CONTEXT_ATTR, None)
    if context is None:
        context = RequestContext()
        setattr(request, CONTEXT_ATTR, context)
    return context


def caller_of(request: HttpRequest) -> Caller:
    """The authenticated caller of a request that passed `api_endpoint`'s key check.

    Raises:
        RuntimeError: the view is public (no key was checked), a programming error.
    """
    caller = request_context(request).caller
    if caller is None:
        raise RuntimeError("caller_of() on a public endpoint: no API key was checked.")
    return caller


def presented_key(headers: Mapping[str, str]) -> str:
    """The key from `Authorization: Bearer …` or `x-api-key`; never from the query string.

    `headers` is a request's (`request.headers`, any case) or a WebSocket handshake's
    (`api.ws.auth.headers_of`, lower-case names).
    """
    header = headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    return headers.get("x-api-key", "").strip()


def _authenticate_sync(raw_key: str, digest: str, generation: int) -> KeyIdentity | None:
    key = selectors.apikey_authenticate(raw_key=raw_key)
    identity = KeyIdentity.of(key) if key is not None else None
    hotcache.api_keys.put(digest, identity, generation)
    return identity


async def authenticate_raw(raw_key: str) -> KeyIdentity | None:
    """The live key with this value, or None (the WebSocket's header or first-frame key).

    Cached by the key's hash for `hotcache.KEY_TTL_S` seconds, so a burst of requests, refused
    or not, reaches the lane without waiting for the database; a revoke in this process clears
    the cache at once. A live key's use is noted in memory; the usage flush stamps its
    `last_used_at` (KEY-1), never this request.
    """
    if not raw_key:
        return None
    digest = key_hash(raw_key)  # the raw key itself is never kept in memory
    cached = hotcache.api_keys.get(digest)
    if cached is hotcache.MISS:
        generation = hotcache.api_keys.generation  # read before the query: a revoke meanwhile wins
        identity = await single_flight(
            "api_key", digest, lambda: sync_to_async(_authenticate_sync)(raw_key, digest, generation)
        )
    else:
        identity = cached
    if identity is not None:
        usage.recorder().key_used(identity.key_id)  # in memory; the usage flush stamps last_used_at
    return identity


async def authenticate(request: HttpRequest) -> KeyIdentity:
    """Resolve the request's API key.

    Raises:
        ApiError: 401 when the key is missing, unknown or revoked.
    """
    key = await authenticate_raw(presented_key(request.headers))
    if key is None:
        raise ApiError(401, INVALID_KEY_MESSAGE, "authentication_error", "invalid_api_key")
    return key


async def may_see_internals(request: HttpRequest) -> bool:
    """True for a valid API key or a logged-in staff member (probe details, dashboard data)."""
    if presented_key(request.headers):
        return await authenticate_raw(presented_key(request.headers)) is not None
    user = await request.auser()
    return bool(user.is_active and user.is_staff)


def json_body(request: HttpRequest) -> dict[str, Any]:
    """The request body as a JSON object (API-4).

    Raises:
        ApiError: 413 when the body is over MLXHOST_MAX_REQUEST_BYTES; 400 when it is not a
            JSON object of valid Unicode text nested at most `parsing.MAX_JSON_DEPTH` deep.
    """
    body = loads_object(read_body(request))
    # Named in a 404 for an unknown model, even when the body fails validation later.
    request_context(request).requested_model = (
        body.get("model") if isinstance(body.get("model"), str) else None
    )
    return body


def in_wire_names(error: ApiError, names: Mapping[str, str]) -> ApiError:
    """`error` in a surface's own field names (API-4, API-12).

    The engine names fields as chat completions does (`messages`, `response_format`,
    `max_tokens`); `names` maps those to the surface's (`input`, `text.format`,
    `max_output_tokens`). A prompt over the context names the field that holds the prompt, as
    OpenAI's `context_length_exceeded` does in `param`.
    """
    if error.too_long is not None and error.param is None:
        return replace(error, param=names.get("messages", "messages"))
    wire = names.get(error.param or "")
    if wire is None or error.param is None:
        return error
    message = error.message
    if message.startswith(f"{error.param}:"):
        message = wire + message[len(error.param) :]
    return replace(error, param=wire, message=message)


def api_endpoint(
    *,
    dialect: Dialect | Literal["auto"],
    methods: tuple[str, ...],
    public: bool = False,
    names: Mapping[str, str] | None = None,
) -> Callable[[AsyncView], AsyncView]:
    """Wrap an async API view: method check, API key auth (unless public), errors in the surface's envelope.

    `dialect="auto"` (a route both surfaces share, like /v1/models) picks the envelope by the
    request (`errors.dialect_of`). The view reads the caller with `caller_of(request)`. A wrong
    method is a 405 whose `Allow` header lists `methods` (RFC 9110). Errors name fields as the
    surface does (`names`, see `in_wire_names`).
    """
    allow = ", ".join(methods)

    def decorate(view: AsyncView) -> AsyncView:
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            try:
                if request.method not in methods:
                    raise ApiError(
                        405, f"Method {request.method} is not allowed here.", code="method_not_allowed"
                    )
                if not public:
                    request_context(request).caller = Caller.of_key(await authenticate(request))
                return await view(request, *args, **kwargs)
            except Exception as exc:  # every failure leaves in the surface's envelope
                error = as_api_error(exc, model=request_context(request).requested_model)
                response = error_response(
                    in_wire_names(error, names or {}), dialect_of(request) if dialect == "auto" else dialect
                )
                if error.status == 405:
                    response["Allow"] = allow
                return response

        wrapper.csrf_exempt = True  # type: ignore[attr-defined]  # API keys, not cookies
        return wrapper

    return decorate
