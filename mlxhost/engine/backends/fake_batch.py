"""The fake backend's continuous batch (`FakeModel.open_batch`), its caches and its token pieces."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxhost.engine.backends.base import BatchStep, DraftCounts, SequenceCache
from mlxhost.engine.types import TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mlxhost.engine.backends.fake import FakeBackend
    from mlxhost.engine.types import AdapterRef, SamplingParams

DEFAULT_WORD = "tok "
GENERATED_ID_BASE = 100_000  # generated ids never collide with prompt characters
BYTES_PER_TOKEN = 64
# A script piece that makes that step fail like a sequence's own sampler raising.
FAULT = "\x00fault"
# A speculating fake sequence's drafts per step when the engine names no cap.
DEFAULT_MAX_DRAFT = 8


def fake_logprob(text: str, top: int | None) -> TokenLogprob | None:
    """The fake's logprobs for a generated piece: -0.5 for it, then `top` lower alternatives."""
    if top is None:
        return None
    alternatives = tuple(TopLogprob(f"alt{i}", tuple(f"alt{i}".encode()), -1.0 - i) for i in range(top))
    return TokenLogprob(
        text, tuple(text.encode()), -0.5, (TopLogprob(text, tuple(text.encode()), -0.5), *alternatives)[:top]
    )


def _fake(kv: object) -> FakeCache:
    assert isinstance(kv, FakeCache)
    return kv


