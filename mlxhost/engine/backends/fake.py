"""A deterministic in-memory backend for exact engine tests: scripted tokens, gates, history."""

from __future__ import annotations

import json
import threading
from collections import deque
from typing import TYPE_CHECKING

from mlxhost.engine.backends.base import BatchStep, ProgressCallback, SequenceCache, StepEnd, TokenStep

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from pathlib import Path

    from mlxhost.engine.types import Message, ModelSpec, SamplingParams

DEFAULT_WORD = "tok "
GENERATED_ID_BASE = 100_000  # generated ids never collide with prompt characters
BYTES_PER_TOKEN = 64
# A script piece that makes that step fail like a sequence's own sampler raising.
FAULT = "\x00fault"


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
        self.vocab_size = backend.vocab_size
        self.context_length = backend.context_length
        self.kv_bytes_per_token = backend.kv_bytes_per_token

    def render_chat(self, messages: Sequence[Message], *, continue_final: bool = False) -> list[int]:
        self._backend.render_calls += 1
        if self._backend.before_render is not None:
            self._backend.before_render(messages)  # runs off the loop, like real templating
        text = "".join(f"<{m.role}>{m.content}" for m in messages) + ("" if continue_final else "<assistant>")
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, kv: object, *, context: Sequence[int] = ()
    ) -> Iterator[TokenStep | StepEnd]:
        backend, cache = self._backend, _fake(kv)
        backend.history.append((self.spec.instance_id, list(prompt_ids), sampling))
        backend.contexts.append(list(context))
        if backend.generate_failures:
            backend.generate_failures -= 1
            raise RuntimeError("fake generation failure")
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
            if text == FAULT:
                raise RuntimeError("fake sampler failure")
            yield TokenStep(text=text, token_id=GENERATED_ID_BASE + index)
        yield StepEnd(text="", finish_reason="length")

    def new_cache(self) -> FakeCache:
        return FakeCache()

    def trim_cache(self, kv: object, n: int) -> None:
        cache = _fake(kv)
        del cache.tokens[len(cache.tokens) - n :]

    def copy_cache(self, kv: object, n: int) -> FakeCache:
        source = _fake(kv)
        assert not source.disposed, "a disposed cache was copied"
        self._backend.copies += 1
        copy = FakeCache()
        copy.tokens = source.tokens[:n]
        return copy

    def save_cache(self, kv: object, path: Path) -> None:
        self._backend.saves += 1
        path.write_text(json.dumps({"tokens": _fake(kv).tokens}))

    def load_cache(self, path: Path) -> FakeCache:
        self._backend.loads_from_disk += 1
        cache = FakeCache()
        cache.tokens = [int(t) for t in json.loads(path.read_text())["tokens"]]
        return cache

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

    def recover(self) -> None:
        self._backend.recoveries += 1

    def open_batch(self, capacity: int) -> FakeBatch | None:
        # One shared mutable cache cannot hold several sequences (SES-5).
        if self.shared_cache or not self._backend.batching:
            return None
        return FakeBatch(self._backend, self.spec.instance_id, capacity)

    def close(self) -> None:
        self.closed = True


class _FakeSequence:
    def __init__(self, cache: FakeCache, pieces: list[str] | None, max_tokens: int) -> None:
        self.cache = cache
        self.pieces = pieces
        self.max_tokens = max_tokens
        self.produced = 0

    @property
    def at_end(self) -> bool:
        # A finished script ends like a model emitting its end-of-sequence token: "stop".
        return self.pieces is not None and self.produced >= len(self.pieces)


