"""Errors for every surface: one table from exceptions to status/type/code, rendered per dialect."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt

from mlxhost import request_log, wire
from mlxhost.daphne_options import REASON_PHRASES
from mlxhost.engine import (
    OVERLOADED_CODES,
    DrainingError,
    DuplicateRequestError,
    EmbeddingFailedError,
    EngineClosedError,
    EngineError,
    GenerationFailedError,
    ImagesNotSupportedError,
    InvalidImageError,
    InvalidModelFolderError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    QueueFullError,
    QueueTimeoutError,
    RequestCancelledError,
    RequestTooLargeError,
    UnknownModelError,
    WrongModelKindError,
)
from models_app.accounting.limits import RateLimitedError
from models_app.models import ModelAlias
from models_app.persistence.persistence import StorageTimeoutError
from models_app.turns.response_turns import ChainError

if TYPE_CHECKING:
    from mlxhost.engine import Done, Failed

logger = logging.getLogger(__name__)

Dialect = Literal["openai", "anthropic"]

INVALID_KEY_MESSAGE = "Missing or invalid API key. Send it as 'Authorization: Bearer <key>' or 'x-api-key'."
UNKNOWN_MODEL_MESSAGE = "The model {name!r} does not exist or is not enabled."
LOAD_RETRY_AFTER_S = 5
# What a client hears when weights fail to load; the reason (with paths) goes to the log and to
# staff (the admin's last action, /readyz for an API key holder), never into a response body.
LOAD_FAILED_MESSAGE = "The model could not be loaded; retry later."
CANCELLED_MESSAGE = "The request was cancelled before it finished."
ABORTED_MESSAGE = "The model stopped serving (unload, reload or shutdown) before the answer finished; retry."
GENERATION_FAILED_MESSAGE = "The model failed while generating."
CONTEXT_MESSAGE = (
    "This model's maximum context length is {limit} tokens. However, your messages resulted in "
    "{tokens} tokens. Please reduce the length of the messages."
)
ANTHROPIC_CONTEXT_MESSAGE = "prompt is too long: {tokens} tokens > {limit} maximum"

# Anthropic names its error types by status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
    529: "overloaded_error",
}


@dataclass
class ApiError(Exception):
    """An error with its HTTP status, OpenAI `type` and machine `code`, safe to show a client."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None
    request_id: str | None = None  # set on a 500, so a report can be matched to the server's log
    # A prompt over the context: (its tokens, the limit), worded per provider (see `error_body`).
    too_long: tuple[int, int] | None = None


