"""Daphne's WebSocket handshake and close codes (oversized frames close with 1009, shutdown with
1001; API-3, OPS-5; a handshake with another method than GET is a 405 with `Allow`) and the reason
phrases of the statuses the standard tables lack (529, Anthropic's overloaded)."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

# Statuses neither Python's `http.HTTPStatus` (Django's reason phrases, its request log) nor
# Twisted's `http.RESPONSES` (daphne's status line) knows: without a phrase they read
# "Unknown Status Code" in the log and "529 Unknown Status" on the wire (issue 25).
REASON_PHRASES = {529: "Overloaded"}


def configure_status_phrases() -> None:
    """Give daphne's status line a reason phrase for every status in REASON_PHRASES. Idempotent;
    a no-op without Twisted (another ASGI server writes its own)."""
    try:
        from twisted.web import http
    except ImportError:
        return
    for status, phrase in REASON_PHRASES.items():
        http.RESPONSES.setdefault(status, phrase.encode())


# Codes RFC 6455 lets a server send that autobahn's application API (`sendClose`) refuses:
# it accepts only 1000 and 3000-4999, and raised on the consumers' 1001 and 1009.
PROTOCOL_CLOSE_CODES = frozenset({1001, 1008, 1009, 1011})
# Sockets a consumer closed, until their closing handshake ends (see `wait_for_closes`).
_closing: weakref.WeakSet[Any] = weakref.WeakSet()


def configure_daphne_websockets(*, max_frame_bytes: int) -> None:
    """Make daphne send the close codes docs/api.md documents. Idempotent; a no-op without daphne.

    - A frame over `max_frame_bytes` closes with 1009. Daphne caps messages at its own
      `--websocket-max-message-size` (1 MiB) and autobahn then dropped the TCP connection
      (`failByDrop`), so the client saw 1006; failing with a closing handshake sends 1009,
      and the cap follows MLXHOST_WS_MAX_FRAME_BYTES instead of a command-line flag.
    - A consumer's close with 1001 (shutdown), 1008, 1009 or 1011 is sent as that code; daphne
      passed it to autobahn's `sendClose`, which raised, so no close frame went out (1006).
    - A WebSocket upgrade sent with POST (or any method but GET) is refused by autobahn, below
      Django, with a 405 that had no `Allow` header (RFC 9110 requires one): it says GET.
    """
    try:
        from daphne.ws_protocol import WebSocketFactory, WebSocketProtocol
    except ImportError:  # another ASGI server sends the consumers' codes itself
        return
    if getattr(WebSocketFactory, "_mlxhost_configured", False):
        return
    set_options = WebSocketFactory.setProtocolOptions
    server_close = WebSocketProtocol.serverClose
    fail_handshake = WebSocketProtocol.failHandshake

    def set_protocol_options(self: Any, *args: Any, **kwargs: Any) -> None:
        set_options(self, *args, **kwargs)
        # Daphne sets its options once, after building the factory; ours win.
        self.failByDrop = False
        self.maxMessagePayloadSize = self.maxFramePayloadSize = max_frame_bytes

    def close_with_protocol_codes(self: Any, code: int | None = None) -> None:
        if code in PROTOCOL_CLOSE_CODES:
            self.sendCloseFrame(code=code, isReply=False)  # as daphne itself sends 1011
        else:
            server_close(self, code=code)
        _closing.add(self)

    def fail_handshake_with_allow(
        self: Any,
        reason: str,
        code: int = 400,
        responseHeaders: Any = None,  # autobahn calls it by keyword
    ) -> None:
        if code == 405:  # the opening handshake is a GET (RFC 6455 §4.1)
            responseHeaders = [*(responseHeaders or []), ("Allow", "GET")]
        fail_handshake(self, reason, code, responseHeaders)

    WebSocketFactory.setProtocolOptions = set_protocol_options
    WebSocketProtocol.failHandshake = fail_handshake_with_allow
    WebSocketProtocol.serverClose = close_with_protocol_codes
    WebSocketFactory._mlxhost_configured = True


async def wait_for_closes(timeout: float) -> int:
    """Wait until every socket a consumer closed has finished its closing handshake, at most
    `timeout` seconds; returns how many are still closing (0 without daphne).

    At shutdown the reactor drops every connection as soon as the stop hooks return: a close frame
    still in the write buffer then never left, and the client saw 1006 instead of 1001 (issue 25).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        closing = [p for p in list(_closing) if p.state != p.STATE_CLOSED]
        if not closing or loop.time() >= deadline:
            return len(closing)
        await asyncio.sleep(0.02)  # the handshake runs on the reactor; poll its state
