"""A deterministic in-memory backend for exact engine tests: scripted tokens, gates, history."""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxhost.engine.backends.base import DraftCounts, ProgressCallback, StepEnd, TokenStep

# The batch, its caches and its pieces live in fake_batch.py; still imported from here.
from mlxhost.engine.backends.fake_batch import BYTES_PER_TOKEN as BYTES_PER_TOKEN
from mlxhost.engine.backends.fake_batch import DEFAULT_MAX_DRAFT as DEFAULT_MAX_DRAFT
from mlxhost.engine.backends.fake_batch import DEFAULT_WORD as DEFAULT_WORD
from mlxhost.engine.backends.fake_batch import FAULT as FAULT
from mlxhost.engine.backends.fake_batch import GENERATED_ID_BASE as GENERATED_ID_BASE
from mlxhost.engine.backends.fake_batch import FakeBatch as FakeBatch
from mlxhost.engine.backends.fake_batch import FakeCache as FakeCache
from mlxhost.engine.backends.fake_batch import _fake, fake_logprob

# The embedding model lives in fake_embedding.py; its ids and vectors are still imported from here.
from mlxhost.engine.backends.fake_embedding import EMBED_END as EMBED_END
from mlxhost.engine.backends.fake_embedding import EMBED_START as EMBED_START
from mlxhost.engine.backends.fake_embedding import FakeEmbedder
from mlxhost.engine.backends.fake_embedding import fake_vector as fake_vector
from mlxhost.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from pathlib import Path

    from mlxhost.engine.types import AdapterRef, Grammar, Image, Message, ModelSpec, SamplingParams, Tool

# The fake's thinking and tool-call markers (models with `knows_tools`; thinking always).
THINK = ("<think>", "</think>")
TOOL_CALL = ("<tool_call>", "</tool_call>")
# A JSON schema holding this key does not compile, as a schema a grammar engine refuses.
UNCOMPILABLE = "x-fake-uncompilable"


