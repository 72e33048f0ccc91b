"""On-demand alias binding, the turn service's first step: a request for an alias nothing has
bound yet (not pinned, so not bound at start) binds it as the database has it now (REG-5)."""

from __future__ import annotations

from asgiref.sync import sync_to_async

from mlxhost.engine import Engine, ModelSpec, UnknownModelError
from mlxhost.runtime import get_engine
from models_app.catalogue import selectors, specs
from models_app.models import ModelAlias


async def bind_on_demand(engine: Engine, name: str) -> None:
    """Bind the alias `name` as the database has it now, unless the engine already serves it.

    The first request for a name that is not pinned (and so not bound at start) comes here. It
    reads the row afresh, never the caller's copy, and never re-binds a bound name: a request
    that read the row before an admin swap cannot move the name back (REG-5).

    Raises:
        UnknownModelError: no enabled alias has that name.
    """
    if engine.bound(name):
        return
    try:
        spec = await sync_to_async(_spec_of_alias)(name)
    except ModelAlias.DoesNotExist:
        raise UnknownModelError(f"No model is served as {name!r}.") from None
    if not engine.bound(name):  # another request bound it while this one read the row
        engine.bind(name, spec)


async def engine_for(name: str) -> Engine:
    """This process's engine, serving the alias `name` (bound on demand if nothing has yet).

    Raises:
        UnknownModelError: no enabled alias has that name.
    """
    engine = get_engine()
    await bind_on_demand(engine, name)
    return engine


def _spec_of_alias(name: str) -> ModelSpec:
    return specs.model_spec_for(alias=selectors.alias_resolve(name=name))
