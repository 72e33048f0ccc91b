"""A deterministic in-memory backend for exact engine tests: scripted tokens, gates, history."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from mlxhost.engine.backends.base import ProgressCallback, StepEnd, TokenStep

if TYPE_CHECKING:
    from mlxhost.engine.types import Message, ModelSpec, SamplingParams

DEFAULT_WORD = "tok "
GENERATED_ID_BASE = 100_000  # generated ids never collide with prompt characters
BYTES_PER_TOKEN = 64


def _fake(kv: object) -> FakeCache:
    assert isinstance(kv, FakeCache)
    return kv


class FakeCache:
    """The tokens a fake model has been fed; 64 bytes per token."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.disposed = False


class FakeModel:
    """Tokens are characters of the rendered prompt; outputs come from the backend's script."""

    def __init__(self, backend: FakeBackend, spec: ModelSpec) -> None:
        self._backend = backend
        self.spec = spec
        self.closed = False
        self.shared_cache = backend.shared_cache

    def render_chat(self, messages: Sequence[Message]) -> list[int]:
        self._backend.render_calls += 1
        text = "".join(f"<{m.role}>{m.content}" for m in messages) + "<assistant>"
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, kv: object
    ) -> Iterator[TokenStep | StepEnd]:
        backend, cache = self._backend, _fake(kv)
        backend.history.append((self.spec.instance_id, list(prompt_ids), sampling))
        cache.tokens.extend(prompt_ids)
        pieces = backend.next_script()
        for index in range(sampling.max_tokens):
            if pieces is not None and index >= len(pieces):
                yield StepEnd(text="", finish_reason="stop")
                return
            backend.wait_for_gate()
            backend.tokens_generated += 1
            if index:  # like a real model, each token is fed before the next one is sampled
                cache.tokens.append(GENERATED_ID_BASE + index - 1)
            text = pieces[index] if pieces is not None else DEFAULT_WORD
            yield TokenStep(text=text, token_id=GENERATED_ID_BASE + index)
        yield StepEnd(text="", finish_reason="length")

    def new_cache(self) -> FakeCache:
        return FakeCache()

    def trim_cache(self, kv: object, n: int) -> None:
        cache = _fake(kv)
        del cache.tokens[len(cache.tokens) - n :]

    def cache_length(self, kv: object) -> int:
        return len(_fake(kv).tokens)

    def cache_nbytes(self, kv: object) -> int:
        return BYTES_PER_TOKEN * len(_fake(kv).tokens)

    def dispose_cache(self, kv: object) -> None:
        self._backend.dispose_calls += 1
        if self._backend.dispose_failures:
            self._backend.dispose_failures -= 1
            raise RuntimeError("fake dispose failure")
        _fake(kv).disposed = True

    def memory_bytes(self) -> int:
        return 1024

    def close(self) -> None:
        self.closed = True


class FakeBackend:
    """Test double for the mlx backend.

    `enqueue(["Hel", "lo"])` scripts the next generation (otherwise it repeats `"tok "` up
    to max_tokens); `history` records (instance_id, prompt_ids, sampling) per generation;
    `gate` (a threading.Event) paces every token when `gated` is true; `load_failures`
    makes the next loads raise; `dispose_failures` makes the next cache disposals raise;
    `shared_cache` builds models with one shared cache (SES-5); `render_calls` counts templating.
    """

    name = "fake"

    def __init__(self) -> None:
        self.history: list[tuple[int, list[int], SamplingParams]] = []
        self.loads: list[int] = []
        self.tokens_generated = 0
        self.gate = threading.Event()
        self.gated = False
        self.load_failures = 0
        self.dispose_failures = 0
        self.dispose_calls = 0
        self.render_calls = 0
        self.shared_cache = False
        self._scripts: deque[list[str]] = deque()

    def enqueue(self, pieces: list[str]) -> None:
        self._scripts.append(list(pieces))

    def next_script(self) -> list[str] | None:
        return self._scripts.popleft() if self._scripts else None

    def wait_for_gate(self) -> None:
        if self.gated:
            self.gate.wait(timeout=30)
            self.gate.clear()

    def load(self, spec: ModelSpec, progress: ProgressCallback) -> FakeModel:
        if self.load_failures:
            self.load_failures -= 1
            raise OSError("fake load failure")
        progress(1, 1)
        self.loads.append(spec.instance_id)
        return FakeModel(self, spec)