class FakeSplitter:
    """Finds THINK and TOOL_CALL markers in text (held back while a marker may be starting)."""

    def __init__(self, tools: bool) -> None:
        self._state = "normal"
        self._held = ""
        self._tools = tools

    def _edges(self) -> dict[str, str]:
        if self._state == "normal":
            return {THINK[0]: "reasoning", **({TOOL_CALL[0]: "tool"} if self._tools else {})}
        return {THINK[1]: "normal"} if self._state == "reasoning" else {TOOL_CALL[1]: "normal"}

    def split(self, text: str) -> list[tuple[str, str]]:
        buffer, self._held = self._held + text, ""
        pieces: list[tuple[str, str]] = []
        start = 0
        index = 0
        while index < len(buffer):
            edges = self._edges()
            marker = next((m for m in edges if buffer.startswith(m, index)), None)
            if marker is not None:
                pieces.append((self._state, buffer[start:index]))
                self._state = edges[marker]
                index += len(marker)
                start = index
                continue
            rest = buffer[index:]
            if any(m.startswith(rest) for m in edges):  # a marker may be starting: hold it back
                self._held = rest
                break
            index += 1
        pieces.append((self._state, buffer[start:index]))
        return pieces

    def flush(self) -> list[tuple[str, str]]:
        held, self._held = self._held, ""
        return [(self._state, held)]

    def parse_calls(self, text: str, tools: tuple[Tool, ...]) -> list[tuple[str, str]]:
        value = json.loads(text)
        return [(str(value["name"]), json.dumps(value["arguments"]))]


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
        self.chars_per_token = 1  # tokens are characters

    @property
    def knows_tools(self) -> bool:
        return self._backend.knows_tools

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] = (),
        options: dict[str, object] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        backend = self._backend
        backend.render_calls += 1
        backend.renders.append((list(messages), list(tools), dict(options or {})))
        if backend.before_render is not None:
            backend.before_render(messages)  # runs off the loop, like real templating
        head = "".join(f"<tool>{tool.name}" for tool in tools)
        calls = ["".join(f"<call>{c.name}{c.arguments}" for c in m.tool_calls) for m in messages]
        # A vision model's images: `<image WxH>` each, before the message's text.
        seen = ["".join(f"<image {i.width}x{i.height}>" for i in m.images) for m in messages]
        text = head + "".join(
            f"<{m.role}>{i}{m.content}{c}" for m, i, c in zip(messages, seen, calls, strict=True)
        )
        return self.encode(text if continue_final else text + "<assistant>")

    def splitter(self, prompt_ids: Sequence[int]) -> FakeSplitter | None:
        return FakeSplitter(self.knows_tools) if self._backend.markers else None

    @property
    def tool_markers(self) -> tuple[str, str] | None:
        return (json.dumps(TOOL_CALL[0]), json.dumps(TOOL_CALL[1])) if self.knows_tools else None

    def check_grammar(self, grammar: Grammar, param: str) -> None:
        self._backend.grammars.append(grammar)
        if UNCOMPILABLE in grammar.source:
            raise InvalidRequestError(param, f"the schema does not compile: {UNCOMPILABLE}.")

    def encode(self, text: str) -> list[int]:
        self._backend.encode_calls += 1
        return [ord(ch) for ch in text]

    def encode_output(self, text: str) -> list[int]:
        return self.encode(text)

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        kv: object,
        *,
        context: Sequence[int] = (),
        max_draft: int = 0,
        counts: DraftCounts | None = None,
        adapter: AdapterRef | None = None,
        images: Sequence[Image] = (),
    ) -> Iterator[TokenStep | StepEnd]:
        backend, cache = self._backend, _fake(kv)
        if images and self.spec.kind != "vision":
            raise ValueError(f"This model reads no images (kind {self.spec.kind}).")
        backend.images.append(tuple(images))
        backend.adapters.append(adapter.name if adapter else None)
        backend.history.append((self.spec.instance_id, list(prompt_ids), sampling))
        backend.contexts.append(list(context))
        if backend.generate_failures:
            backend.generate_failures -= 1
            raise RuntimeError("fake generation failure")
        cache.tokens.extend(prompt_ids)
        pieces = backend.next_script([*context, *prompt_ids])
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
            yield TokenStep(text, GENERATED_ID_BASE + index, fake_logprob(text, sampling.logprobs))
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

    def prefill(
        self, kv: object | None, token_ids: Sequence[int], adapter: AdapterRef | None = None
    ) -> FakeCache:
        cache = FakeCache() if kv is None else _fake(kv)
        self._backend.prefills.append(list(token_ids))
        cache.tokens.extend(token_ids)
        return cache

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

    def can_batch(self) -> bool:
        # One shared mutable cache cannot hold several sequences (SES-5).
        return not self.shared_cache and self._backend.batching

    def open_batch(self, capacity: int, *, speculation: bool = False) -> FakeBatch | None:
        if not self.can_batch():
            return None
        return FakeBatch(self._backend, self.spec.instance_id, capacity, speculation=speculation)

    def close(self) -> None:
        self.closed = True


@dataclass(frozen=True, slots=True)
class ScriptedReply:
    """One answer of a scripted fake (`FakeBackend.from_script`): `pieces` when `when` matches."""

    when: re.Pattern[str]
    pieces: tuple[str, ...]

    @classmethod
    def parse(cls, raw: dict[str, str]) -> ScriptedReply:
        text = raw["text"]
        return cls(
            re.compile(raw.get("when", ""), re.DOTALL), tuple(text[i : i + 4] for i in range(0, len(text), 4))
        )


