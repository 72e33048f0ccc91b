"""The batched scheduler: admitted GenerateJobs share decode steps on one backend `BatchRunner`.

`BatchedScheduler` opens, refills and closes the batch and gathers a burst before a new one
starts; `Batch` is the open batch: its sequences, and the one step they all share.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxhost.engine.jobs import GenerateJob, JobResult, Turn, end_unstarted, post_done
from mlxhost.engine.scheduling.base import Scheduler
from mlxhost.engine.scheduling.rows import SharedPrompts
from mlxhost.engine.stops import StopMatcher
from mlxhost.engine.types import Delta, Failed, Started

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.backends.base import BatchRunner, BatchStep, DraftCounts, LoadedModel, SequenceCache
    from mlxhost.engine.jobs import WorkerStats
    from mlxhost.engine.scheduling.base import Host, Queued
    from mlxhost.engine.scheduling.fifo import Fifo
    from mlxhost.engine.types import TokenLogprob

logger = logging.getLogger(__name__)

FAILED_MESSAGE = "The model failed while generating."


@dataclass(slots=True)
class _Sequence:
    job: GenerateJob
    turn: Turn
    matcher: StopMatcher  # text stop strings, per request
    count: int = 0  # completion tokens so far
    unsent: list[int] = field(default_factory=list)  # token ids whose text is still held back
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when asked for


class Batch:
    """GenerateJobs running together on one `BatchRunner`, on the worker thread (LANE-1).

    `BatchedScheduler` inserts jobs between steps and calls `step()` while `len(self)` is non-zero.
    Events match the exclusive scheduler's: Started, Delta..., then Done (or Failed), and
    `on_end` exactly once per job with the sequence's own cache (SES-1, SES-5).
    """

    def __init__(
        self, model: LoadedModel, runner: BatchRunner, stats: WorkerStats, clock: Callable[[], float]
    ) -> None:
        self.model = model
        self.runner = runner
        self._stats = stats
        self._clock = clock
        self._sequences: dict[int, _Sequence] = {}
        self._last_steps: dict[int, BatchStep] = {}  # this step's ending steps, by handle
        self.shared = SharedPrompts(model)  # a request's choices: their prompt prefilled once

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def capacity(self) -> int:
        return self.runner.capacity

    def accepts(self, job: GenerateJob) -> bool:
        """Whether `job` may join the batch; otherwise it needs an exclusive turn."""
        sampling = job.sampling
        # Batches refuse empty prompts and max_tokens < 1; the exclusive path answers those as before.
        return bool(job.prompt_ids) and sampling.max_tokens >= 1 and self.runner.accepts(sampling)

    def insert(self, job: GenerateJob) -> None:
        """Add `job` to the batch (its first token comes from a later step), or end it if cancelled."""
        generation = job.generation
        now = self._clock()
        if generation.stop_flag.is_set():  # cancelled while it waited: never touches the model
            end_unstarted(job, self._stats, now)
            return
        sampling = job.sampling
        reuse = 0
        try:
            # The cached prefix, as on the exclusive path; a later choice of the request, the
            # prompt its first choice prefilled (docs/api.md, `n`).
            kv, held, reuse = self.shared.start_kv(job)
            handle = self.runner.insert(
                job.prompt_ids,
                sampling,
                kv,
                held,
                prediction_ids=job.prediction_ids or None,
                max_draft=job.max_draft,
                adapter=job.adapter,
            )
        except Exception:
            logger.exception("inserting generation %s into the batch failed", generation.request_id)
            self.shared.discard_pending()
            self._fail(job)
            return
        self.shared.adopt(handle)
        if not self._sequences:
            self._stats.last_progress_at = now  # the stall clock starts with the batch's first request
        turn = Turn(started=now, queue_ms=(now - job.submitted_at) * 1000, cached=reuse)
        self._sequences[handle] = _Sequence(job, turn, StopMatcher(sampling.stop))
        generation.post_threadsafe(Started(prompt_tokens=len(job.prompt_ids), cached_tokens=reuse))
        self._sync_stats()

    def step(self) -> None:
        """Drop cancelled sequences, run one batch step and fan its tokens out to each request.

        Raises:
            Exception: whatever the backend raised; the caller then calls `fail_all()`.
        """
        for handle, sequence in list(self._sequences.items()):
            # Checked every step: a cancel or disconnect frees its slot within one decode step (LANE-6).
            if sequence.job.generation.stop_flag.is_set():
                self._end(handle, "cancelled", self.runner.remove(handle))
        if self._sequences:
            steps = self.runner.step()
            now = self._clock()
            # A speculating step may return several tokens of one sequence, the last one ending
            # it; a text stop on an earlier one takes that last step's cache (already extracted).
            self._last_steps = {step.handle: step for step in steps if step.finish_reason is not None}
            for step in steps:
                self._advance(step, now)
            self._last_steps = {}
        self._sync_stats()

    def fail_all(self) -> None:
        """The batch broke: every sequence ends with Failed and the runner is closed."""
        logger.error("the batch failed; ending its %d sequences", len(self._sequences))
        sequences = list(self._sequences.values())
        self._sequences.clear()
        self.close()  # before the requests hear of it: a retry must not find this batch
        for sequence in sequences:
            self._fail(sequence.job)

    def close(self) -> None:
        self.shared.close()
        try:
            self.runner.close()
        except Exception:
            logger.warning("closing a batch failed", exc_info=True)
        self._sync_stats()

    def _advance(self, step: BatchStep, now: float) -> None:
        if step.handle not in self._sequences:
            return  # a speculating step's tokens past a stop string that already ended it
        if step.failed:  # its own sampler or processors raised: it fails alone, the batch goes on
            sequence = self._sequences.pop(step.handle)
            self.shared.ended(step.handle)
            if step.cache is not None:
                self.model.dispose_cache(step.cache.kv)
            # One line with the request id: a grammar refusing the text is that request's own
            # failure (a traceback, for a bug, was logged where it was caught).
            logger.warning("generation %s failed: %s", sequence.job.generation.request_id, step.reason)
            self._fail(sequence.job)
            return
        self._stats.consecutive_faults = 0
        sequence = self._sequences[step.handle]
        if step.token_id is None:  # the model ended the sequence; like StepEnd on the exclusive path
            tail = sequence.matcher.feed(step.text)[0] + sequence.matcher.flush()
            self._end(step.handle, step.finish_reason or "stop", step.cache, tail)
            return
        sequence.count += 1
        sequence.unsent.append(step.token_id)
        if step.logprob is not None:
            sequence.unsent_logprobs.append(step.logprob)
        self._stats.tokens_generated += 1
        self._stats.last_progress_at = now
        sequence.turn.first_at = sequence.turn.first_at or now
        text, stopped = sequence.matcher.feed(step.text)
        if text or stopped:
            # Held-back tokens (a partial character, a possible stop string) ride along with the
            # next text, so the token ids add up to completion_tokens; as on the exclusive path.
            sequence.job.generation.post_threadsafe(self._delta(sequence, text))
        if stopped:  # a text stop string: the sequence leaves the batch now, cleanly ("stop")
            last = self._last_steps.get(step.handle, step)
            cache = last.cache if last.finish_reason is not None else self.runner.remove(step.handle)
            self._end(step.handle, "stop", cache)
        elif step.finish_reason is not None:
            self._end(step.handle, step.finish_reason, step.cache, sequence.matcher.flush())

    def _end(self, handle: int, finish: str, cache: SequenceCache | None, tail: str = "") -> None:
        sequence = self._sequences.pop(handle)
        self.shared.ended(handle)
        job = sequence.job
        result = JobResult(finish, touched=True)
        try:
            if tail or sequence.unsent:
                job.generation.post_threadsafe(self._delta(sequence, tail))
            matched = sequence.matcher.matched if finish == "stop" else None
            drafts, prediction = self._count_drafts(handle, job)
            post_done(
                job,
                sequence.turn,
                self._stats,
                self._clock(),
                finish,
                sequence.count,
                matched,
                prediction,
                drafts,
            )
            if cache is not None and self._holds_its_tokens(job, cache):
                nbytes = self.model.cache_nbytes(cache.kv)
                result = JobResult(finish, cache.kv, cache.tokens, nbytes, touched=True)
        finally:
            job.on_end(result)  # exactly once, whatever failed above: the lane slot must come back

    def _count_drafts(self, handle: int, job: GenerateJob) -> tuple[DraftCounts | None, tuple[int, int]]:
        """Add an ending sequence's speculation counts (drafts of every source) to the worker's,
        and return them (None: it could not draft) with its prediction's (accepted, rejected)
        tokens for its usage, as OpenAI means them: the prediction's tokens the output
        reproduced, and the rest ((0, 0) without a prediction)."""
        counts = self.runner.speculation_stats(handle)
        if counts is not None:
            self._stats.speculation.add(counts)
        if not job.prediction_ids:
            return counts, (0, 0)
        accepted = min(self.runner.prediction_reproduced(handle), len(job.prediction_ids))
        return counts, (accepted, len(job.prediction_ids) - accepted)

    def _holds_its_tokens(self, job: GenerateJob, cache: SequenceCache) -> bool:
        """Whether the batch's cache holds exactly the tokens it says (SES-1): a warm session
        whose KV and tokens disagree would start later turns from the wrong state, so a mismatch
        is disposed, never adopted."""
        length = self.model.cache_length(cache.kv)
        if length == len(cache.tokens):
            return True
        logger.warning(
            "batch cache of %s holds %d tokens but lists %d; not kept as a warm session",
            job.generation.request_id,
            length,
            len(cache.tokens),
        )
        self.model.dispose_cache(cache.kv)
        return False

    @staticmethod
    def _delta(sequence: _Sequence, text: str) -> Delta:
        delta = Delta(text, tuple(sequence.unsent), tuple(sequence.unsent_logprobs))
        sequence.unsent.clear()
        sequence.unsent_logprobs.clear()
        return delta

    def _fail(self, job: GenerateJob) -> None:
        self._stats.requests_failed += 1
        job.generation.post_threadsafe(Failed(code="generation_failed", message=FAILED_MESSAGE))
        job.on_end(JobResult("error", kv=job.unused_kv(), touched=True))

    def _sync_stats(self) -> None:
        sequences = self._sequences
        self._stats.batch_size = len(sequences)
        oldest = next(iter(sequences.values()), None)
        self._stats.active_request = oldest.job.generation.request_id if oldest is not None else None


class BatchedScheduler(Scheduler):
    """Runs GenerateJobs together in one `Batch`, for lanes with capacity > 1 (LANE-1).

    A generation joins the batch between decode steps when the lane's capacity (the host's
    `batch_capacity`) is above 1, the model can batch (its optional `open_batch`) and the batch
    takes it (`Batch.accepts`); otherwise the exclusive scheduler runs it, once the batch has
    drained. Busy while the batch holds a sequence; each `step()` is one decode step of them all.
    """

    def __init__(
        self, host: Host, clock: Callable[[], float], burst_wait_s: float, *, speculation: bool = False
    ) -> None:
        self._host = host
        self._clock = clock
        self.burst_wait_s = burst_wait_s
        self.speculation = speculation  # batches draft for the jobs that allow it (docs/speculation.md)
        self._batch: Batch | None = None
        self._unbatchable: LoadedModel | None = None  # the model whose open_batch said no

    @property
    def busy(self) -> bool:
        return self._batch is not None and len(self._batch) > 0

    def accepts(self, job: Queued) -> bool:
        """Whether `job` may join the batch now (opening one, or replacing a stale idle one)."""
        return isinstance(job, GenerateJob) and self._batch_for(job) is not None

    def prepare(self, fifo: Fifo) -> None:
        """Wait briefly for requests still preparing, so a burst is prefilled in one call.

        A burst reaches the worker spread out by each request's own key check, alias lookup and
        chat template. Started at once, the first request would be prefilled alone and every
        other one a step later, behind it. Nobody is decoding yet, so waiting costs no running
        stream anything; it ends as soon as no permit is outstanding, the batch would be full,
        or `burst_wait_s` has passed on the worker's clock. A lone request (no other permits)
        never waits.
        """
        host = self._host
        if not (
            host.batch_capacity > 1
            and self.burst_wait_s > 0
            and not self.busy
            and isinstance(fifo.head, GenerateJob)
        ):
            return
        stats = host.stats

        def waiting() -> None:
            if not stats.gathering:
                stats.gathering = True
                stats.burst_waits += 1

        try:
            fifo.gather(self.burst_wait_s, lambda: fifo.count(GenerateJob) < host.batch_capacity, waiting)
        finally:
            stats.gathering = False

    def start(self, fifo: Fifo) -> None:
        job = fifo.pop()
        assert isinstance(job, GenerateJob) and self._batch is not None  # see `accepts`
        self._batch.insert(job)

    def step(self) -> None:
        assert self._batch is not None
        try:
            self._batch.step()
        except Exception as exc:
            # The backend raised outside any one sequence's sampler or processors: nobody can be
            # blamed, so the batch ends and the model's shared state is rebuilt (OPS-2).
            logger.exception("a batch step failed")
            self._batch.fail_all()
            self._batch = None
            self._host.fault(exc)

    def reset(self) -> None:
        self._unbatchable = None
        if self._batch is not None and self._batch.model is not self._host.model:
            self.close()  # unloaded or replaced: the batch must not pin the old weights

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
            self._batch = None

    def _batch_for(self, job: GenerateJob) -> Batch | None:
        """The batch `job` may join now, or None when it must run alone."""
        model, capacity = self._host.model, self._host.batch_capacity
        if capacity <= 1 or model is None:  # None: the exclusive path reloads it, in order
            return None
        batch = self._batch
        if batch is not None and (
            batch.model is not model or (len(batch) == 0 and batch.capacity != capacity)
        ):
            self.close()
            batch = None
        if batch is None and model is not self._unbatchable:
            batch = self._open(model, capacity)
        return batch if batch is not None and batch.accepts(job) else None

    def _open(self, model: LoadedModel, capacity: int) -> Batch | None:
        open_batch = getattr(model, "open_batch", None)  # optional in the backend protocol
        try:
            runner = open_batch(capacity, speculation=self.speculation) if open_batch is not None else None
        except Exception:
            logger.exception("opening a batch failed; serving one request at a time")
            runner = None
        if runner is None:
            self._unbatchable = model
            return None
        self._batch = Batch(model, runner, self._host.stats, self._clock)
        return self._batch
