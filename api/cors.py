"""CORS for the API routes (under /v1/): preflights answered and responses marked for the
origins in MLXHOST_CORS_ORIGINS only, as Ollama's OLLAMA_ORIGINS does. Empty (the default): none."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from django.conf import settings
from django.http import HttpResponse
from django.utils.cache import patch_vary_headers

from mlxhost.middleware import DualMiddleware, is_api

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from django.http import HttpRequest, HttpResponseBase

ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
# What the OpenAI and Anthropic SDKs send from a browser; besides these, the OpenAI SDK's
# `x-stainless-*` family is allowed by prefix, since it grows with the SDK.
ALLOW_HEADERS = (
    "authorization",
    "content-type",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "openai-beta",
    "openai-organization",
    "openai-project",
    "x-request-id",
)
ALLOW_HEADER_PREFIX = "x-stainless-"
EXPOSE_HEADERS = "X-Request-Id, X-Session-Cache, X-Tools-Ignored, Retry-After, request-id"
MAX_AGE_S = 7200  # Chromium's cap on caching a preflight


def allowed_origin(request: HttpRequest) -> str | None:
    """The value for Access-Control-Allow-Origin, or None when this request gets no CORS headers."""
    origin = request.headers.get("Origin")
    origins: list[str] = settings.MLXHOST_CORS_ORIGINS
    if not origin or not is_api(request):
        return None
    if "*" in origins:
        return "*"
    return origin if origin.rstrip("/") in origins else None


def preflight(request: HttpRequest, origin: str) -> HttpResponse:
    """The 204 answer to a preflight from an allowed origin."""
    requested = request.headers.get("Access-Control-Request-Headers", "")
    extra = [
        h for h in (p.strip().lower() for p in requested.split(",")) if h.startswith(ALLOW_HEADER_PREFIX)
    ]
    response = HttpResponse(status=204)
    response["Access-Control-Allow-Origin"] = origin
    response["Access-Control-Allow-Methods"] = ALLOW_METHODS
    response["Access-Control-Allow-Headers"] = ", ".join((*ALLOW_HEADERS, *extra))
    response["Access-Control-Max-Age"] = str(MAX_AGE_S)
    patch_vary_headers(
        response, ("Origin", "Access-Control-Request-Method", "Access-Control-Request-Headers")
    )
    return response


def with_cors(response: HttpResponseBase, origin: str) -> HttpResponseBase:
    """Mark an actual response (streaming ones too: headers go out before the body) for `origin`."""
    response["Access-Control-Allow-Origin"] = origin
    response["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
    patch_vary_headers(response, ("Origin",))
    return response


def _is_preflight(request: HttpRequest) -> bool:
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


class CorsMiddleware(DualMiddleware):
    """Answer preflights on /v1/ from allowed origins (204) and mark their actual responses.

    Other origins, and every path outside /v1/, pass through untouched: a preflight from them
    reaches the view and gets its 405, with no Access-Control-* header.
    """

    def _call(self, request: HttpRequest) -> HttpResponseBase:
        origin = allowed_origin(request)
        if origin is not None and _is_preflight(request):
            return preflight(request, origin)
        response = cast("HttpResponseBase", self.get_response(request))  # a sync chain
        return with_cors(response, origin) if origin is not None else response

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        origin = allowed_origin(request)
        if origin is not None and _is_preflight(request):
            return preflight(request, origin)
        response = await cast("Awaitable[HttpResponseBase]", self.get_response(request))
        return with_cors(response, origin) if origin is not None else response
