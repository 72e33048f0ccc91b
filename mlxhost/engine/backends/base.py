"""The backend interface: how the engine's worker thread loads and runs a model."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from array import array
    from pathlib import Path

    from mlxhost.engine.answer import TextSplitter
    from mlxhost.engine.types import (
        AdapterRef,
        Grammar,
        Image,
        Message,
        ModelSpec,
        SamplingParams,
        TokenLogprob,
        Tool,
    )

# (done, total[, unit[, phase]], file=(path, done, size)): bytes read ("bytes", the default) or
# downloaded (phase "download", with the file in flight), or files ("files").
ProgressCallback = Callable[..., None]


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One generated token: its decoded text segment (may be empty), id, and (when the request
    asked for them) its logprobs."""

    text: str
    token_id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True, slots=True)
class StepEnd:
    """End of a backend generation: trailing text and why it stopped ("stop" or "length")."""

    text: str
    finish_reason: str


@dataclass(frozen=True, slots=True)
class SequenceCache:
    """A sequence's KV cache handed back by a batch, with exactly the tokens it holds."""

    kv: object
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BatchStep:
    """One sequence's share of a batch step.

    `token_id` is the generated token, or None when the step only ended the sequence (the
    model emitted its end-of-sequence token, which is neither counted nor shown). `text` is
    the sequence's newly decoded text. On the sequence's last step `finish_reason` is "stop"
    or "length" and `cache` hands its KV cache to the caller; the batch forgets the handle.
    """

    handle: int
    text: str
    token_id: int | None
    finish_reason: str | None = None
    cache: SequenceCache | None = None
    failed: bool = False  # this sequence's own sampler or logits processor raised; it alone ends
    reason: str = ""  # with `failed`: what raised, one line, for the log
    logprob: TokenLogprob | None = None  # with `token_id`, when the request asked for logprobs


@dataclass(slots=True)
class DraftCounts:
    """One row's speculation counts (docs/speculation.md), every backend's: tokens drafted,
    drafted tokens accepted, decode passes it took part in, and tokens those passes emitted."""

    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    emitted: int = 0

    @property
    def tokens_per_pass(self) -> float:
        return self.emitted / self.passes if self.passes else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, other: DraftCounts) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.passes += other.passes
        self.emitted += other.emitted


class BatchRunner(Protocol):
    """A continuous batch of sequences that share decode steps; driven by one worker thread.

    Sequences are inserted and removed between steps. Each has its own sampler, logits
    processors, max_tokens and text detokenizer; text stop strings are the caller's job.
    """

    capacity: int

    def accepts(self, sampling: SamplingParams) -> bool:
        """Whether a request with these settings can share this batch (else it runs alone)."""
        ...

    def insert(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        kv: object | None,
        cached: int,
        *,
        prediction_ids: Sequence[int] | None = None,
        max_draft: int | None = None,
        adapter: AdapterRef | None = None,
    ) -> int:
        """Add a sequence (under `adapter`, None: the base) and return its handle; it starts on the next `step()`.

        `kv` (None = a fresh cache) already holds exactly `prompt_ids[:cached]`; the rest of
        the prompt is fed on top of it. The batch owns `kv` from now on. In a speculating batch
        (`open_batch(..., speculation=True)`) the sequence drafts at most `max_draft` tokens a
        step (0: never; None: the batch's own cap), from `prediction_ids` where given.
        """
        ...

    def speculation_stats(self, handle: int) -> DraftCounts | None:
        """A sequence's speculation counts while it runs and until the step after the one that
        ended it (or after `remove`); None when it never could draft."""
        ...

    def prediction_reproduced(self, handle: int) -> int:
        """How many of a sequence's prediction tokens its output reproduced, in order (OpenAI
        Predicted Outputs' `accepted_prediction_tokens`), whatever drafted them; 0 without a
        prediction. Kept as long as `speculation_stats`."""
        ...

    def step(self) -> list[BatchStep]:
        """Run one decode step (plus a bounded slice of pending prompt processing).

        Returns one `BatchStep` per sequence, or several in order where a speculating step
        accepted drafted tokens; sequences still in prefill may have none.
        """
        ...

    def remove(self, handle: int) -> SequenceCache:
        """Take a sequence out mid-flight (cancel or text stop) and hand back its cache."""
        ...

    def close(self) -> None: ...


