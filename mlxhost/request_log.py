"""The request log (OPS-6): an id for every API request and one log line when it ends.

An API request (a path under /v1/, and /healthz, /readyz, /metrics) is known by the client's
`x-request-id` when that is sane (1 to 128 letters, digits and `._:-`), else by the id of the turn
it started (`chatcmpl-…`, `cmpl-…`, `resp_…`, `msg_…`: its response id), else by a minted `req_…`.
The id goes back as the `x-request-id` header and opens the line the request leaves on the
`mlxhost.requests` logger as it ends; a streamed answer's line is written when its stream ends:

    request id=resp_… method=POST path=/v1/responses status=200 outcome=stop duration_ms=212.4
    alias=tiny model=tiny instance=3 queue_ms=0.3 first_token_ms=11.9 prompt_tokens=9
    completion_tokens=24 cached_tokens=0 cache=fresh

(one line). It names only these fields: never a key, a header, or any prompt or answer text.
Health probes log at DEBUG, everything else at INFO. WebSocket turns leave the same line, with
method `WS`. The fields also ride on the record as `request_fields`, for a JSON formatter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from mlxhost.engine import Done, Failed
from mlxhost.log_filters import PROBE_PATHS, ClientErrorsOneLine
from mlxhost.middleware import DualMiddleware

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

    from django.http import HttpRequest, HttpResponseBase

    from mlxhost.engine import Generation

logger = logging.getLogger("mlxhost.requests")

HEADER = "x-request-id"
LOGGED_PREFIXES = ("/v1/",)
LOGGED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_BARE_VALUE = re.compile(r"[A-Za-z0-9._:/@+-]+")


# Request ids name log lines; they are not secrets, so they are drawn without a system call:
# os.urandom lets go of the GIL, and in a burst beside a generating worker the loop waited about
# a millisecond a request to take it back (issue 25 §4).
_ids = random.Random()


def mint_request_id() -> str:
    """A fresh `req_` id: 96 random bits, from a generator seeded once per process."""
    return f"req_{_ids.getrandbits(96):024x}"


def sane_id(value: str | None) -> str | None:
    """`value` when it can name a request in a log line as it is, else None."""
    return value if value is not None and _SANE_ID.fullmatch(value) else None


def is_logged(path: str) -> bool:
    return path.startswith(LOGGED_PREFIXES) or path in LOGGED_PATHS


@dataclass
class RequestRecord:
    """What one request's line says, filled in as the request runs."""

    method: str
    path: str
    given_id: str | None = None
    status: int | None = None
    error: str | None = None  # the code of the error it was answered with
    alias: str | None = None
    model: str | None = None
    generation: Generation | None = None
    started: float = field(default_factory=time.monotonic)
    _id: str | None = None
    _written: bool = False

    @property
    def request_id(self) -> str:
        """The request's id, fixed at first use (see the module's docstring)."""
        if self._id is None:
            self._id = self.given_id or mint_request_id()
        return self._id

    def turn_started(self, *, request_id: str, alias: str, model: str, generation: Generation) -> None:
        if self._id is None:
            self._id = self.given_id or request_id
        self.alias, self.model, self.generation = alias, model, generation

    def fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"id": self.request_id, "method": self.method, "path": self.path}
        if self.status is not None:
            fields["status"] = self.status
        fields["outcome"] = self._outcome()
        if self.error is not None:
            fields["error"] = self.error
        fields["duration_ms"] = round((time.monotonic() - self.started) * 1000, 1)
        if self.generation is not None:
            fields.update(self._turn_fields(self.generation))
        return fields

    def _outcome(self) -> str:
        result = self.generation.result if self.generation is not None else None
        if isinstance(result, Done):
            return result.finish_reason
        if isinstance(result, Failed):
            return "failed"
        if self.generation is not None:  # the listener left before the end
            return "cancelled" if self.generation.cancelled else "unfinished"
        return "error" if self.error is not None or (self.status or 200) >= 400 else "ok"

    def _turn_fields(self, generation: Generation) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "alias": self.alias,
            "model": self.model,
            "instance": generation.instance_id,
        }
        result = generation.result
        if isinstance(result, Done):
            fields["queue_ms"] = round(result.timings.queue_ms, 1)
            fields["first_token_ms"] = round(result.timings.ttft_ms, 1)
            fields["prompt_tokens"] = result.usage.prompt_tokens
            fields["completion_tokens"] = result.usage.completion_tokens
            fields["cached_tokens"] = result.usage.cached_tokens
        elif isinstance(result, Failed):
            fields["error"] = result.code
        fields["cache"] = generation.session_outcome
        return fields

    def write(self) -> None:
        """Log the line, once."""
        if self._written:
            return
        self._written = True
        fields = self.fields()
        level = logging.DEBUG if self.path in PROBE_PATHS else logging.INFO
        logger.log(level, "request %s", line_of(fields), extra={"request_fields": fields})


