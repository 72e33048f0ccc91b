"""Worker jobs and what they hand back, shared by the exclusive and the batched scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxhost.engine.backends.base import DraftCounts
from mlxhost.engine.types import Done, Timings, Usage

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.backends.base import LoadedModel
    from mlxhost.engine.disk import DiskEntry, DiskTier
    from mlxhost.engine.generation import Generation
    from mlxhost.engine.types import AdapterRef, RowGroup, SamplingParams


@dataclass(slots=True)
class JobResult:
    """What the worker hands back when a generation ends, for the lane and the session cache.

    `kv` is the request's cache (None when the model was never touched); `kv_tokens` are the
    exact tokens it holds. `touched` is false when the job ended before using a leased session.
    """

    finish_reason: str
    kv: object | None = None
    kv_tokens: tuple[int, ...] = ()
    kv_nbytes: int = 0
    touched: bool = False


@dataclass(slots=True)
class GenerateJob:
    generation: Generation
    prompt_ids: list[int]
    submitted_at: float  # when it entered the lane: queue time counts from here
    on_end: Callable[[JobResult], None]  # called once on the worker thread
    sampling: SamplingParams  # the request's settings after the model's checks (limits.py)
    session_kv: object | None = None  # a cached entry's kv: read only, unless owned...
    session_tokens: tuple[int, ...] = ()  # ...the tokens it holds...
    reuse_tokens: int = 0  # ...how many of them prefix this prompt (SES-8)...
    owns_session: bool = False  # ...and whether the job took it out of the cache (SES-5)
    disk: tuple[DiskTier, DiskEntry] | None = None  # or a saved KV to load instead (the disk tier)
    done: Done | None = None  # the terminal event `post_done` made; `on_end`'s receiver posts it
    # Speculation (docs/speculation.md): the most tokens a step may draft for it (0: none), and
    # the client's predicted output as token ids (OpenAI Predicted Outputs), its draft source.
    max_draft: int = 0
    prediction_ids: tuple[int, ...] = ()
    rows: RowGroup | None = None  # one choice of several (`n` > 1): a batch prefills their prompt once
    adapter: AdapterRef | None = None  # the alias's LoRA adapter on the base weights (issue 28)

    def start_kv(self, model: LoadedModel) -> tuple[object | None, int]:
        """The cache this job starts from and how many prompt tokens it holds (worker thread).

        A shared entry is copied (its first `reuse_tokens` tokens) and never changed; an owned
        one is trimmed to them in place. None: start from a fresh cache.
        """
        if self.disk is not None:
            return self._load_saved(model, *self.disk)
        kv, reuse = self.session_kv, self.reuse_tokens
        if kv is None or (reuse == 0 and not self.owns_session):
            return None, 0
        if self.owns_session:
            model.trim_cache(kv, model.cache_length(kv) - reuse)
            return kv, reuse
        copy = model.copy_cache(kv, reuse)
        return (copy, reuse) if copy is not None else (None, 0)

    def _load_saved(self, model: LoadedModel, tier: DiskTier, entry: DiskEntry) -> tuple[object | None, int]:
        # A file that will not load is deleted and the turn starts fresh: never a failed request.
        try:
            kv = model.load_cache(entry.path)
            length = model.cache_length(kv)
            if length != len(entry.tokens):
                raise ValueError(f"it holds {length} tokens, its record says {len(entry.tokens)}")
            model.trim_cache(kv, length - self.reuse_tokens)
        except Exception as exc:
            tier.discard(entry.response_id, f"it did not load: {exc}")
            self.generation.session_outcome = "cold_replay"  # read by the loop after Started
            return None, 0
        return kv, self.reuse_tokens

    def unused_kv(self) -> object | None:
        """What a job that failed must hand back for disposal: an owned entry's kv, else nothing
        (a shared entry stays cached; a copy is freed with the job)."""
        return self.session_kv if self.owns_session else None


@dataclass(slots=True)
class WriteJob:
    """Save a kept turn's KV to the disk tier. It waits until the worker is idle, or runs between
    steps once `urgent()` (its entry left the memory tier, so its memory is held for this write
    alone); a load, an unload and shutdown run every pending write first. `done` always follows."""

    write: Callable[[LoadedModel], None]
    urgent: Callable[[], bool]
    done: Callable[[], None]


@dataclass(slots=True)
class CallJob:
    """Run `fn` on the worker thread (load, unload) and report through `done`."""

    fn: Callable[[], object]
    done: Callable[[object, BaseException | None], None]


@dataclass(slots=True)
class WorkerStats:
    tokens_generated: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    active_request: str | None = None  # with a batch: its oldest sequence
    last_decode_tps: float = 0.0
    last_ttft_ms: float = 0.0  # the last finished request's time to first token (from lane entry)
    last_queue_ms: float = 0.0  # ...and how much of that it waited before the worker took it
    last_progress_at: float = 0.0  # the active request's last token (or start): a stall shows here
    batch_size: int = 0  # sequences in the batched scheduler now (0 when it runs exclusively)
    burst_waits: int = 0  # times a new batch waited for requests still preparing
    gathering: bool = False  # a new batch waits for them right now
    # Failures no single request could be blamed for (OPS-2): the instance reports itself
    # degraded while `consecutive_faults` > 0, until a generation finishes cleanly again.
    faults: int = 0
    consecutive_faults: int = 0
    last_fault: str | None = None
    recoveries: int = 0
    reloads: int = 0  # the model was dropped to be loaded afresh after repeated faults
    # An embedding model's work (API-14): forward passes, and the inputs and tokens they held.
    embedding_passes: int = 0
    inputs_embedded: int = 0
    tokens_embedded: int = 0
    # Speculative decoding (docs/speculation.md), summed over the batch's finished rows that
    # could draft: tokens drafted, drafted tokens accepted, decode passes, tokens those emitted.
    speculation: DraftCounts = field(default_factory=DraftCounts)


@dataclass(slots=True)
class Turn:
    """One generation's clock on the worker: when it started and produced its first token."""

    started: float
    queue_ms: float
    cached: int = 0
    first_at: float | None = None


