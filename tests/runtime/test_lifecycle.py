"""The lifecycle runs installed hooks: start hooks in order, stop hooks by stage after the drain (OPS-5)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mlxhost.runtime import lifecycle


@pytest.fixture
def hooks(monkeypatch):
    """A fresh process with no hooks for one test (the process's own is put back afterwards)."""
    monkeypatch.setattr(lifecycle, "PROCESS", lifecycle.Process())
    monkeypatch.setattr(lifecycle.gc, "freeze", lambda: None)  # keep the test process collectable


class FakeEngine:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.config = type("Config", (), {"shutdown_timeout_s": 1.0})()

    async def housekeeping(self) -> None:
        await asyncio.Event().wait()

    async def shutdown(self) -> None:
        self.log.append("drain")


async def test_start_hooks_run_in_order_and_stop_hooks_after_the_drain_by_stage(hooks, caplog):
    log: list[str] = []
    engine = FakeEngine(log)
    lifecycle.PROCESS.put(lifecycle.ENGINE, engine)  # type: ignore[arg-type]
    try:

        async def close() -> None:
            log.append("close")

        async def flush() -> None:
            log.append("flush")

        async def broken() -> None:
            raise RuntimeError("boom")

        lifecycle.PROCESS.install(
            lifecycle.Hooks(
                start=(lambda e: log.append(f"start-1 {e is engine}"), lambda e: log.append("start-2")),
                stop=(
                    (lifecycle.StopStage.CLOSE, close),  # listed first, runs last
                    (lifecycle.StopStage.FLUSH, broken),
                    (lifecycle.StopStage.FLUSH, flush),
                ),
            )
        )

        await lifecycle.engine_start()
        assert log == ["start-1 True", "start-2"]
        housekeeping = next(iter(lifecycle.PROCESS.tasks))
        with caplog.at_level(logging.ERROR):
            await lifecycle.engine_stop()
    finally:
        lifecycle.PROCESS.put(lifecycle.ENGINE, None)
    # Background work is cancelled first; a failing hook is logged and the next ones still run.
    assert housekeeping.cancelled()
    assert log == ["start-1 True", "start-2", "drain", "flush", "close"]
    assert "stop hook" in caplog.text and "boom" in caplog.text


def test_the_composition_root_lists_every_hook_once():
    """`mlxhost.composition.HOOKS` lists persistence, control, status, the usage flush and socket
    shutdown in one place; importing a module registers nothing."""
    from api.ws import tracking
    from mlxhost import composition
    from models_app.accounting.usage import flush_usage
    from models_app.catalogue import live_status, reconcile
    from models_app.persistence import lifecycle as persistence_lifecycle

    hooks = composition.HOOKS
    assert hooks.start == (
        reconcile.start_control,
        persistence_lifecycle.start_persistence,
        live_status.start_status_publisher,
    )
    assert hooks.stop == (
        (lifecycle.StopStage.FLUSH, persistence_lifecycle.flush_persistence),
        (lifecycle.StopStage.FLUSH, flush_usage),
        (lifecycle.StopStage.CLOSE, tracking.close_sockets_at_stop),
    )
    assert hooks.shutdown_begin == (tracking.pin_open_sockets,)
    process = lifecycle.Process()
    composition.install(process)
    assert process.hooks == hooks


def test_a_shared_object_is_built_once_and_put_back_by_tests():
    built: list[int] = []
    slot = lifecycle.Shared("thing", lambda: built.append(1) or len(built))
    process = lifecycle.Process()
    assert process.peek(slot) is None
    assert process.get(slot) == process.get(slot) == 1
    process.put(slot, 7)
    assert process.get(slot) == 7
    process.put(slot, None)
    assert process.get(slot) == 2
    with pytest.raises(LookupError):
        process.get(lifecycle.Shared("unbuilt"))
