"""The instance registry: alias bindings, dispatch leases, persist retentions and tombstones (REG-2..7)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxhost.engine.errors import UnknownModelError

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.instance import Instance
    from mlxhost.engine.types import ModelSpec

logger = logging.getLogger(__name__)

WeightsKey = tuple[str, ...]  # ModelSpec.weights_key


@dataclass(slots=True)
class Tombstone:
    """An instance id retired by the persist breaker, kept while any wedged persist may still land."""

    instance_id: int
    outstanding: int


@dataclass(slots=True)
class Holds:
    """Why an instance must stay: alias bindings, in-flight dispatches, pending persists."""

    bindings: int = 0
    leases: int = 0
    retentions: int = 0

    @property
    def idle(self) -> bool:
        return self.bindings == self.leases == self.retentions == 0


class Registry:
    """Maps binding names (aliases) to instances, one instance per distinct weights (REG-2).

    An instance lives while any alias binds it, any request holds a dispatch lease on it, or
    any persist retains it (REG-6). When the last hold goes, `on_teardown` runs once; a bind
    of the same weights before that revives the same instance (same id, lane and queue).
    Memory is O(1) per instance: counters and at most one tombstone per weights key (REG-7).
    """

    def __init__(
        self, create: Callable[[ModelSpec], Instance], on_teardown: Callable[[Instance], None]
    ) -> None:
        self._create = create
        self._on_teardown = on_teardown
        self._by_weights: dict[WeightsKey, Instance] = {}
        self._by_id: dict[int, Instance] = {}
        self._bindings: dict[str, Instance] = {}
        self._holds: dict[int, Holds] = {}
        self._tombstones: dict[WeightsKey, Tombstone] = {}

    def bind(self, name: str, spec: ModelSpec) -> Instance:
        """Bind `name` to the instance of `spec`'s weights, creating it on first sight.

        Re-binding a name to the same weights updates the instance's settings in place
        (REG-5); binding it to other weights is a hot swap: the old instance loses the
        binding and is torn down once its in-flight work settles.

        Raises:
            ValueError: `spec.instance_id` already names different weights (ids never repeat).
        """
        current = self._bindings.get(name)
        if current is not None and current.spec.weights_key == spec.weights_key:
            current.update_spec(spec)
            return current
        instance = self._instance_for(spec)
        self._bindings[name] = instance
        self._holds[instance.instance_id].bindings += 1
        if current is not None:
            self._drop(current, "bindings")
        return instance

    def unbind(self, name: str) -> None:
        """Remove a binding (alias deleted, disabled or swapped away); a no-op for unknown names."""
        instance = self._bindings.pop(name, None)
        if instance is not None:
            self._drop(instance, "bindings")

    def bound(self, name: str) -> Instance | None:
        """The instance bound to `name`, or None."""
        return self._bindings.get(name)

    def resolve(self, name: str) -> Instance:
        """The instance bound to `name`.

        Raises:
            UnknownModelError: nothing is bound under that name.
        """
        try:
            return self._bindings[name]
        except KeyError:
            raise UnknownModelError(f"No model is bound as {name!r}.") from None

    def get(self, instance_id: int) -> Instance:
        try:
            return self._by_id[instance_id]
        except KeyError:
            raise UnknownModelError(f"Instance {instance_id} is not registered.") from None

    def instances(self) -> list[Instance]:
        return list(self._by_id.values())

    def names(self) -> list[str]:
        """Every bound name."""
        return sorted(self._bindings)

    def is_bound(self, name: str) -> bool:
        return name in self._bindings

    def names_of(self, instance: Instance) -> list[str]:
        return sorted(name for name, bound in self._bindings.items() if bound is instance)

    def holds(self, instance: Instance) -> Holds:
        return self._holds.get(instance.instance_id, Holds())

    def lease(self, instance: Instance) -> None:
        """A request is in flight on `instance` (from reserve until its slot is disposed)."""
        self._live_holds(instance).leases += 1

    def unlease(self, instance: Instance) -> None:
        self._drop(instance, "leases")

    def retain(self, instance: Instance) -> None:
        """A persist of a response produced by `instance` is pending; defer teardown.

        Raises:
            UnknownModelError: `instance` was already torn down (its id may live on elsewhere).
        """
        self._live_holds(instance).retentions += 1

    def unretain(self, instance: Instance) -> None:
        self._drop(instance, "retentions")

    def retire_for_force_release(self, instance: Instance) -> int:
        """The persist breaker gave up on a wedged persist: release its retention, keep the id.

        The id goes into a refcounted tombstone for these weights, so a later bind of the same
        weights inherits it and the late-landing row stays chainable (REG-7). Returns the id;
        the caller calls `release_tombstone` when that persist finally settles.
        """
        key = instance.spec.weights_key
        tombstone = self._tombstones.get(key)
        if tombstone is None:
            self._tombstones[key] = Tombstone(instance.instance_id, 1)
        else:
            tombstone.outstanding += 1
        self._drop(instance, "retentions")
        return instance.instance_id

    def release_tombstone(self, weights_key: WeightsKey) -> None:
        """One wedged persist settled; the tombstone goes when none is outstanding (idempotent)."""
        tombstone = self._tombstones.get(weights_key)
        if tombstone is None:
            return
        tombstone.outstanding -= 1
        if tombstone.outstanding <= 0:
            del self._tombstones[weights_key]

    def tombstone(self, weights_key: WeightsKey) -> Tombstone | None:
        return self._tombstones.get(weights_key)

    def _instance_for(self, spec: ModelSpec) -> Instance:
        instance = self._by_weights.get(spec.weights_key)
        if instance is not None:  # an alias of live weights, or a revive before teardown
            instance.update_spec(spec)
            return instance
        tombstone = self._tombstones.get(spec.weights_key)
        instance_id = tombstone.instance_id if tombstone else spec.instance_id
        if instance_id in self._by_id:
            raise ValueError(f"Instance id {instance_id} already names other weights; ids never repeat.")
        if instance_id != spec.instance_id:
            logger.info("weights %s inherit retired instance id %s", spec.source, instance_id)
        instance = self._create(spec if instance_id == spec.instance_id else _with_id(spec, instance_id))
        self._by_weights[spec.weights_key] = instance
        self._by_id[instance_id] = instance
        self._holds[instance_id] = Holds()
        return instance

    def _live_holds(self, instance: Instance) -> Holds:
        # By identity, not id: a torn-down instance's id may have been inherited (REG-7).
        if self._by_id.get(instance.instance_id) is not instance:
            raise UnknownModelError(f"Instance {instance.instance_id} was torn down.")
        return self._holds[instance.instance_id]

    def _drop(self, instance: Instance, hold: str) -> None:
        holds = self._holds.get(instance.instance_id)
        if holds is None or self._by_id.get(instance.instance_id) is not instance:
            return  # already torn down
        setattr(holds, hold, max(0, getattr(holds, hold) - 1))
        if holds.idle:
            del self._by_weights[instance.spec.weights_key]
            del self._by_id[instance.instance_id]
            del self._holds[instance.instance_id]
            self._on_teardown(instance)


def _with_id(spec: ModelSpec, instance_id: int) -> ModelSpec:
    from dataclasses import replace

    return replace(spec, instance_id=instance_id)
