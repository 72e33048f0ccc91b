"""WebSocket surfaces: `/ws/v1/responses` (API-3) and the dashboard's live status (ADM-2).

Consumers stay thin: a Responses turn runs through the very service of `POST /v1/responses`
(`models_app.response_turns`), and the frames are the same event objects as its SSE stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import weakref
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from asgiref.sync import sync_to_async
from autobahn.exception import Disconnected
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from api.auth import Caller, authenticate_raw, in_wire_names
from api.errors import ApiError, as_api_error, error_body
from api.openai.responses import response_events, response_shape
from api.openai.responses_input import ENGINE_NAMES, ResponsesInput
from api.openai.views import validated
from api.parsing import loads_object
from api.sampling import sampling_overrides
from mlxhost import daphne_options, request_log, wire
from mlxhost.engine import OVERLOADED_CODES, EngineError
from mlxhost.runtime import get_engine, lifecycle
from models_app import control, selectors
from models_app.response_ids import new_response_id
from models_app.response_turns import response_start
from models_app.turns import turn_refuse_if_full

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine import Timings

logger = logging.getLogger(__name__)
_closing: set[asyncio.Future[None]] = set()  # closes started by a timer, kept until done

# Close codes: 4401/4403 mirror HTTP 401/403; 1009 is the protocol's "message too big".
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404  # a path no route serves
CLOSE_TOO_BIG = 1009
CLOSE_GOING_AWAY = 1001  # the server shuts down
AUTH_FRAME_TIMEOUT_S = 10.0
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _header(scope: dict[str, Any], name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            text: str = value.decode("latin1")
            return text
    return ""


def origin_allowed(scope: dict[str, Any]) -> bool:
    """True when the handshake has no Origin (not a browser) or one of this site.

    "This site" is the Host the browser connected to, or an origin listed in
    MLXHOST_WS_ALLOWED_ORIGINS (for a proxy that rewrites Host).
    """
    origin = _header(scope, b"origin")
    if not origin:
        return True
    allowed = {o.rstrip("/") for o in settings.MLXHOST_WS_ALLOWED_ORIGINS}
    if origin.rstrip("/") in allowed:
        return True
    return urlsplit(origin).netloc.lower() == _header(scope, b"host").lower()


def presented_key(scope: dict[str, Any]) -> str:
    """The API key from `Authorization: Bearer` or `x-api-key`; never from the query string."""
    header = _header(scope, b"authorization")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    return _header(scope, b"x-api-key").strip()


def session_user(scope: dict[str, Any]) -> Any | None:
    """The logged-in, active user of a browser handshake from this site, else None.

    A session cookie counts only with an Origin header: a browser always sends one, and
    `origin_allowed` has checked it is ours (no cross-site WebSocket hijacking).
    """
    user = scope.get("user")
    if user is None or not user.is_authenticated or not user.is_active or not _header(scope, b"origin"):
        return None
    return user


class _TrackedConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]  # channels ships no types: Any
    """A consumer whose accepted sockets the shutdown closes (see `close_open_sockets`)."""

    revoked = False  # its key or login ended: closed with 4401, and it serves nothing more
    _credential_check: Callable[[], bool] | None = None

    async def accept(self, subprotocol: str | None = None, headers: Any = None) -> None:
        await super().accept(subprotocol, headers)
        self._app_task = asyncio.current_task()  # the ASGI instance that runs this consumer
        _open_sockets.add(self)

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch, minus its hop to the sync thread before each incoming frame (to
        close stale database connections): in a burst those hops queued on asgiref's one sync
        thread ahead of every refusal (issue 25 §4). A frame's database work, the credential
        check, goes through `database_sync_to_async`, which closes them itself on that thread."""
        if message["type"] == "websocket.receive":
            await self.websocket_receive(message)
        else:
            await super().dispatch(message)

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        _open_sockets.discard(self)
        await self._unwatch_credentials()
        await super().websocket_disconnect(message)

    async def watch_credentials(self, *, key_id: int | None = None, user_id: int | None = None) -> None:
        """Close this socket with 4401 once its key is revoked or its login ends (API-5).

        The revoke and the logout push a message to the credential's group; a periodic
        re-check (MLXHOST_WS_AUTH_RECHECK_S) catches what sends none, such as an expired session.
        """
        session_key = getattr(self.scope.get("session"), "session_key", None)
        if key_id is not None:
            group, check = (
                control.apikey_group(key_id),
                functools.partial(selectors.apikey_is_live, key_id=key_id),
            )
        elif user_id is not None and session_key:
            group = control.session_group(session_key)
            check = functools.partial(selectors.session_is_live, session_key=session_key, user_id=user_id)
        else:
            return
        self._credential_group, self._credential_check = group, check
        await self.channel_layer.group_add(group, self.channel_name)
        self._recheck = asyncio.get_running_loop().create_task(self._recheck_credentials())

    async def credentials_live(self) -> bool:
        """False once the watched key or login has ended (or the socket was told so); True when
        none is watched. Every frame asks first, so a socket whose close message never came (no
        shared channel layer) still cannot start a turn after a logout (API-5)."""
        if self.revoked:
            return False
        check = self._credential_check
        return check is None or bool(await database_sync_to_async(check)())

    async def _recheck_credentials(self) -> None:
        while True:
            await asyncio.sleep(settings.MLXHOST_WS_AUTH_RECHECK_S)
            try:
                live = await self.credentials_live()
            except Exception:  # the database is away for a moment: the next round asks again
                logger.warning("could not re-check a socket's credentials", exc_info=True)
                continue
            if not live:
                await self.credentials_revoked({})
                return

    async def credentials_revoked(self, message: dict[str, Any]) -> None:
        """The `credentials.revoked` group message: the key was revoked or the login ended."""
        if self.revoked:
            return  # the push and a re-check can both get here
        self.revoked = True
        await self.close(code=CLOSE_UNAUTHENTICATED)

    async def _unwatch_credentials(self) -> None:
        if (task := getattr(self, "_recheck", None)) is not None:
            task.cancel()
        if (group := getattr(self, "_credential_group", None)) is not None:
            await self.channel_layer.group_discard(group, self.channel_name)


