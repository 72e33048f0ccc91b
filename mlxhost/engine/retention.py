"""`Retention`: a pending persist's hold on the instance that produced its response (REG-6, REG-7)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from mlxhost.engine.instance import Instance
    from mlxhost.engine.registry import Registry, WeightsKey


class Retention:
    """Keeps an instance registered (same id, same lane) until a stored response lands.

    Take one with `Engine.retain(instance_id)`. Exactly one of `release()` (the row landed, or
    nothing was stored) and `retire()` (the persist breaker gave up, PER-4) ends it; after
    `retire()`, `settle_late()` runs when the wedged write finally lands. Every method is
    idempotent, so a callback that fires twice never drops another request's hold.
    """

    def __init__(self, registry: Registry, instance: Instance) -> None:
        self._registry = registry
        self._instance = instance
        self.instance_id = instance.instance_id
        self.fingerprint = instance.spec.fingerprint
        self.weights_key: WeightsKey = instance.spec.weights_key
        self._state: Literal["held", "released", "retired", "settled"] = "held"

    @property
    def held(self) -> bool:
        return self._state == "held"

    def release(self) -> None:
        """Give the hold back; the instance may be torn down if nothing else holds it (REG-6)."""
        if self._state != "held":
            return
        self._state = "released"
        self._registry.unretain(self._instance)

    def retire(self) -> int:
        """Force-release: drop the hold but keep the id in a tombstone for these weights (REG-7).

        Returns the kept instance id; a later bind of the same weights inherits it, so the row
        that lands late stays chainable.
        """
        if self._state == "held":
            self._state = "retired"
            self._registry.retire_for_force_release(self._instance)
        return self.instance_id

    def settle_late(self) -> None:
        """The wedged persist landed after `retire()`: release its share of the tombstone."""
        if self._state != "retired":
            return
        self._state = "settled"
        self._registry.release_tombstone(self.weights_key)