class LoadedModel(Protocol):
    """A model resident in memory. Only the instance's worker thread calls `generate`.

    A KV cache (`kv`) is an opaque per-request object holding the tokens fed so far; the
    engine keeps finished ones in its prefix cache, and a new prompt starts from a copy of the
    longest cached prefix and feeds only the rest.
    `shared_cache` is true for models whose cache is one shared mutable state (SES-5).
    `vocab_size` bounds every token id a request may name (logit_bias); `context_length` (None:
    unknown) bounds prompt plus output; `kv_bytes_per_token` (0: unknown) sizes a request's KV
    cache before it is admitted; `chars_per_token` (0: unknown) is the most characters of text one
    token may cover, so a longer prompt is refused before it is tokenized (`tokenizing`). A model
    may also define `recover()`, which the worker calls
    after a failure it cannot pin on one request, to rebuild shared state (MLX's random state).
    """

    shared_cache: bool
    vocab_size: int
    context_length: int | None
    kv_bytes_per_token: int
    chars_per_token: int

    @property
    def knows_tools(self) -> bool:
        """Its chat template renders tools, and mlx-lm has a parser for its calls."""
        ...

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] = (),
        options: dict[str, object] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """Apply the chat template with a generation prompt (or, with `continue_final`, leaving
        the last message open) and return token ids. `options` are the template's keywords."""
        ...

    def splitter(self, prompt_ids: Sequence[int]) -> TextSplitter | None:
        """A reader of this model's thinking and tool-call markers for an answer to `prompt_ids`;
        None when the model has neither."""
        ...

    @property
    def tool_markers(self) -> tuple[str, str] | None:
        """Its tool-call markers as Lark terms, when its calls are JSON objects between them
        (so a grammar can write its calls); None otherwise."""
        ...

    def check_grammar(self, grammar: Grammar, param: str) -> None:
        """Compile `grammar` for this model's vocabulary and walk its first steps (cached),
        before a request is admitted.

        Raises:
            InvalidRequestError: naming `param`: it does not compile, or fails in its first
                steps; the message says why.
        """
        ...

    def encode(self, text: str) -> list[int]:
        """Tokenize raw text (legacy completions)."""
        ...

    def encode_output(self, text: str) -> list[int]:
        """Tokenize text as the model's own output would hold it: no special tokens (a
        prediction's drafts, OpenAI Predicted Outputs)."""
        ...

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
        """Feed `prompt_ids` on top of `kv`, then yield one `TokenStep` per token and one `StepEnd`,
        under `adapter` (a LoRA adapter on these weights, loaded on first use; None: the base).

        `context` is the prompt's start that `kv` already holds (a cached prefix): the penalties
        look back over it too, so a cached prefix never changes the answer. The cache grows in
        place; `cache_length(kv)` says how many tokens it then holds. `max_draft` > 0 lets a
        model with a draft model speculate (the request's alias has speculation on); the tokens
        are the same either way, and its drafted / accepted / passes / emitted counts are added
        to `counts` as the tokens come. `images` are the prompt's
        decoded images, in order (a vision model's; any other raises ValueError on them).
        """
        ...

    def new_cache(self) -> object: ...

    def trim_cache(self, kv: object, n: int) -> None:
        """Drop the last `n` tokens from `kv`."""
        ...

    def copy_cache(self, kv: object, n: int) -> object | None:
        """A new cache holding the first `n` tokens of `kv`, which stays exactly as it was (the
        prefix cache lends one entry to many requests); None when this cache cannot be cut there."""
        ...

    def prefill(
        self, kv: object | None, token_ids: Sequence[int], adapter: AdapterRef | None = None
    ) -> object:
        """Feed `token_ids` on top of `kv` (None: a new cache) without sampling; returns the
        cache, which then holds them too (the shared prompt of a request's choices, `n` > 1)."""
        ...

    def cache_length(self, kv: object) -> int: ...

    def save_cache(self, kv: object, path: Path) -> None:
        """Write exactly the tokens `kv` holds to `path` (the disk tier); `kv` is not changed."""
        ...

    def load_cache(self, path: Path) -> object:
        """A cache read back from a `save_cache` file; raises on a file it cannot read."""
        ...

    def cache_nbytes(self, kv: object) -> int: ...

    def dispose_cache(self, kv: object) -> None: ...

    def memory_bytes(self) -> int: ...

    def open_batch(self, capacity: int, *, speculation: bool = False) -> BatchRunner | None:
        """A batch of up to `capacity` sequences, or None when this model cannot batch; with
        `speculation` its sequences may draft tokens (docs/speculation.md).

        Optional: the worker treats a model without this method as single-stream. A model that
        has it may also define `can_batch() -> bool`, asked once per load: when false, the
        instance's lane capacity is clamped to 1 (LANE-1).
        """
        ...

    def close(self) -> None: ...


class EmbeddingModel(Protocol):
    """A resident embedding model (API-13). Only the instance's worker thread calls `embed`;
    `tokenize` runs off the loop in any thread (a tokenizer is safe to share).

    `dimensions` is the width of its vectors; `max_tokens` the most tokens one input may have,
    special tokens included (the sentence-transformers `max_seq_length`, else the positions);
    `chars_per_token` (0: unknown) the most characters besides whitespace one token may cover.
    """

    dimensions: int
    max_tokens: int
    chars_per_token: int

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text as the model reads it (special tokens included), untruncated."""
        ...

    def embed(self, batch: Sequence[Sequence[int]]) -> list[array[float]]:
        """One forward pass over `batch` (padded here): each input's pooled, normalised vector."""
        ...

    def memory_bytes(self) -> int: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """Loads models: chat and vision models (`load`, by `spec.kind`) and embedding models (`load_embedder`). It may also
    define `thread_exit()`, which each worker thread calls as it ends, to free what the backend
    keeps per thread (MLX's streams)."""

    name: str

    def load(self, spec: ModelSpec, progress: ProgressCallback) -> LoadedModel: ...

    def load_embedder(self, spec: ModelSpec, progress: ProgressCallback) -> EmbeddingModel: ...
