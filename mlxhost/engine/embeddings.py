"""Embedding requests on the worker (API-14): checks before admission, and the batcher that
runs every admitted request's inputs through the model in as few forward passes as fit."""

from __future__ import annotations

import math
import threading
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxhost.engine.errors import InvalidRequestError
from mlxhost.engine.tokenizing import fewest_tokens, fits_in_characters, nonspace_characters
from mlxhost.engine.types import Embeddings

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from mlxhost.engine.backends.base import EmbeddingModel

# The most padded tokens (inputs x longest input) one forward pass may hold, bounding its memory.
MAX_PASS_TOKENS = 16384
# What one more forward pass costs, in padded tokens: a pass is cut where padding its inputs up to
# the next one's length would cost more. Measured on all-MiniLM-L6-v2 on a 2-core CPU: about 8 ms
# a pass, plus 0.2 ms a padded token (benchmarks/RESULTS.md, issue 16).
PASS_COST_TOKENS = 32
# The most inputs one request may carry, as OpenAI's endpoint allows.
MAX_INPUTS = 2048


@dataclass(eq=False, slots=True)
class EmbedJob:
    """One admitted embedding request on its way through the worker.

    `on_end(result, error)` is called once on the worker thread; a job cancelled before its
    pass started (`cancel()`: the client left, a drain aborted it) ends without running.
    """

    request_id: str
    inputs: list[list[int]]
    dimensions: int
    submitted_at: float
    on_end: Callable[[Embeddings | None, BaseException | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass(frozen=True, slots=True)
class PassStats:
    """What one call of `run_jobs` did: forward passes, inputs and tokens (for the counters)."""

    passes: int
    inputs: int
    tokens: int


def input_limit(model_limit: int, alias_limit: int | None) -> int:
    """The most tokens one input may have: the model's, lowered by the alias's."""
    return min(model_limit, alias_limit) if alias_limit else model_limit


def check_arrays(inputs: Sequence[str | Sequence[int]], *, limit: int) -> None:
    """Refuse a token array longer than `limit`, before it is decoded: its ids are another
    tokenizer's, but a client that sends them counts in them (OpenAI caps arrays the same way).

    Raises:
        InvalidRequestError: `input[i]` has too many ids.
    """
    for index, item in enumerate(inputs):
        if not isinstance(item, str) and len(item) > limit:
            raise InvalidRequestError(
                f"input[{index}]",
                f"this token array has {len(item)} tokens; the model takes at most {limit} per input. "
                "Split it into shorter pieces.",
            )


def decoded(
    inputs: Sequence[str | Sequence[int]], decode: Callable[[Sequence[int]], str] | None
) -> list[str]:
    """Every input as text: token arrays through `decode` (off the loop: it may load its tables).

    Raises:
        InvalidRequestError: `input[i]` holds ids `decode` cannot read (or there is no `decode`).
    """
    texts = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            texts.append(item)
            continue
        if decode is None:
            raise InvalidRequestError(f"input[{index}]", "token arrays are not read here; send text.")
        try:
            texts.append(decode(item))
        except ValueError as exc:
            raise InvalidRequestError(f"input[{index}]", str(exc)) from None
    return texts


def check_characters(texts: Sequence[str], *, chars_per_token: int, limit: int) -> None:
    """Refuse, before tokenizing, an input whose text is too long to fit in `limit` tokens: more
    than `chars_per_token` x `limit` characters that are not whitespace (the encoder drops
    whitespace; `chars_per_token` 0: unknown, nothing refused here).

    Raises:
        InvalidRequestError: `input[i]` cannot fit.
    """
    bound = chars_per_token * limit
    for index, text in enumerate(texts):
        if not chars_per_token or len(text) <= bound:
            continue  # the common case: no count at all
        characters = nonspace_characters(text)
        if not fits_in_characters(characters, chars_per_token=chars_per_token, limit=limit):
            raise InvalidRequestError(
                f"input[{index}]",
                f"this input has {characters} characters besides spaces, so at least "
                f"{fewest_tokens(characters, chars_per_token)} tokens; the model takes at most "
                f"{limit} per input. Split it into shorter pieces.",
            )


def check_inputs(inputs: Sequence[Sequence[int]], *, limit: int) -> None:
    """Refuse an input with more tokens than `limit` (see `input_limit`), naming its index.

    Raises:
        InvalidRequestError: `input[i]` is too long.
    """
    for index, ids in enumerate(inputs):
        if len(ids) > limit:
            raise InvalidRequestError(
                f"input[{index}]",
                f"this input has {len(ids)} tokens; the model takes at most {limit} per input. "
                "Split it into shorter pieces.",
            )


def check_dimensions(requested: int | None, *, width: int, truncatable: bool) -> int:
    """The dimensions to return: all of the model's, or fewer where the model allows it.

    Raises:
        InvalidRequestError: more than the model has, or fewer from a model that cannot truncate.
    """
    if requested is None or requested == width:
        return width
    if requested > width:
        raise InvalidRequestError(
            "dimensions", f"this model's vectors have {width} dimensions; {requested} is more than that."
        )
    if not truncatable:
        raise InvalidRequestError(
            "dimensions",
            f"this model's vectors have {width} dimensions and it is not marked as allowing fewer "
            "(Matryoshka); omit dimensions or ask for all of them.",
        )
    return requested


def truncated(vector: array[float], dimensions: int) -> array[float]:
    """The first `dimensions` numbers of `vector`, scaled back to unit length (Matryoshka)."""
    if dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in head))
    return array("f", (x / norm for x in head)) if norm > 0 else head


