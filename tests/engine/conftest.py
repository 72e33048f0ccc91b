"""Engine fixtures: the fake backend and an engine around it; no Django, no database."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

import pytest

from mlxhost.engine import (
    Engine,
    EngineConfig,
    Generation,
    GenerationRequest,
    Message,
    ModelSpec,
    Permit,
    SamplingParams,
    SessionQuery,
)
from mlxhost.engine.backends.fake import FakeBackend
from tests.support import FakeClock, eventually


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


def _ungate(backend: FakeBackend) -> None:
    # A test that failed mid-way may leave the worker parked on the gate; let teardown finish fast.
    backend.gated = False
    backend.gate.set()


@dataclass(frozen=True, slots=True)
class SpecRequest(GenerationRequest):
    """A request that also says which weights its name stands for, so a test engine can bind
    the name on first sight, as control would before the request arrived."""

    spec: ModelSpec | None = None


class TestEngine(Engine):
    """The engine, plus a first-sight bind of an unbound name from a `SpecRequest`'s spec: what
    reconcile does for the database before any request arrives. It never re-binds a bound
    name; tests of swaps and settings changes call `bind` themselves, as control does."""

    async def submit(self, request: GenerationRequest, permit: Permit | None = None) -> Generation:
        self._bind_first(request)
        return await super().submit(request, permit)

    async def count_tokens(self, request: GenerationRequest) -> int:
        self._bind_first(request)
        return await super().count_tokens(request)

    def _bind_first(self, request: GenerationRequest) -> None:
        spec_ = getattr(request, "spec", None)
        if spec_ is not None and not self.bound(request.binding) and not self._closed and not self._stopping:
            self.bind(request.binding, spec_)


@pytest.fixture
async def engine(backend: FakeBackend):
    engine = TestEngine(EngineConfig(backend="fake"), backend=backend)
    yield engine
    _ungate(backend)
    await engine.shutdown()


@pytest.fixture
async def make_engine(backend: FakeBackend):
    """Build engines with their own config or clock on the shared fake backend; all shut down after."""
    engines: list[Engine] = []

    def make(clock: Callable[[], float] | None = None, **config) -> Engine:
        config.setdefault("backend", "fake")
        kwargs = {"clock": clock} if clock is not None else {}
        engine = TestEngine(EngineConfig(**config), backend=backend, **kwargs)
        engines.append(engine)
        return engine

    yield make
    _ungate(backend)
    for engine in engines:
        await engine.shutdown()


def spec(instance_id: int = 1, **overrides) -> ModelSpec:
    overrides.setdefault("source", f"/models/fake-{instance_id}")
    return ModelSpec(instance_id=instance_id, fingerprint="f" * 64, **overrides)


def request(
    request_id: str = "req-1",
    *,
    instance_id: int = 1,
    text: str = "hi",
    messages: tuple[Message, ...] | None = None,
    binding: str = "",
    session: SessionQuery | None = None,
    spec_: ModelSpec | None = None,
    max_input_tokens: int | None = None,
    **sampling,
) -> SpecRequest:
    """A chat request; `spec_` overrides the model spec, `messages` the single user message.
    Without a `binding` the name is "instance:<id>" of the spec."""
    model = spec_ if spec_ is not None else spec(instance_id)
    return SpecRequest(
        request_id=request_id,
        binding=binding or f"instance:{model.instance_id}",
        sampling=SamplingParams(**sampling),
        messages=messages if messages is not None else (Message(role="user", content=text),),
        session=session,
        max_input_tokens=max_input_tokens,
        spec=model,
    )


async def collect(generation) -> list:
    """Every event of a generation's stream, up to and including the terminal one."""
    return [event async for event in generation.stream()]


async def until(predicate: Callable[[], object], timeout: float = 3.0, what: str = "") -> None:
    """Wait for `predicate` to hold (`tests.support.eventually`); fail after `timeout` seconds."""
    await eventually(predicate, timeout=timeout, what=what)


def lane_of(engine: Engine, instance_id: int = 1) -> dict:
    """The LANE-9 probe of one instance, as `engine.snapshot()` reports it."""
    for snap in engine.snapshot():
        if snap["instance_id"] == instance_id:
            return snap["lane"]  # type: ignore[return-value]
    raise AssertionError(f"instance {instance_id} is not in the snapshot")


async def lane_idle(engine: Engine, instance_id: int = 1) -> None:
    """Wait until the instance's lane holds nothing: the last `Done` is posted before the slot is freed."""

    def idle() -> bool:
        lane = lane_of(engine, instance_id)
        return lane["active"] == lane["queued"] == lane["permits"] == 0

    await until(idle, what=f"lane of instance {instance_id} to go idle")


async def next_event(stream, timeout: float = 3.0):
    """The next event of an open stream, failing instead of hanging."""
    return await asyncio.wait_for(anext(stream), timeout)