_open_sockets: weakref.WeakSet[_TrackedConsumer] = weakref.WeakSet()
_pinned_sockets: list[_TrackedConsumer] = []


def pin_open_sockets() -> None:
    """Hold every open socket until `close_open_sockets` runs (called as shutdown begins).

    Daphne cancels each consumer's ASGI task as shutdown begins; a consumer that then has
    no running turn is only weakly referenced and vanished before its 1001 went out, so the
    client saw 1006.
    """
    _pinned_sockets[:] = list(_open_sockets)


async def close_open_sockets(timeout: float) -> int:
    """Close every open socket with 1001, then end each consumer's ASGI task (OPS-5).

    Runs at shutdown after the drain ended every turn. A consumer still waiting for frames
    when the event loop stops would be finalized with the interpreter, which crashed the
    process at exit (SIGSEGV in a half-torn-down asyncio.Queue). The client's close reply
    may never come while the server stops, so each task is cancelled and awaited (at most
    `timeout`). Returns how many sockets were open.
    """
    sockets = list({*_pinned_sockets, *_open_sockets})
    _pinned_sockets.clear()
    for socket in sockets:
        with contextlib.suppress(Exception):  # a socket that is closing already
            await socket.close(code=CLOSE_GOING_AWAY)
    # The reactor drops connections once the stop hooks return: let the close frames go out and
    # the clients answer them first, or they see 1006 (issue 25).
    if still := await daphne_options.wait_for_closes(timeout):
        logger.warning("%d WebSocket(s) did not finish closing in %.0fs", still, timeout)
    tasks = {t for s in sockets if (t := getattr(s, "_app_task", None)) is not None and not t.done()}
    tasks.discard(asyncio.current_task())
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    _open_sockets.clear()
    return len(sockets)


async def _close_sockets_at_stop() -> None:
    if closed := await close_open_sockets(lifecycle.STOP_GRACE_S):
        logger.info("closed %d open WebSocket(s)", closed)


# Shutdown (OPS-5): hold the sockets as it begins, close them after the drain and the flush.
lifecycle.on_shutdown_begin(pin_open_sockets)
lifecycle.on_stop(_close_sockets_at_stop, stage=lifecycle.StopStage.CLOSE)


class ResponsesConsumer(_TrackedConsumer):
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
        raw_key = presented_key(self.scope)
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
                data,
                self.caller.owner_id,
                sampling_overrides(data),
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
                        event["timings"] = timings_body(shape.done.timings)
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


def timings_body(timings: Timings) -> dict[str, float]:
    """The server's clock of a finished turn, sent with the socket's terminal frame: `queue_ms`
    (waiting in the lane), `ttft_ms` (accepted to first token, the wait included), `prefill_tps`
    and `decode_tps` (output tokens after the first, per second after the first)."""
    return {
        "queue_ms": round(timings.queue_ms, 1),
        "ttft_ms": round(timings.ttft_ms, 1),
        "prefill_tps": round(timings.prefill_tps, 1),
        "decode_tps": round(timings.decode_tps, 1),
    }


def _frame(text: str | None) -> dict[str, Any]:
    if text is None:
        raise ApiError(400, "Send JSON text frames, not binary ones.", code="invalid_frame")
    return loads_object(text, what="frame")


class DashboardConsumer(_TrackedConsumer):
    """`/ws/dashboard`: staff only; pushes every engine's status as it is published (ADM-2)."""

    async def connect(self) -> None:
        user = session_user(self.scope) if origin_allowed(self.scope) else None
        if user is None or not user.is_staff:
            await self.close(code=CLOSE_FORBIDDEN if user is not None else CLOSE_UNAUTHENTICATED)
            return
        await self.channel_layer.group_add(control.DASHBOARD_GROUP, self.channel_name)
        await self.watch_credentials(user_id=user.pk)
        await self.accept()
        for status in await sync_to_async(control.engine_statuses)():
            with contextlib.suppress(Disconnected):  # the page closed already
                await self.send(text_data=wire.dumps({"type": "status", "status": status}))

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(control.DASHBOARD_GROUP, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        pass  # the dashboard only listens; actions go through the admin's forms (CSRF)

    async def credentials_revoked(self, message: dict[str, Any]) -> None:
        await super().credentials_revoked(message)
        await self.channel_layer.group_discard(control.DASHBOARD_GROUP, self.channel_name)

    async def dashboard_status(self, message: dict[str, Any]) -> None:
        if self.revoked:
            return  # closed by a logout: not one more status frame
        with contextlib.suppress(Disconnected):  # the page closed before its disconnect arrived
            await self.send(text_data=wire.dumps({"type": "status", "status": message["status"]}))


class NoRouteConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]  # channels ships no types
    """Any WebSocket path without a route: the handshake is refused (daphne answers 403). Channels
    raised "No route found", which daphne logged with a traceback (issue 25)."""

    async def connect(self) -> None:
        await self.close(code=CLOSE_NOT_FOUND)
