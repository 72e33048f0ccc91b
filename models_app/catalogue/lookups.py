"""The request path's cached lookups (`models_app.catalogue.hotcache`), each miss read once for a burst."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypeVar, cast

from asgiref.sync import sync_to_async

from models_app.catalogue import hotcache, selectors
from models_app.models import ModelAlias

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

T = TypeVar("T")

_inflight: dict[tuple[str, Any], asyncio.Future[Any]] = {}


async def single_flight(kind: str, key: Any, load: Callable[[], Awaitable[T]]) -> T:
    """Run `load()` once for concurrent callers asking for the same `key`: a burst that arrives
    after the cache entry expired makes one database read, not one per request (each would
    queue on asgiref's one sync thread). The first caller's error reaches every waiter."""
    flight = _inflight.get((kind, key))
    if flight is not None:  # started by a caller with the same (kind, key), so the same loader type
        return cast("T", await asyncio.shield(flight))
    flight = asyncio.get_running_loop().create_future()
    _inflight[(kind, key)] = flight
    try:
        value = await load()
    except BaseException as exc:
        if not flight.done():
            flight.set_exception(exc if isinstance(exc, Exception) else RuntimeError("lookup cancelled"))
            flight.exception()  # retrieved: waiters may be none
        raise
    else:
        flight.set_result(value)
        return value
    finally:
        _inflight.pop((kind, key), None)


ALIAS_NAME_MAX = ModelAlias._meta.get_field("name").max_length or 64


def _lookup_sync(name: str, generation: int) -> ModelAlias | None:
    try:
        alias = selectors.alias_resolve(name=name)
    except ModelAlias.DoesNotExist:
        alias = None  # cached too: a burst naming a missing model must not hit the database
    hotcache.aliases.put(name, alias, generation)
    return alias


async def alias_resolve(name: str) -> ModelAlias:
    """The enabled alias called `name`, with its instance, cached for `hotcache.ALIAS_TTL_S`.

    A warm lookup runs on the loop without the database, so a full lane refuses at once. The
    alias is shared between requests: read it, never save it.

    Raises:
        ModelAlias.DoesNotExist: no enabled alias has that name.
    """
    if len(name) > ALIAS_NAME_MAX or "\x00" in name:
        # No alias can have it (a slug of at most 64): no query (PostgreSQL refuses NUL in text,
        # and the fast refusal looks a name up before the body is validated), nothing cached.
        raise ModelAlias.DoesNotExist(f"No enabled alias named {name[:ALIAS_NAME_MAX]!r}.")
    cached = hotcache.aliases.get(name)
    if cached is hotcache.MISS:
        generation = hotcache.aliases.generation  # read before the query: an edit meanwhile wins
        alias = await single_flight("alias", name, lambda: sync_to_async(_lookup_sync)(name, generation))
    else:
        alias = cached
    if alias is None:
        raise ModelAlias.DoesNotExist(f"No enabled alias named {name!r}.")
    return alias