class FakeBackend:
    """Test double for the mlx backend.

    `enqueue(["Hel", "lo"])` scripts the next generation (otherwise it repeats `"tok "` up
    to max_tokens); `history` records (instance_id, prompt_ids, sampling) per generation;
    `gate` (a threading.Event) paces every token (every batch step) when `gated` is true, and
    `parked` says the worker waits on it now; `load_failures` makes the next loads raise;
    `dispose_failures` makes the next cache disposals raise; `shared_cache` builds models with
    one shared cache (SES-5); `render_calls` counts templating, `encode_calls` and
    `tokenize_calls` tokenizing, and `before_render(messages)` runs inside templating and
    embedding tokenization (a test holds a request in preparation there). Models batch (`FakeBatch`)
    unless `batching` is false; `batch_steps` records the size of every batch step and
    `batches` every batch opened. A batch opened with `speculation` drafts only from a
    prediction (`_FakeSequence.accepted_drafts`: accepted while it equals the script's next
    pieces), and its accepted pieces come out in the same step, as the mlx batch's do;
    `predictions` records every insert's prediction ids, `prefills` every shared prompt fed. `generate_failures` makes the next exclusive generations
    raise, `batch_step_failures` the next batch steps (nobody to blame), and a script piece
    `FAULT` fails that one sequence (as its own sampler raising); `recoveries` counts
    `recover()` calls. `vocab_size` and `context_length` are what the
    models report (prompt ids are characters, generated ids start at GENERATED_ID_BASE).
    `knows_tools` and `markers` give models a tool format and thinking markers (FakeSplitter);
    `renders` records every templating, `grammars` every grammar checked (a schema with
    UNCOMPILABLE fails); a request for logprobs gets `fake_logprob` per token. Specs of kind
    "embedding" load a `FakeEmbedder` (`embed_passes` records each forward pass; the gate paces
    passes too).
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
        self.prefills: list[list[int]] = []  # prompts fed once for a request's choices (prefill)
        self.adapters: list[str | None] = []  # each generation's adapter name (None: the base)
        self.saves = 0  # caches written to the disk tier (save_cache)
        self.loads_from_disk = 0  # and read back (load_cache)
        self.render_calls = 0
        self.encode_calls = 0  # every tokenization: raw prompts and each rendered chat
        self.tokenize_calls = 0  # embedding models' tokenizations
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
        self.predictions: list[tuple[int, ...]] = []  # every batch insert's prediction ids
        self.knows_tools = False  # models render tools natively and mark calls with TOOL_CALL
        self.markers = False  # models mark thinking (THINK) and, with knows_tools, calls
        self.renders: list[tuple[list[Message], list[Tool], dict[str, object]]] = []
        self.images: list[tuple[Image, ...]] = []  # every exclusive generation's images, in order
        self.grammars: list[Grammar] = []  # every grammar checked, in order
        self._scripts: deque[list[str]] = deque()
        self.replies: list[ScriptedReply] = []  # answers by prompt, when nothing is enqueued
        # Embedding models (FakeEmbedder): their width, per-input limit, every forward pass's
        # inputs in order, and failures to make the next passes raise.
        self.embedding_dimensions = 8
        self.embedding_max_tokens = 64
        self.embed_passes: list[list[list[int]]] = []
        self.embed_failures = 0

    @classmethod
    def from_script(cls, path: Path) -> FakeBackend:
        """A fake scripted by a JSON file, for end-to-end runs of real clients (the agent CLIs)
        against a daphne process: `MLXHOST_ENGINE_BACKEND=fake:PATH`.

        The file holds `knows_tools`, `markers` and `context_length` (the attributes above) and
        `replies`, a list of `{"when": REGEX, "text": TEXT}`: each generation answers with the
        TEXT of the first reply whose REGEX is found in its prompt as the fake renders it
        (`<tool>NAME` per tool offered, then `<ROLE>CONTENT` per message), streamed four
        characters per token; none found, it repeats DEFAULT_WORD.
        """
        data = json.loads(path.read_text())
        backend = cls()
        backend.knows_tools = bool(data.get("knows_tools", False))
        backend.markers = bool(data.get("markers", False))
        backend.context_length = data.get("context_length")
        backend.replies = [ScriptedReply.parse(r) for r in data.get("replies", [])]
        return backend

    def enqueue(self, pieces: list[str]) -> None:
        self._scripts.append(list(pieces))

    def next_script(self, prompt_ids: Sequence[int] = ()) -> list[str] | None:
        if self._scripts:
            return self._scripts.popleft()
        if self.replies:
            text = "".join(chr(i) for i in prompt_ids if i < GENERATED_ID_BASE)
            return next((list(r.pieces) for r in self.replies if r.when.search(text)), None)
        return None

    def wait_for_gate(self) -> None:
        if self.gated:
            self.parked = True
            self.gate.wait(timeout=30)
            self.parked = False
            self.gate.clear()

    def load_embedder(self, spec: ModelSpec, progress: ProgressCallback) -> FakeEmbedder:
        if self.load_failures:
            self.load_failures -= 1
            raise OSError("fake load failure")
        progress(1, 1)
        self.loads.append(spec.instance_id)
        return FakeEmbedder(self, spec)

    def load(self, spec: ModelSpec, progress: ProgressCallback) -> FakeModel:
        if self.load_failures:
            self.load_failures -= 1
            raise OSError("fake load failure")
        progress(1, 1)
        self.loads.append(spec.instance_id)
        return FakeModel(self, spec)