def plan_passes(
    lengths: Sequence[int], *, max_tokens: int = MAX_PASS_TOKENS, pass_cost: int = PASS_COST_TOKENS
) -> list[list[int]]:
    """Group input positions into forward passes, shortest first. An input joins the current pass
    unless the pass's padded size (inputs x longest) would exceed `max_tokens` (one input always
    fits), or padding the pass's inputs up to its length would cost more than a pass of its own
    (`pass_cost` tokens): every padded position is computed."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    passes: list[list[int]] = []
    current: list[int] = []
    for position in order:
        length = lengths[position]  # ascending: the longest so far
        if current:
            padding = len(current) * (length - lengths[current[-1]])
            if (len(current) + 1) * length > max_tokens or padding > pass_cost:
                passes.append(current)
                current = []
        current.append(position)
    if current:
        passes.append(current)
    return passes


def run_jobs(
    model: EmbeddingModel,
    jobs: Sequence[EmbedJob],
    clock: Callable[[], float],
    count: Callable[[PassStats], None],
    *,
    max_pass_tokens: int = MAX_PASS_TOKENS,
) -> None:
    """Embed every input of `jobs` together (worker thread): pad and run as few forward passes as
    fit, `count` what ran, then split the vectors back per request and end each job. A failing
    pass fails the jobs whose inputs it held, the others still get their vectors, and then the
    pass's exception is raised for the worker to report."""
    live = [job for job in jobs if not job.cancelled.is_set()]
    for job in jobs:
        if job.cancelled.is_set():
            job.on_end(None, None)
    owners = [(job, index) for job in live for index in range(len(job.inputs))]
    batch = [job.inputs[index] for job, index in owners]
    started = clock()
    vectors: list[array[float] | None] = [None] * len(batch)
    failed: dict[int, BaseException] = {}
    passes = plan_passes([len(ids) for ids in batch], max_tokens=max_pass_tokens)
    for positions in passes:
        try:
            out = model.embed([batch[p] for p in positions])
        except Exception as exc:  # the jobs of this pass fail; the caller logs and counts it
            for p in positions:
                failed[id(owners[p][0])] = exc
            continue
        for p, vector in zip(positions, out, strict=True):
            vectors[p] = vector
    compute_ms = (clock() - started) * 1000
    count(PassStats(len(passes), len(batch), sum(len(ids) for ids in batch)))
    cursor = 0
    for job in live:
        own = vectors[cursor : cursor + len(job.inputs)]
        cursor += len(job.inputs)
        error = failed.get(id(job))
        if error is not None:
            job.on_end(None, error)
            continue
        job.on_end(_result(job, own, started, compute_ms), None)
    if failed:
        raise next(iter(failed.values()))


def _result(
    job: EmbedJob, vectors: list[array[float] | None], started: float, compute_ms: float
) -> Embeddings:
    kept = tuple(truncated(v, job.dimensions) for v in vectors if v is not None)
    return Embeddings(
        vectors=kept,
        prompt_tokens=sum(len(ids) for ids in job.inputs),
        dimensions=job.dimensions,
        queue_ms=max(0.0, started - job.submitted_at) * 1000,
        compute_ms=compute_ms,
    )