# Engine and lookup errors -> (status, type, retry_after); the code is the class's own `code`
# (the table's class, so a subclass reads as its entry). Messages come from the exception.
Coded = type[EngineError] | type[StorageTimeoutError]
ERROR_TABLE: dict[Coded, tuple[int, str, int | None]] = {
    UnknownModelError: (404, "invalid_request_error", None),
    PromptTooLongError: (400, "invalid_request_error", None),
    # Checked against the loaded model before admission (limits.py): never reaches MLX.
    InvalidRequestError: (400, "invalid_request_error", None),
    RequestTooLargeError: (400, "invalid_request_error", None),
    # A chat surface naming an embedding model, or /v1/embeddings a chat model (API-13).
    WrongModelKindError: (400, "invalid_request_error", None),
    # Images (docs/api.md#images): to a model that reads none, or a file over a limit or unreadable.
    ImagesNotSupportedError: (400, "invalid_request_error", None),
    InvalidImageError: (400, "invalid_request_error", None),
    EmbeddingFailedError: (500, "server_error", None),
    InvalidModelFolderError: (503, "server_error", LOAD_RETRY_AFTER_S),
    ModelLoadError: (503, "server_error", LOAD_RETRY_AFTER_S),
    EngineClosedError: (503, "server_error", LOAD_RETRY_AFTER_S),
    # Admission (LANE-2/5/6/7/8); Retry-After comes from the lane's estimate when it has one.
    QueueFullError: (429, "rate_limit_error", 1),
    DrainingError: (503, "server_error", LOAD_RETRY_AFTER_S),
    QueueTimeoutError: (503, "server_error", 1),
    DuplicateRequestError: (409, "invalid_request_error", None),
    RequestCancelledError: (409, "invalid_request_error", None),
    # A parent whose row is still being written (PER-2): retry, never a false 404.
    StorageTimeoutError: (503, "server_error", 1),
}
# A load failure's detail (paths, its own code) is for staff: a client hears a fixed message and
# `model_load_failed`.
_LOAD_FAILURES = (InvalidModelFolderError, ModelLoadError)
# Failed events' codes -> (status, type, fixed message, retry_after); unknown codes are a 500.
_FAILED_EVENTS: dict[str, tuple[int, str, str | None, int | None]] = {
    ModelLoadError.code: (503, "server_error", LOAD_FAILED_MESSAGE, LOAD_RETRY_AFTER_S),
    "model_not_loaded": (503, "server_error", LOAD_FAILED_MESSAGE, LOAD_RETRY_AFTER_S),
    DrainingError.code: (503, "server_error", None, LOAD_RETRY_AFTER_S),
    QueueTimeoutError.code: (503, "server_error", None, 1),
    GenerationFailedError.code: (500, "server_error", GENERATION_FAILED_MESSAGE, None),
}
# Anthropic reports an overloaded server as 529 where OpenAI says 429 or 503 (LANE-2).
_ANTHROPIC_STATUS = dict.fromkeys(OVERLOADED_CODES, 529)