class FakeBatch:
    """The fake `BatchRunner`: every sequence follows its own script (taken in insert order).

    One gate pass per step for the whole batch; a step where every sequence only ends
    (its script is done) needs none, as the exclusive fake's final `StepEnd` needs none.
    Like mlx-lm's BatchGenerator, each returned token is already in the sequence's cache.
    """

    def __init__(self, backend: FakeBackend, instance_id: int, capacity: int) -> None:
        self._backend = backend
        self._instance_id = instance_id
        self.capacity = capacity
        self.closed = False
        self._sequences: dict[int, _FakeSequence] = {}
        self._next_handle = 0
        backend.batches.append(self)

    def accepts(self, sampling: SamplingParams) -> bool:
        return not self._backend.exclusive_seeds or sampling.seed is None

    def insert(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, kv: object | None, cached: int
    ) -> int:
        backend = self._backend
        cache = FakeCache() if kv is None else _fake(kv)
        assert len(cache.tokens) == cached, "the cache must hold exactly the cached prefix"
        fed = list(prompt_ids[cached:])
        backend.history.append((self._instance_id, fed, sampling))
        cache.tokens.extend(fed)
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self._sequences[handle] = _FakeSequence(cache, backend.next_script(), sampling.max_tokens)
        return handle

    def step(self) -> list[BatchStep]:
        backend = self._backend
        if not self._sequences:
            return []
        if not all(sequence.at_end for sequence in self._sequences.values()):
            backend.wait_for_gate()
        if backend.batch_step_failures:
            backend.batch_step_failures -= 1
            raise RuntimeError("fake batch step failure")
        backend.batch_steps.append(len(self._sequences))
        steps = []
        for handle, sequence in list(self._sequences.items()):
            if sequence.at_end:
                steps.append(BatchStep(handle, "", None, "stop", self.remove(handle)))
                continue
            index = sequence.produced
            if sequence.pieces is not None and sequence.pieces[index] == FAULT:
                steps.append(BatchStep(handle, "", None, "error", self.remove(handle), failed=True))
                continue
            token = GENERATED_ID_BASE + index
            sequence.cache.tokens.append(token)
            sequence.produced += 1
            backend.tokens_generated += 1
            text = sequence.pieces[index] if sequence.pieces is not None else DEFAULT_WORD
            if sequence.produced >= sequence.max_tokens:
                steps.append(BatchStep(handle, text, token, "length", self.remove(handle)))
            else:
                steps.append(BatchStep(handle, text, token))
        return steps

    def remove(self, handle: int) -> SequenceCache:
        cache = self._sequences.pop(handle).cache
        return SequenceCache(cache, tuple(cache.tokens))

    def close(self) -> None:
        self.closed = True
        self._sequences.clear()


class FakeBackend:
    """Test double for the mlx backend.

    `enqueue(["Hel", "lo"])` scripts the next generation (otherwise it repeats `"tok "` up
    to max_tokens); `history` records (instance_id, prompt_ids, sampling) per generation;
    `gate` (a threading.Event) paces every token (every batch step) when `gated` is true, and
    `parked` says the worker waits on it now; `load_failures` makes the next loads raise;
    `dispose_failures` makes the next cache disposals raise; `shared_cache` builds models with
    one shared cache (SES-5); `render_calls` counts templating and `before_render(messages)`
    runs inside it (a test holds a request in preparation there). Models batch (`FakeBatch`)
    unless `batching` is false; `batch_steps` records the size of every batch step and
    `batches` every batch opened. `generate_failures` makes the next exclusive generations
    raise, `batch_step_failures` the next batch steps (nobody to blame), and a script piece
    `FAULT` fails that one sequence (as its own sampler raising); `recoveries` counts
    `recover()` calls. `vocab_size` and `context_length` are what the
    models report (prompt ids are characters, generated ids start at GENERATED_ID_BASE).
    """

    name = "fake"

    def __init__(self) -> None:
        self.history: list[tuple[int, list[int], SamplingParams]] = []
        self.contexts: list[list[int]] = []  # per exclusive generate: the cached prompt start it was told
        self.loads: list[int] = []
        self.tokens_generated = 0
        self.gate = threading.Event()
        self.gated = False
        self.parked = False  # the worker waits on the gate right now
        self.load_failures = 0
        self.dispose_failures = 0
        self.dispose_calls = 0
        self.copies = 0  # prefix copies handed to requests (copy_cache)
        self.saves = 0  # caches written to the disk tier (save_cache)
        self.loads_from_disk = 0  # and read back (load_cache)
        self.render_calls = 0
        self.before_render: Callable[[Sequence[Message]], None] | None = None
        self.shared_cache = False
        self.batching = True
        self.exclusive_seeds = False  # batches refuse seeded requests (they then run alone)
        self.generate_failures = 0
        self.batch_step_failures = 0
        self.recoveries = 0
        self.vocab_size = GENERATED_ID_BASE + 100_000
        self.context_length: int | None = None
        self.kv_bytes_per_token = 0  # unknown: no KV cost check, unless a test sets BYTES_PER_TOKEN
        self.batch_steps: list[int] = []
        self.batches: list[FakeBatch] = []
        self._scripts: deque[list[str]] = deque()

    def enqueue(self, pieces: list[str]) -> None:
        self._scripts.append(list(pieces))

    def next_script(self) -> list[str] | None:
        return self._scripts.popleft() if self._scripts else None

    def wait_for_gate(self) -> None:
        if self.gated:
            self.parked = True
            self.gate.wait(timeout=30)
            self.parked = False
            self.gate.clear()

    def load(self, spec: ModelSpec, progress: ProgressCallback) -> FakeModel:
        if self.load_failures:
            self.load_failures -= 1
            raise OSError("fake load failure")
        progress(1, 1)
        self.loads.append(spec.instance_id)
        return FakeModel(self, spec)
