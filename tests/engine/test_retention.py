"""`Engine.retain` and its `Retention` handle (REG-6, REG-7), counted against the fake backend."""

from __future__ import annotations

import pytest

from mlxhost.engine import Retention, UnknownModelError
from tests.engine.conftest import spec

X = spec(1)


def holds(engine, instance_id: int):
    return engine.registry.holds(engine.get(instance_id))


async def test_retain_counts_one_hold_and_release_gives_it_back_once(engine):
    """REG-6: a retention is one hold; a second release never drops another's hold."""
    engine.bind("a", X)
    first = engine.retain(1)
    second = engine.retain(1)
    assert isinstance(first, Retention)
    assert (first.instance_id, first.fingerprint, first.weights_key) == (1, X.fingerprint, X.weights_key)
    assert holds(engine, 1).retentions == 2
    first.release()
    first.release()  # idempotent
    assert holds(engine, 1).retentions == 1
    assert not first.held and second.held


async def test_a_retained_instance_outlives_its_unbind_until_released(engine):
    """REG-6: the pending persist keeps the instance (and its id) until the row lands."""
    instance = engine.bind("a", X)
    retention = engine.retain(1)
    engine.unbind("a")
    assert engine.get(1) is instance
    assert holds(engine, 1).bindings == 0
    retention.release()
    with pytest.raises(UnknownModelError):
        engine.get(1)


async def test_retain_of_an_unknown_instance_raises(engine):
    with pytest.raises(UnknownModelError):
        engine.retain(7)


async def test_retire_tombstones_the_id_and_settle_late_frees_it(engine):
    """REG-7: a force release keeps the id for the weights; the late landing releases it once."""
    engine.bind("a", X)
    retention = engine.retain(1)
    engine.unbind("a")
    assert retention.retire() == 1
    assert retention.retire() == 1  # idempotent: one tombstone share, not two
    with pytest.raises(UnknownModelError):
        engine.get(1)
    assert engine.registry.tombstone(X.weights_key).outstanding == 1
    heir = engine.bind("a", spec(9, source=X.source))
    assert heir.instance_id == 1  # inherited from the tombstone
    retention.release()  # after retire: a no-op, the heir keeps its binding
    assert engine.registry.holds(heir).bindings == 1
    retention.settle_late()
    retention.settle_late()
    assert engine.registry.tombstone(X.weights_key) is None


async def test_settle_late_without_retire_is_a_no_op(engine):
    engine.bind("a", X)
    retention = engine.retain(1)
    retention.settle_late()
    assert holds(engine, 1).retentions == 1
    retention.release()
    assert holds(engine, 1).retentions == 0