def as_api_error(exc: Exception, *, model: str | None = None) -> ApiError:
    """Map any exception to an ApiError; unknown ones become a bare 500 with nothing leaked."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ChainError):
        return ApiError(exc.status, exc.message, code=exc.code, param=exc.param)
    if isinstance(exc, RateLimitedError):
        # OpenAI's shape for a key's limit (type "requests" or "tokens"); Anthropic's
        # `rate_limit_error` comes from the status (KEY-4).
        return ApiError(429, str(exc), exc.kind, exc.code, retry_after=exc.retry_after)
    if isinstance(exc, ModelAlias.DoesNotExist):
        return ApiError(
            404, UNKNOWN_MODEL_MESSAGE.format(name=model or ""), code=UnknownModelError.code, param="model"
        )
    if isinstance(exc, PromptTooLongError):
        # OpenAI's wording and code: coding agents compact the conversation when they see it.
        tokens = f"at least {exc.prompt_tokens}" if exc.at_least else exc.prompt_tokens
        too_long = CONTEXT_MESSAGE.format(limit=exc.limit, tokens=tokens)
        return ApiError(400, too_long, code=PromptTooLongError.code, too_long=(exc.prompt_tokens, exc.limit))
    for kind, (status, type_, retry_after) in ERROR_TABLE.items():
        if isinstance(exc, kind):
            retry_after = getattr(exc, "retry_after", None) or retry_after
            message, code = str(exc), kind.code
            if isinstance(exc, _LOAD_FAILURES):
                logger.warning("model load failed: %s", exc)  # the detail, for staff only
                message, code = LOAD_FAILED_MESSAGE, ModelLoadError.code
            param = getattr(exc, "param", None)
            return ApiError(status, message, type_, code, param=param, retry_after=retry_after)
    if isinstance(exc, RequestDataTooBig):  # a body read outside `parsing.read_body`
        # The code a request too large for the KV budget hears too: too large either way.
        return ApiError(413, "The request body is too large.", code=RequestTooLargeError.code)
    request_id = request_log.current_request_id()
    # The traceback stays in the server's log; the client gets a fixed text and the id (API-4).
    logger.error("unhandled API error, request id %s", request_id, exc_info=exc)
    if isinstance(exc, EngineError):
        message, code = "The engine failed to handle the request", exc.code
    else:
        message, code = "Internal server error", "internal_error"
    return ApiError(500, f"{message} (request id {request_id}).", "server_error", code, request_id=request_id)


def failed_error(event: Failed) -> ApiError:
    """The error a surface shows for a generation's `Failed` event: load failures are a 503 with
    Retry-After and a fixed message, internal failures a 500 that names nothing."""
    status, type_, message, retry_after = _FAILED_EVENTS.get(
        event.code, (500, "server_error", GENERATION_FAILED_MESSAGE, None)
    )
    if message is not None and message != event.message:
        logger.warning("generation failed (%s): %s", event.code, event.message)
    return ApiError(
        status, message or event.message, type_, event.code, retry_after=event.retry_after or retry_after
    )


def cut_short_error(done: Done) -> ApiError | None:
    """The error that ends an answer the engine stopped early (LANE-6/7), or None for a complete
    or length-limited one: a cut-short answer must never read like a complete one."""
    if done.finish_reason == "cancelled":
        return ApiError(409, CANCELLED_MESSAGE, "invalid_request_error", RequestCancelledError.code)
    if done.finish_reason == "aborted":
        return ApiError(
            503, ABORTED_MESSAGE, "server_error", DrainingError.code, retry_after=LOAD_RETRY_AFTER_S
        )
    return None


def error_body(error: ApiError, dialect: Dialect) -> dict[str, object]:
    if dialect == "anthropic":
        kind = _ANTHROPIC_TYPES.get(error_status(error, dialect), "api_error")
        message = error.message
        if error.too_long is not None:  # Anthropic's exact wording, which Claude Code acts on
            message = ANTHROPIC_CONTEXT_MESSAGE.format(tokens=error.too_long[0], limit=error.too_long[1])
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def error_status(error: ApiError, dialect: Dialect) -> int:
    if dialect == "anthropic":
        return _ANTHROPIC_STATUS.get(error.code or "", error.status)
    return error.status


def error_response(error: ApiError, dialect: Dialect) -> HttpResponse:
    request_log.note_error(error.code or error.type)
    status = error_status(error, dialect)
    response = HttpResponse(
        wire.dumps(error_body(error, dialect)),
        status=status,
        content_type="application/json",
        reason=REASON_PHRASES.get(status),  # 529: Django's log line reads "Overloaded" (issue 25)
    )
    if error.retry_after is not None:
        response["Retry-After"] = str(error.retry_after)
    if error.request_id is not None:
        response["x-request-id"] = error.request_id
    if error.status == 401 and dialect == "openai":
        response["WWW-Authenticate"] = 'Bearer realm="mlxhost"'
    return response


def dialect_of(request: HttpRequest) -> Dialect:
    """The envelope a request outside a known route hears: Anthropic's for its clients (an
    `anthropic-version` header, or a path under /v1/messages), OpenAI's otherwise."""
    if "anthropic-version" in request.headers or request.path.startswith("/v1/messages"):
        return "anthropic"
    return "openai"


@csrf_exempt  # it serves nothing: a POST without a CSRF token hears the 404, not a 403 page
def unknown_route(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """A JSON 404 for a path under /v1/ that no route serves, whatever DEBUG says (API-4)."""
    error = ApiError(404, f"Unknown route: {request.method} {request.path}.", code="unknown_route")
    return error_response(error, dialect_of(request))


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    """Django's `handler400` (a Host header outside ALLOWED_HOSTS, refused before any view):
    under /v1/ the API's envelope, not Django's HTML page (API-4)."""
    if not request.path.startswith("/v1/"):
        return defaults.bad_request(request, exception)
    return error_response(ApiError(400, "Bad request.", code="bad_request"), dialect_of(request))


def page_not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's `handler404`: unknown paths under /v1/ answer in the API's envelope, not HTML (API-4)."""
    if not request.path.startswith("/v1/"):
        return defaults.page_not_found(request, exception)
    return unknown_route(request, exception)