class FakeCache:
    """The tokens a fake model has been fed; 64 bytes per token."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.disposed = False


class _FakeSequence:
    def __init__(self, cache: FakeCache, pieces: list[str] | None, max_tokens: int) -> None:
        self.cache = cache
        self.pieces = pieces
        self.max_tokens = max_tokens
        self.produced = 0
        self.logprobs: int | None = None
        self.text = ""  # the pieces produced so far
        self.max_draft = 0  # with speculation: the most drafts per step; 0: it never drafts
        self.prediction: str | None = None  # the prediction's text (its ids are characters)
        self.counts: DraftCounts | None = None  # a speculating sequence's counts

    def piece(self, index: int) -> str | None:
        """The script's piece at `index` (DEFAULT_WORD unscripted); None past the script's end."""
        if self.pieces is None:
            return DEFAULT_WORD
        return self.pieces[index] if index < len(self.pieces) else None

    def accepted_drafts(self) -> tuple[int, int]:
        """(drafted, accepted) for this step's drafts after the piece just produced.

        While the text so far is the prediction's start, the prediction's next characters are
        cut into the script's next pieces' lengths, up to `max_draft` and the room left under
        max_tokens, and the script's end: each is one drafted token, accepted while it equals its
        piece (never a FAULT).
        """
        prediction = self.prediction
        if prediction is None or not prediction.startswith(self.text):
            return 0, 0
        room = min(self.max_draft, self.max_tokens - self.produced)
        drafted = accepted = 0
        position, index, matching = len(self.text), self.produced, True
        while drafted < room and position < len(prediction):
            piece = self.piece(index)
            if piece is None:  # the script ends there: the model would stop, nothing to draft
                break
            drafted += 1
            matching = matching and piece != FAULT and prediction[position : position + len(piece)] == piece
            accepted += matching
            position, index = position + len(piece), index + 1
        return drafted, accepted

    @property
    def reproduced(self) -> int:
        """The prediction's ids (characters) the text reproduced from its start, in order."""
        if self.prediction is None:
            return 0
        text, prediction = self.text, self.prediction
        return next(
            (i for i, (a, b) in enumerate(zip(text, prediction, strict=False)) if a != b),
            min(len(text), len(prediction)),
        )

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

    def __init__(
        self, backend: FakeBackend, instance_id: int, capacity: int, *, speculation: bool = False
    ) -> None:
        self._backend = backend
        self._instance_id = instance_id
        self.capacity = capacity
        self.speculation = speculation
        self.closed = False
        self._sequences: dict[int, _FakeSequence] = {}
        self._ended: dict[int, DraftCounts] = {}  # counts of sequences that ended this step
        self._ended_reproduced: dict[int, int] = {}
        self._next_handle = 0
        backend.batches.append(self)

    def accepts(self, sampling: SamplingParams) -> bool:
        return not self._backend.exclusive_seeds or sampling.seed is None

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
        backend = self._backend
        backend.adapters.append(adapter.name if adapter else None)
        cache = FakeCache() if kv is None else _fake(kv)
        assert len(cache.tokens) == cached, "the cache must hold exactly the cached prefix"
        fed = list(prompt_ids[cached:])
        backend.history.append((self._instance_id, fed, sampling))
        cache.tokens.extend(fed)
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        script = backend.next_script(prompt_ids)
        sequence = self._sequences[handle] = _FakeSequence(cache, script, sampling.max_tokens)
        sequence.logprobs = sampling.logprobs
        if self.speculation and max_draft != 0 and sampling.grammar is None:  # as the mlx batch
            sequence.max_draft = DEFAULT_MAX_DRAFT if max_draft is None else max_draft
            sequence.counts = DraftCounts()
        if self.speculation and prediction_ids:  # followed even where it never drafts, as the mlx batch
            sequence.prediction = "".join(chr(i) for i in prediction_ids)
        backend.predictions.append(tuple(prediction_ids or ()))
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
        self._ended.clear()
        self._ended_reproduced.clear()
        steps: list[BatchStep] = []
        for handle, sequence in list(self._sequences.items()):
            if sequence.at_end:
                steps.append(BatchStep(handle, "", None, "stop", self.remove(handle)))
                continue
            if sequence.pieces is not None and sequence.pieces[sequence.produced] == FAULT:
                steps.append(BatchStep(handle, "", None, "error", self.remove(handle), failed=True))
                continue
            ended = self._produce(handle, sequence, steps)
            counts = sequence.counts
            if counts is not None:
                counts.passes += 1
            if counts is None or ended:
                continue
            drafted, accepted = sequence.accepted_drafts()
            counts.drafted += drafted
            counts.accepted += accepted
            for _ in range(accepted):
                if self._produce(handle, sequence, steps):
                    break
        return steps

    def _produce(self, handle: int, sequence: _FakeSequence, steps: list[BatchStep]) -> bool:
        """The sequence's next piece as one step; True when it ended it ("length")."""
        index = sequence.produced
        token = GENERATED_ID_BASE + index
        sequence.cache.tokens.append(token)
        sequence.produced += 1
        self._backend.tokens_generated += 1
        text = sequence.piece(index) or ""
        sequence.text += text
        logprob = fake_logprob(text, sequence.logprobs)
        counts = sequence.counts
        if counts is not None:
            counts.emitted += 1
        if sequence.produced >= sequence.max_tokens:
            steps.append(BatchStep(handle, text, token, "length", self.remove(handle), logprob=logprob))
            return True
        steps.append(BatchStep(handle, text, token, logprob=logprob))
        return False

    def speculation_stats(self, handle: int) -> DraftCounts | None:
        if handle in self._ended:
            return self._ended[handle]
        sequence = self._sequences.get(handle)
        return sequence.counts if sequence is not None else None

    def prediction_reproduced(self, handle: int) -> int:
        if handle in self._ended_reproduced:
            return self._ended_reproduced[handle]
        sequence = self._sequences.get(handle)
        return sequence.reproduced if sequence is not None else 0

    def remove(self, handle: int) -> SequenceCache:
        sequence = self._sequences.pop(handle)
        self._ended_reproduced[handle] = sequence.reproduced
        if sequence.counts is not None:
            self._ended[handle] = sequence.counts
        cache = sequence.cache
        return SequenceCache(cache, tuple(cache.tokens))

    def close(self) -> None:
        self.closed = True
        self._sequences.clear()
