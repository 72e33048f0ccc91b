"""Stored-response ids, and the fleet host each one was made on (issue 15).

An id is `resp_` and 32 hex digits. On a fleet host (`MLXHOST_HOST_ID` 1..255) the first two
digits are the host's number, so the load balancer can send a continuation, a retrieve or a cancel
to the host that made the response and holds its KV cache (deploy/haproxy.cfg); the other 30 are
random (120 bits). Without a host id all 32 are random, as before. The number says where a turn
ran, nothing more: every lookup is still tenant-scoped (PER-6).
"""

from __future__ import annotations

import re
import secrets

from django.conf import settings

_HOME = re.compile(r"resp_([0-9a-f]{2})[0-9a-f]{30}")


def new_response_id() -> str:
    host: int | None = settings.MLXHOST_HOST_ID
    if host is None:
        return f"resp_{secrets.token_hex(16)}"
    return f"resp_{host:02x}{secrets.token_hex(15)}"


def home_host(public_id: str) -> int | None:
    """The host number an id was minted on (any 32-digit id has one; only a fleet's mean a host)."""
    match = _HOME.fullmatch(public_id)
    return int(match[1], 16) if match else None
