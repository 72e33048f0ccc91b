"""The request path's alias lookup, through the in-process cache (`models_app.hotcache`)."""

from __future__ import annotations

from asgiref.sync import sync_to_async

from models_app import hotcache, selectors
from models_app.models import ModelAlias


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
    alias = hotcache.aliases.get(name)
    if alias is hotcache.MISS:
        generation = hotcache.aliases.generation  # read before the query: an edit meanwhile wins
        alias = await sync_to_async(_lookup_sync)(name, generation)
    if alias is None:
        raise ModelAlias.DoesNotExist(f"No enabled alias named {name!r}.")
    return alias
