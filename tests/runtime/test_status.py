"""The status publisher names each instance's live state and its words (ADM-2, OPS-2, issue 11 item 6)."""

from __future__ import annotations

import pytest

from mlxhost.runtime.status import instance_live_state, live_fields
from models_app.control import LIVE_LABELS


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


async def test_the_status_names_each_instance_kind_and_counts_embedded_tokens_per_second():
    """ADM-2, API-13: the dashboard's rows carry the kind; an embedding model's tokens/s are the
    input tokens it read."""
    from mlxhost.engine import EmbeddingRequest, Engine, EngineConfig, LaneSettings, ModelSpec
    from mlxhost.engine.backends.fake import FakeBackend
    from mlxhost.runtime.control import Actions
    from mlxhost.runtime.status import StatusBuilder

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
