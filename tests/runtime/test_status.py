"""The status publisher names each instance's live state and its words (ADM-2, OPS-2, issue 11 item 6)."""

from __future__ import annotations

import pytest

from models_app.catalogue.control import LIVE_LABELS
from models_app.catalogue.live_status import idle_unload_fields, instance_live_state, live_fields
from tests.support import eventually


@pytest.mark.parametrize(
    ("state", "status", "draining", "expected"),
    [
        pytest.param("ready", "ok", False, "resident", id="resident"),
        pytest.param("ready", "degraded", False, "degraded", id="degraded"),
        pytest.param("ready", "ok", True, "draining", id="draining"),
        pytest.param("unloaded", "unloaded", True, "draining", id="draining-after-unload"),
        pytest.param("loading", "loading", False, "loading", id="loading"),
        pytest.param("error", "error", False, "error", id="error"),
        pytest.param("unloaded", "unloaded", False, "unloaded", id="unloaded"),
    ],
)
def test_each_engine_state_gets_one_live_state(state, status, draining, expected):
    assert instance_live_state(state=state, status=status, draining=draining) == expected


def test_the_published_label_is_the_vocabulary_word():
    assert live_fields(state="ready", status="degraded", draining=False) == {
        "live_state": "degraded",
        "label": "resident (degraded)",
    }
    assert (
        live_fields(state="unloaded", status="unloaded", draining=False)["label"] == LIVE_LABELS["unloaded"]
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param({}, (600, "in 10 min"), id="counting-down"),
        pytest.param({"idle_s": 1795.4}, (5, "in 5 s"), id="almost"),
        pytest.param({"keep_alive_s": 7500, "idle_s": 0}, (7500, "in 2 h 5 min"), id="hours"),
        pytest.param({"busy": True}, (None, "30 min after the last request"), id="busy"),
        pytest.param({"pinned": True}, (None, "never (pinned)"), id="pinned"),
        pytest.param({"keep_alive_s": None}, (None, "never (no keep-alive)"), id="no-keep-alive"),
        pytest.param({"live_state": "unloaded"}, (None, "\u2014"), id="not-loaded"),
    ],
)
def test_the_status_says_when_the_keep_alive_frees_an_instance(fields, expected):
    """OPS-3, ADM-7: seconds left and the words the Models page shows, from one place."""
    args = {"live_state": "resident", "pinned": False, "keep_alive_s": 1800, "idle_s": 1200.0, "busy": False}
    got = idle_unload_fields(**{**args, **fields})
    assert (got["unload_in_s"], got["unload_label"]) == expected


async def test_an_admin_action_is_reported_at_once(monkeypatch):
    """ADM-7: the publisher reports as soon as an action starts or ends, not at its next tick."""
    import asyncio

    from models_app.catalogue import live_status as status
    from models_app.catalogue.reconcile import Actions

    class NoInstances:
        def snapshot(self) -> list:
            return []

    published: list[float] = []
    monkeypatch.setattr(status, "STATUS_INTERVAL_S", 60.0)
    monkeypatch.setattr(status.control, "status_publish", lambda payload: published.append(payload["at"]))
    actions = Actions(NoInstances())
    publisher = asyncio.create_task(status.run_status_publisher(NoInstances(), actions))
    try:
        await eventually(lambda: len(published) == 1, timeout=5)
        actions.results["tiny"] = {"action": "unload", "state": "done", "error": "", "at": 1.0}
        actions.changed.set()
        await eventually(lambda: len(published) == 2, timeout=5)  # well before the 60 s tick
    finally:
        publisher.cancel()


async def test_the_status_names_each_instance_kind_and_counts_embedded_tokens_per_second():
    """ADM-2, API-13: the dashboard's rows carry the kind; an embedding model's tokens/s are the
    input tokens it read."""
    from mlxhost.engine import EmbeddingRequest, Engine, EngineConfig, LaneSettings, ModelSpec
    from mlxhost.engine.backends.fake import FakeBackend
    from models_app.catalogue.live_status import StatusBuilder
    from models_app.catalogue.reconcile import Actions

    engine = Engine(EngineConfig(backend="fake"), backend=FakeBackend())
    try:
        engine.bind(
            "embedder", ModelSpec(1, "/m/e", "e" * 64, kind="embedding", lane=LaneSettings(capacity=4))
        )
        engine.bind("chat", ModelSpec(2, "/m/c", "c" * 64))
        builder = StatusBuilder(engine, Actions(engine))
        builder.build()
        await engine.embed(EmbeddingRequest(request_id="e1", binding="embedder", texts=("hello",)))
        views = {view["instance_id"]: view for view in builder.build()["instances"]}
        assert (views[1]["kind"], views[2]["kind"]) == ("embedding", "chat")
        assert views[1]["tokens_per_s"] > 0
    finally:
        await engine.shutdown()