def post_done(
    job: GenerateJob,
    turn: Turn,
    stats: WorkerStats,
    now: float,
    finish: str,
    count: int,
    stop_sequence: str | None = None,
    prediction: tuple[int, int] = (0, 0),
    drafts: DraftCounts | None = None,
) -> None:
    """Make the terminal `Done` with usage and timings (and the matched stop string), and count it.

    `prediction` is (accepted, rejected) tokens of the job's prediction, for its usage;
    `drafts` the row's speculation counts, for its timings (None: it could not draft).

    It goes out with `on_end`: the engine releases the lane slot, then posts it (`job.done`).
    """
    first_at = turn.first_at or now
    decode_s = max(now - first_at, 1e-9)
    prefill_s = max(first_at - turn.started, 1e-9)
    decode_tps = (count - 1) / decode_s if count > 1 else 0.0
    stats.last_decode_tps = decode_tps or stats.last_decode_tps
    ttft_ms = (first_at - job.submitted_at) * 1000
    if count:
        stats.last_ttft_ms, stats.last_queue_ms = ttft_ms, turn.queue_ms
    if finish == "cancelled":
        stats.requests_cancelled += 1
    else:
        stats.requests_finished += 1
    timings = Timings(
        queue_ms=turn.queue_ms,
        ttft_ms=ttft_ms,
        prefill_tps=(len(job.prompt_ids) - turn.cached) / prefill_s,
        decode_tps=decode_tps,
        drafted_tokens=drafts.drafted if drafts else 0,
        accepted_tokens=drafts.accepted if drafts else 0,
        tokens_per_pass=drafts.tokens_per_pass if drafts else 0.0,
    )
    usage = Usage(
        prompt_tokens=len(job.prompt_ids),
        completion_tokens=count,
        cached_tokens=turn.cached,
        accepted_prediction_tokens=prediction[0],
        rejected_prediction_tokens=prediction[1],
    )
    # `finish` is one of the backend's StepEnd reasons or the worker's own, all FinishReasons.
    # Not posted here: the engine posts it after the job's slot is released (`job.done`), so a
    # client that sends its next request the moment it has this answer finds the slot free.
    job.done = Done(finish_reason=finish, usage=usage, timings=timings, stop_sequence=stop_sequence)  # type: ignore[arg-type]


def end_unstarted(job: GenerateJob, stats: WorkerStats, now: float) -> None:
    """End a job cancelled before it touched the model: Done(cancelled), then `on_end` (LANE-6)."""
    post_done(job, Turn(started=now, queue_ms=(now - job.submitted_at) * 1000), stats, now, "cancelled", 0)
    job.on_end(JobResult("cancelled"))
