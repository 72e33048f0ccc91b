"""The lifecycle runs registered hooks: start hooks in order, stop hooks by stage after the drain (OPS-5)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mlxhost.runtime import lifecycle


@pytest.fixture
def hooks(monkeypatch):
    """Empty hook lists for one test (the imported modules' own hooks are put back afterwards)."""
    monkeypatch.setattr(lifecycle, "_start_hooks", [])
    monkeypatch.setattr(lifecycle, "_shutdown_hooks", [])
    monkeypatch.setattr(lifecycle, "_stop_hooks", [])
    monkeypatch.setattr(lifecycle, "_start_tasks", set())
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
    lifecycle.set_engine(engine)  # type: ignore[arg-type]
    try:
        lifecycle.on_start(lambda e: log.append(f"start-1 {e is engine}"))
        lifecycle.on_start(lambda e: log.append("start-2"))

        async def close() -> None:
            log.append("close")

        async def flush() -> None:
            log.append("flush")

        async def broken() -> None:
            raise RuntimeError("boom")

        lifecycle.on_stop(close, stage=lifecycle.StopStage.CLOSE)  # registered first, runs last
        lifecycle.on_stop(broken, stage=lifecycle.StopStage.FLUSH)
        lifecycle.on_stop(flush, stage=lifecycle.StopStage.FLUSH)

        await lifecycle.engine_start()
        assert log == ["start-1 True", "start-2"]
        housekeeping = next(iter(lifecycle._start_tasks))
        with caplog.at_level(logging.ERROR):
            await lifecycle.engine_stop()
    finally:
        lifecycle.set_engine(None)
    # Background work is cancelled first; a failing hook is logged and the next ones still run.
    assert housekeeping.cancelled()
    assert log == ["start-1 True", "start-2", "drain", "flush", "close"]
    assert "stop hook" in caplog.text and "boom" in caplog.text


def test_the_runtime_modules_register_their_hooks():
    """Importing the runtime's parts and the consumers registers persistence, control, status and
    socket shutdown; the lifecycle itself imports none of them."""
    import api.ws.tracking
    from mlxhost.runtime import control, persistence, status

    starts = set(lifecycle._start_hooks)
    assert {persistence.start_persistence, control.start_control, status.start_status_publisher} <= starts
    stops = dict((hook, stage) for stage, hook in lifecycle._stop_hooks)
    assert stops[persistence.flush_persistence] == lifecycle.StopStage.FLUSH
    assert stops[api.ws.tracking._close_sockets_at_stop] == lifecycle.StopStage.CLOSE
    assert api.ws.tracking.pin_open_sockets in lifecycle._shutdown_hooks
