"""Engine fixtures: the fake backend and an engine around it; no Django, no database."""

from __future__ import annotations

import pytest

from mlxhost.engine import Engine, EngineConfig, GenerationRequest, Message, ModelSpec, SamplingParams
from mlxhost.engine.backends.fake import FakeBackend


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def engine(backend: FakeBackend):
    engine = Engine(EngineConfig(backend="fake"), backend=backend)
    yield engine
    await engine.shutdown()


def spec(instance_id: int = 1, **overrides) -> ModelSpec:
    overrides.setdefault("source", f"/models/fake-{instance_id}")
    return ModelSpec(instance_id=instance_id, fingerprint="f" * 64, **overrides)


def request(
    request_id: str = "req-1", *, instance_id: int = 1, text: str = "hi", **sampling
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        model=spec(instance_id),
        sampling=SamplingParams(**sampling),
        messages=(Message(role="user", content=text),),
    )
