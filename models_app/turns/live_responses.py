"""Responses being generated, by id, and their tenant: for a tenant-scoped cancel from any host.

This process keeps its own table. In a fleet (issue 15; Redis configured) each id is also put in
the shared cache while it runs, so a cancel that reaches another host is sent over the channel
layer to the engine process running it (`control.cancel_everywhere`). The shared entry expires on
its own after `SHARED_TTL_S`, so a host that died leaves nothing behind for long.
"""

from __future__ import annotations

import asyncio
import logging

from django.conf import settings
from django.core.cache import cache

logger = logging.getLogger(__name__)

KEY = "live-response:{public_id}"
SHARED_TTL_S = 6 * 3600  # longer than any stream; a dead host's entries go by themselves
_owners: dict[str, int] = {}
_clearing: set[asyncio.Task[None]] = set()


def _shared() -> bool:
    return bool(settings.REDIS_URL)


async def started(public_id: str, owner_id: int) -> None:
    _owners[public_id] = owner_id
    if _shared():
        try:
            await cache.aset(KEY.format(public_id=public_id), owner_id, timeout=SHARED_TTL_S)
        except Exception as exc:  # Redis away: a cancel still works on this host
            logger.warning("could not share live response %s (%s)", public_id, exc)


def ended(public_id: str) -> None:
    """Forget `public_id` (call on the loop); the shared entry is removed in the background."""
    if _owners.pop(public_id, None) is None or not _shared():
        return
    task = asyncio.get_running_loop().create_task(_clear(public_id))
    _clearing.add(task)  # keep a reference until done
    task.add_done_callback(_clearing.discard)


async def _clear(public_id: str) -> None:
    try:
        await cache.adelete(KEY.format(public_id=public_id))
    except Exception as exc:
        logger.warning("could not clear live response %s (%s)", public_id, exc)


def cancel_here(*, public_id: str, owner_id: int) -> bool:
    """Stop `public_id` if this process runs it for `owner_id` (a local cancel, or one another
    host sent over the channel layer); whether it did."""
    if _owners.get(public_id) != owner_id:
        return False
    from mlxhost.runtime import get_engine

    get_engine().cancel(public_id)
    return True


def local_owner(public_id: str) -> int | None:
    """The tenant of a response this process is generating."""
    return _owners.get(public_id)


async def shared_owner(public_id: str) -> int | None:
    """The tenant of a response some host of the fleet is generating (None without Redis)."""
    if not _shared():
        return None
    try:
        value = await cache.aget(KEY.format(public_id=public_id))
    except Exception as exc:
        logger.warning("could not read live responses (%s)", exc)
        return None
    return value if isinstance(value, int) else None
