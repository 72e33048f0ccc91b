"""WebSocket surfaces: `/ws/v1/responses` (API-3) and the dashboard's live status (ADM-2).

`auth` checks the handshake's Origin and credentials and watches them (API-5), `tracking` holds
the open sockets and closes them at shutdown (OPS-5), `responses` and `dashboard` are the two
consumers, `no_route` refuses every other path. The routes are in `api.routing`.
"""

from __future__ import annotations

# Close codes: 4401/4403/4404 mirror HTTP 401/403/404; 1009 is the protocol's "message too big".
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404  # a path no route serves
CLOSE_TOO_BIG = 1009
CLOSE_GOING_AWAY = 1001  # the server shuts down
