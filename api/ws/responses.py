"""`/ws/v1/responses` (API-3): `response.create` / `response.cancel` frames in, Responses events out.

The consumer stays thin: a turn runs through the very service of `POST /v1/responses`
(`models_app.turns.response_turns`), and the frames are the same event objects as its SSE stream.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qs

from autobahn.exception import Disconnected
from django.conf import settings

from api.auth import Caller, authenticate_raw, in_wire_names, presented_key
from api.errors import ApiError, as_api_error, error_body
from api.openai.responses import response_events, response_shape
from api.openai.responses_input import ENGINE_NAMES, ResponsesInput, response_request
from api.openai.views import validated
from api.parsing import loads_object
from api.ws import CLOSE_FORBIDDEN, CLOSE_TOO_BIG, CLOSE_UNAUTHENTICATED
from api.ws.auth import headers_of, origin_allowed, session_user
from api.ws.tracking import TrackedConsumer
from mlxhost import request_log, wire
from mlxhost.engine import OVERLOADED_CODES, EngineError
from mlxhost.runtime import get_engine
from models_app.turns.response_ids import new_response_id
from models_app.turns.response_turns import response_start
from models_app.turns.turns import turn_refuse_if_full

_closing: set[asyncio.Future[None]] = set()  # closes started by a timer, kept until done
AUTH_FRAME_TIMEOUT_S = 10.0
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesConsumer(TrackedConsumer):
    """`/ws/v1/responses`: `response.create` / `response.cancel` frames in, Responses events out.

    Auth: an API key header, the Django session of a page of this site, or, when the URL says
    `?auth=first-frame`, a first frame `{"type": "auth", "api_key": ...}`. A bad frame gets an
    error frame and the socket stays open. Turns run back to back, at most
    MLXHOST_WS_MAX_TURNS at once; closing the socket cancels them.
    """

    caller: Caller | None = None

    async def connect(self) -> None:
        self.turns: dict[str, asyncio.Task[None]] = {}
        self.closed = False
        if not origin_allowed(self.scope):
            await self.close(code=CLOSE_FORBIDDEN)
            return
        raw_key = presented_key(headers_of(self.scope))
        if raw_key:
            key = await authenticate_raw(raw_key)
            if key is None:
                await self.close(code=CLOSE_UNAUTHENTICATED)
                return
            self.caller = Caller.of_key(key)
            await self.watch_credentials(key_id=key.key_id)
        elif (user := session_user(self.scope)) is not None:
            self.caller = Caller(owner_id=user.pk, key_id=None, auth="session")
            await self.watch_credentials(user_id=user.pk)
        elif "first-frame" not in parse_qs(self.scope.get("query_string", b"").decode()).get("auth", []):
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        await self.accept()
        if self.caller is None:
            self._auth_deadline = asyncio.get_running_loop().call_later(
                AUTH_FRAME_TIMEOUT_S, self._auth_expired
            )

    async def credentials_revoked(self, message: dict[str, Any]) -> None:
        if self.revoked:
            return
        await super().credentials_revoked(message)
        await self.disconnect(CLOSE_UNAUTHENTICATED)  # stop the turns now, not at the client's reply

    def _auth_expired(self) -> None:
        if self.caller is None and not self.closed:
            task = asyncio.ensure_future(self.close(code=CLOSE_UNAUTHENTICATED))
            _closing.add(task)  # keep a reference until it is done, or it may be collected
            task.add_done_callback(_closing.discard)

    async def disconnect(self, code: int) -> None:
        self.closed = True
        if not self.turns:
            return
        engine = get_engine()
        for response_id, task in list(self.turns.items()):
            engine.cancel(response_id)  # out of the queue at once, or stopped within one step
            task.cancel()
        await asyncio.wait(self.turns.values(), timeout=5)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        size = len(text_data.encode()) if text_data is not None else len(bytes_data or b"")
        if size > settings.MLXHOST_WS_MAX_FRAME_BYTES:
            await self.close(code=CLOSE_TOO_BIG)
            return
        try:
            frame = _frame(text_data)
            await self._dispatch(frame)
        except Exception as exc:  # every failure is an error frame; the socket stays usable
            await self.send_error(as_api_error(exc))

    async def _dispatch(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if self.caller is not None and not await self.credentials_live():
            await self.credentials_revoked({})  # logged out or revoked, and no push reached us
            return
        if self.caller is None:
            if kind != "auth" or not isinstance(frame.get("api_key"), str):
                await self.close(code=CLOSE_UNAUTHENTICATED)
                return
            key = await authenticate_raw(frame["api_key"])
            if key is None:
                await self.close(code=CLOSE_UNAUTHENTICATED)
                return
            self.caller = Caller.of_key(key)
            await self.watch_credentials(key_id=key.key_id)
            await self.send_json({"type": "auth.ok"})
            return
        if kind == "response.create":
            await self._create({k: v for k, v in frame.items() if k != "type"})
        elif kind == "response.cancel":
            self._cancel(frame.get("response_id"))
        else:
            raise ApiError(
                400,
                "Unknown frame type; send 'response.create' or 'response.cancel'.",
                code="unknown_frame_type",
                param="type",
            )

    async def _create(self, body: dict[str, Any]) -> None:
        if len(self.turns) >= settings.MLXHOST_WS_MAX_TURNS:
            raise ApiError(
                429,
                f"This socket already runs {len(self.turns)} turn(s); wait for one to finish or cancel it.",
                type="rate_limit_error",
                code="too_many_turns",
            )
        response_id = new_response_id()
        try:  # a full lane refuses before the frame is validated (LANE-2)
            caller = self.caller
            await turn_refuse_if_full(
                body.get("model"), caller.key if caller else None, owner_id=caller.owner_id if caller else 0
            )
        except EngineError as exc:
            with request_log.recording(method="WS", path=self.scope["path"]):  # its log line (OPS-6)
                await self.send_error(as_api_error(exc), response_id=response_id)
            return
        data = validated(ResponsesInput, body)
        data["stream"] = True
        task = asyncio.get_running_loop().create_task(self._run_turn(response_id, data))
        self.turns[response_id] = task
        task.add_done_callback(lambda _t: self.turns.pop(response_id, None))

    def _cancel(self, response_id: Any) -> None:
        targets = [response_id] if isinstance(response_id, str) else list(self.turns)
        engine = get_engine()
        for target in targets:
            if target in self.turns:
                engine.cancel(target)  # the turn ends with its terminal event, status "cancelled"

    async def _run_turn(self, response_id: str, data: dict[str, Any]) -> None:
        with request_log.recording(method="WS", path=self.scope["path"]):  # its log line (OPS-6)
            await self._turn(response_id, data)

    async def _turn(self, response_id: str, data: dict[str, Any]) -> None:
        async def on_queued(position: int) -> None:
            await self.send_json(
                {"type": "response.queued", "response_id": response_id, "position": position}
            )

        assert self.caller is not None, "turns start only after auth"
        try:
            started = await response_start(
                response_request(data),
                self.caller.owner_id,
                key=self.caller.key,
                response_id=response_id,
                on_queued=on_queued,
            )
        except Exception as exc:
            self.turns.pop(response_id, None)  # before the client hears: its next turn may start
            error = in_wire_names(as_api_error(exc, model=data.get("model")), ENGINE_NAMES)
            await self.send_error(error, response_id=response_id)
            return
        generation = started.turn.generation
        shape = response_shape(data, started)
        events = response_events(shape, started.turn)
        try:
            async for event in events:
                if event["type"] == "response.created":
                    event["session_cache"] = generation.session_outcome  # what the HTTP header says
                elif event["type"] in TERMINAL_EVENTS:
                    # Turns run back to back (API-3): a create sent the moment this event arrives
                    # must not find the socket's turn still taken.
                    self.turns.pop(response_id, None)
                    if shape.done is not None:  # an extension of the socket's frames (ADM-4)
                        event["timings"] = shape.done.timings.as_body()
                await self.send_json(event)
                if self.closed:
                    return  # the client is gone: the generation stops below
        except wire.NotJSONError as exc:  # a NaN in the answer: the turn's error, not an unreadable frame
            self.turns.pop(response_id, None)
            await self.send_error(as_api_error(exc), response_id=response_id)
        finally:
            # A send that failed (the socket closed) leaves the event generator unfinished; its
            # generation must stop now, not when the generator is collected (LANE-6).
            generation.cancel()
            await events.aclose()  # the turn service records it now: stored as cancelled

    async def send_json(self, payload: dict[str, Any]) -> None:
        if not self.closed:
            try:
                await self.send(text_data=wire.dumps(payload))
            except Disconnected:  # the client left before its disconnect reached us (issue 25)
                self.closed = True

    async def send_error(self, error: ApiError, response_id: str | None = None) -> None:
        request_log.note_error(error.code or error.type)  # a turn's refusal, in its log line
        frame: dict[str, Any] = {"type": "error", "status": error.status, **error_body(error, "openai")}
        if error.code in OVERLOADED_CODES:
            frame["error"]["type"] = "overloaded"  # LANE-2: the socket's word for 429/529
        if response_id is not None:
            frame["response_id"] = response_id
        if error.retry_after is not None:
            frame["retry_after"] = error.retry_after
        await self.send_json(frame)


def _frame(text: str | None) -> dict[str, Any]:
    if text is None:
        raise ApiError(400, "Send JSON text frames, not binary ones.", code="invalid_frame")
    return loads_object(text, what="frame")
