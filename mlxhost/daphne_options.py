"""Daphne's WebSocket handshake and close codes: oversized frames close with 1009, shutdown with
1001 (API-3, OPS-5), and a handshake with another method than GET is a 405 with `Allow`."""

from __future__ import annotations

from typing import Any

# Codes RFC 6455 lets a server send that autobahn's application API (`sendClose`) refuses:
# it accepts only 1000 and 3000-4999, and raised on the consumers' 1001 and 1009.
PROTOCOL_CLOSE_CODES = frozenset({1001, 1008, 1009, 1011})


def configure_daphne_websockets(*, max_frame_bytes: int) -> None:
    """Make daphne send the close codes the README documents. Idempotent; a no-op without daphne.

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