def line_of(fields: dict[str, Any]) -> str:
    """`key=value` pairs; a value with anything but plain characters is JSON-quoted."""
    parts = []
    for key, value in fields.items():
        text = "-" if value is None else str(value)
        parts.append(f"{key}={text if _BARE_VALUE.fullmatch(text) else json.dumps(text)}")
    return " ".join(parts)


_current: ContextVar[RequestRecord | None] = ContextVar("mlxhost_request_record", default=None)


def current() -> RequestRecord | None:
    """The record of the request running now, if it is logged."""
    return _current.get()


def current_request_id() -> str:
    """The running request's id, or a fresh `req_…` outside one (a 500 names it to the client)."""
    record = _current.get()
    return record.request_id if record is not None else mint_request_id()


def running_request_id() -> str | None:
    """The running request's id; None outside one (a log filter names it, never mints one)."""
    record = _current.get()
    return record.request_id if record is not None else None


ClientErrorsOneLine.request_id = staticmethod(running_request_id)  # its lines name the request


def note_error(code: str | None) -> None:
    """The running request is answered with the error `code`."""
    record = _current.get()
    if record is not None and code:
        record.error = code


def note_turn(*, request_id: str, alias: str, model: str, generation: Generation) -> None:
    """The running request started a turn (the turn service tells it here)."""
    record = _current.get()
    if record is not None:
        record.turn_started(request_id=request_id, alias=alias, model=model, generation=generation)


@contextmanager
def recording(*, method: str, path: str) -> Iterator[RequestRecord]:
    """Record what runs inside as one request and write its line at the end (a WebSocket turn)."""
    record = RequestRecord(method=method, path=path)
    token = _current.set(record)
    try:
        yield record
    finally:
        _current.reset(token)
        record.write()


class RequestLogMiddleware(DualMiddleware):
    """Give each API request its id and `x-request-id` header, and write its line when it ends."""

    def _call(self, request: HttpRequest) -> HttpResponseBase:
        if not is_logged(request.path):
            return cast("HttpResponseBase", self.get_response(request))
        record = self._begin(request)
        token = _current.set(record)
        try:
            response = cast("HttpResponseBase", self.get_response(request))
        finally:
            _current.reset(token)
        return _finish(record, response)

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        get_response = cast("Callable[[HttpRequest], Awaitable[HttpResponseBase]]", self.get_response)
        if not is_logged(request.path):
            return await get_response(request)
        record = self._begin(request)
        token = _current.set(record)  # reset below: the test client runs requests in one context
        try:
            response = await get_response(request)
        except asyncio.CancelledError:
            record.write()  # the client left before the answer: its line all the same (OPS-6)
            raise
        finally:
            _current.reset(token)
        return _finish(record, response)

    @staticmethod
    def _begin(request: HttpRequest) -> RequestRecord:
        return RequestRecord(
            method=request.method or "", path=request.path, given_id=sane_id(request.headers.get(HEADER))
        )


def _finish(record: RequestRecord, response: HttpResponseBase) -> HttpResponseBase:
    record.status = response.status_code
    response[HEADER] = record.request_id
    if not response.streaming:
        record.write()
        return response
    # Written when the stream ends, or when the client leaves (the generator is closed).
    streaming = cast("Any", response)
    if streaming.is_async:
        streaming.streaming_content = _written_after_async(record, streaming.streaming_content)
    else:
        streaming.streaming_content = _written_after(record, streaming.streaming_content)
    return response


async def _written_after_async(record: RequestRecord, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        record.write()


def _written_after(record: RequestRecord, chunks: Iterator[bytes]) -> Iterator[bytes]:
    try:
        yield from chunks
    finally:
        record.write()
