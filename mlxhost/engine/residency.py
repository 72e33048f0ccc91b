"""Keep-alive and the memory budget (OPS-3): which resident instances to free, and in what order."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from mlxhost.engine.instance import Instance
    from mlxhost.engine.registry import Registry, WeightsKey
    from mlxhost.engine.stats import EngineStats
    from mlxhost.engine.types import ModelSpec

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".gguf")


@dataclass(frozen=True, slots=True)
class MemoryPolicy:
    """Whether an instance may be freed, and after how many idle seconds (None: never for idleness)."""

    pinned: bool
    keep_alive_s: float | None


class Residency:
    """Frees idle instances after their keep-alive and makes room under the memory budget.

    Freeing is a lane writer (LANE-4) that needs an idle lane: nothing is freed under a
    running, queued or preparing request. The instance stays registered (REG-3); the next
    request loads it again while it waits under its pre-dispatch permit (LANE-3).
    """

    def __init__(self, registry: Registry, budget_bytes: int | None, stats: EngineStats) -> None:
        self._registry = registry
        self._budget = budget_bytes
        self._stats = stats
        self._bound_specs: dict[str, ModelSpec] = {}  # each binding's own spec: its alias's policy
        self._sizes: dict[WeightsKey, int] = {}  # bytes of each weights when last loaded
        self.stopped = False  # shutting down: nothing more is freed here

    def bound(self, name: str, spec: ModelSpec) -> None:
        self._bound_specs[name] = spec

    def unbound(self, name: str) -> None:
        self._bound_specs.pop(name, None)

    def policy(self, instance: Instance) -> MemoryPolicy:
        """The instance's policy, merged over every alias that binds it (REG-2)."""
        names = self._registry.names_of(instance)
        specs = [self._bound_specs[name] for name in names if name in self._bound_specs]
        return merged_policy(specs or [instance.spec])

    def resident_bytes(self) -> int:
        """Bytes every instance holds now: weights plus warm sessions (the budget's measure)."""
        return sum(resident_bytes(instance) for instance in self._registry.instances())

    async def unload_idle(self) -> list[int]:
        """Free every resident, unpinned instance idle at least its keep-alive; returns their ids."""
        unloaded = []
        for instance in self._registry.instances():
            policy = self.policy(instance)
            if policy.pinned or policy.keep_alive_s is None or instance.state != "ready":
                continue
            idle = self._evictable(instance) and instance.idle_for() >= policy.keep_alive_s
            if idle and await self._evict(instance, "keep_alive"):
                unloaded.append(instance.instance_id)
        return unloaded

    async def ensure_loaded(self, instance: Instance) -> None:
        """Load `instance` unless resident, evicting least recently used idle instances first when
        the budget says so (and again once the load's real size is known).

        Raises:
            ModelLoadError: the load failed.
        """
        if instance.state == "ready":
            return
        key = instance.spec.weights_key
        await self._make_room(instance, self._sizes.get(key) or estimate_load_bytes(instance.spec))
        await instance.ensure_loaded()
        if loaded := instance.weights_bytes():
            self._sizes[key] = loaded
        await self._make_room(instance, 0)  # the first load of new weights is measured only now

    async def _make_room(self, loading: Instance, needed: int) -> None:
        budget = self._budget
        if budget is None:
            return
        while self.resident_bytes() + needed > budget:
            candidates = [
                other
                for other in self._registry.instances()
                if other is not loading
                and other.state == "ready"
                and not self.policy(other).pinned
                and self._evictable(other)
            ]
            if not candidates:
                logger.warning("memory budget of %d bytes exceeded, nothing idle to evict: loading", budget)
                return
            if not await self._evict(eviction_order(candidates)[0], "memory_budget"):
                return  # shutting down, or it changed under us: load without evicting more

    def _evictable(self, instance: Instance) -> bool:
        # No request holds it (a lease also covers token counting, which runs outside the lane).
        return not instance.busy() and self._registry.holds(instance).leases == 0

    async def _evict(self, instance: Instance, reason: str) -> bool:
        if self.stopped or not self._evictable(instance):
            return False
        # On an empty lane the writer is admitted without yielding: nothing slips in before it.
        async with instance.lane.exclusive():
            if instance.state != "ready":
                return False
            logger.info("unloading instance %s (%s)", instance.instance_id, reason.replace("_", " "))
            await instance.free()
        self._stats.unloaded(instance.instance_id, reason)
        return True


def merged_policy(specs: Iterable[ModelSpec]) -> MemoryPolicy:
    """The policy of an instance that several aliases bind (REG-2): pinned when any alias is,
    kept alive as long as the alias that wants it longest (one that says "never" wins)."""
    specs = list(specs)
    if not specs:
        return MemoryPolicy(pinned=False, keep_alive_s=None)
    pinned = any(spec.pinned for spec in specs)
    waits = [spec.keep_alive_s for spec in specs]
    keep_alive = None if any(w is None for w in waits) else max(w for w in waits if w is not None)
    return MemoryPolicy(pinned=pinned, keep_alive_s=keep_alive)


def resident_bytes(instance: Instance) -> int:
    """What an instance holds now: its weights plus its warm sessions' KV caches."""
    return instance.weights_bytes() + instance.sessions.stats.bytes


def estimate_load_bytes(spec: ModelSpec) -> int:
    """A guess at what loading `spec` takes before it was ever loaded: the weight files of a
    local folder; 0 when unknown (a hub repo not downloaded yet), checked again after the load."""
    folder = Path(spec.source)
    if not folder.is_absolute():
        return 0
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.suffix in WEIGHT_SUFFIXES)
    except OSError:
        return 0


def eviction_order(candidates: Iterable[Instance]) -> list[Instance]:
    """Least recently used first (the oldest `last_used`), ties by instance id."""
    return sorted(candidates, key=lambda instance: (instance.last_used, instance.instance_id))
