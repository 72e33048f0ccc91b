"""The per-instance worker thread: the only thread that touches the instance's model."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from mlxhost.engine.backends.base import StepEnd
from mlxhost.engine.batching import BatchScheduler
from mlxhost.engine.embeddings import EmbedJob, PassStats, run_jobs
from mlxhost.engine.errors import GrammarFailedError, ModelLoadError
from mlxhost.engine.jobs import (
    CallJob,
    GenerateJob,
    JobResult,
    Turn,
    WorkerStats,
    WriteJob,
    end_unstarted,
    post_done,
)
from mlxhost.engine.stops import StopMatcher
from mlxhost.engine.types import Delta, Failed, Started

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.backends.base import EmbeddingModel, LoadedModel
    from mlxhost.engine.types import TokenLogprob

# The job types live in jobs.py, shared with the batched scheduler; callers import them from here.
__all__ = ["CallJob", "EmbedJob", "GenerateJob", "InstanceWorker", "JobResult", "WorkerStats", "WriteJob"]

Job = GenerateJob | CallJob | EmbedJob

logger = logging.getLogger(__name__)

# How often a worker gathering a burst re-reads the lane's permit count.
BURST_POLL_S = 0.005


class _Shutdown:
    pass


class InstanceWorker:
    """Runs jobs for one instance, FIFO, on one daemon thread.

    Two schedulers share this thread. The exclusive one runs a GenerateJob alone through
    `model.generate`. When the lane's capacity (`batch_capacity`) is above 1 and the model
    can batch, GenerateJobs join a `BatchScheduler` between decode steps instead. An embedding
    model's EmbedJobs at the head of the FIFO run together, one forward pass for as many as fit
    (after waiting up to `embed_wait_s` for requests still tokenizing, API-14). A job that
    cannot batch (see `BatchRunner.accepts`), a load or unload (`CallJob`, a lane
    writer) and shutdown wait at the head of the FIFO until the batch drains, then run alone;
    everything behind them waits too, so neither side starves.
    """

    def __init__(
        self,
        name: str,
        clock: Callable[[], float] = time.monotonic,
        on_exit: Callable[[], None] | None = None,
        *,
        reload: Callable[[], LoadedModel] | None = None,
        batch_capacity: int = 1,
        arrivals: Callable[[], int] = lambda: 0,
        burst_wait_s: float = 0.0,
        reload_after_faults: int = 3,
        embed_wait_s: float = 0.0,
    ) -> None:
        self.model: LoadedModel | None = None
        self.embedder: EmbeddingModel | None = None  # an embedding instance's model (API-13)
        self.embed_wait_s = embed_wait_s
        self.reload = reload  # loads the model afresh after repeated faults (the instance's)
        # The lane's capacity (LANE-1); the instance changes it through `set_batch_capacity`.
        self.batch_capacity = batch_capacity
        # Requests still preparing (lane permits) and how long a new batch may wait for them.
        self.arrivals = arrivals
        self.burst_wait_s = burst_wait_s
        self.reload_after_faults = reload_after_faults  # unattributed failures in a row before a reload
        self.stats = WorkerStats()
        self._clock = clock
        self._jobs: queue.Queue[Job | WriteJob | _Shutdown] = queue.Queue()
        self._pending: deque[Job | _Shutdown] = deque()  # taken, not yet started
        self._writes: deque[WriteJob] = deque()  # disk-tier saves, off the FIFO (see WriteJob)
        self._batch: BatchScheduler | None = None
        self._unbatchable: LoadedModel | None = None  # the model whose open_batch said no
        self._on_exit = on_exit  # the backend's per-thread cleanup, run as the thread ends
        self._thread = threading.Thread(target=self._run, name=f"mlxhost-worker-{name}", daemon=True)
        self._thread.start()

    def set_batch_capacity(self, capacity: int) -> None:
        """The lane's new capacity; the worker reads it per job (LANE-1)."""
        self.batch_capacity = capacity

    def submit(self, job: Job | WriteJob) -> None:
        self._jobs.put(job)

    def shutdown(self, timeout: float) -> None:
        self._jobs.put(_Shutdown())
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if self._on_exit is not None:
                try:
                    self._on_exit()
                except Exception:
                    logger.exception("the worker's thread cleanup failed")

    def _loop(self) -> None:
        while True:
            if not self._pending and not self._batch_busy():
                if not self._writes:
                    self._take(self._jobs.get())  # idle: block until there is work
                elif self._jobs.empty():
                    self._write(self._writes.popleft())  # idle: save one kept turn, then look again
                    continue
            while True:  # never block between decode steps
                try:
                    self._take(self._jobs.get_nowait())
                except queue.Empty:
                    break
            self._write_urgent()
            if self._opens_batch():
                self._gather_burst()
            if self._start_pending():
                return
            if self._batch_busy():
                self._step_batch()

    def _take(self, job: Job | WriteJob | _Shutdown) -> None:
        if isinstance(job, WriteJob):
            self._writes.append(job)
        else:
            self._pending.append(job)

    def _write_urgent(self) -> None:
        for job in [j for j in self._writes if j.urgent()]:
            self._writes.remove(job)
            self._write(job)

    def _flush_writes(self) -> None:
        while self._writes:
            self._write(self._writes.popleft())

    def _write(self, job: WriteJob) -> None:
        model = self.model
        try:
            if model is not None:
                job.write(model)
        except Exception:
            logger.exception("saving a KV cache to disk failed")
        finally:
            job.done()

    def _start_pending(self) -> bool:
        """Start pending jobs in FIFO order while they can start; True once shutdown is reached."""
        while self._pending:
            job = self._pending[0]
            if isinstance(job, GenerateJob) and (batch := self._batch_for(job)) is not None:
                self._pending.popleft()
                batch.insert(job)
                continue
            if self._batch_busy():  # the head needs the model alone: let the batch drain first
                if self._end_cancelled_waiters():
                    continue
                return False
            if isinstance(job, EmbedJob):
                self._embed()
                continue
            self._pending.popleft()
            if isinstance(job, _Shutdown):
                self._flush_writes()
                self._close_batch()
                return True
            if isinstance(job, CallJob):
                self._flush_writes()  # a load, unload or close may take the model they need
                self._call(job)
                self._unbatchable = None
                if self._batch is not None and self._batch.model is not self.model:
                    self._close_batch()  # unloaded or replaced: the batch must not pin the old weights
            else:
                self._generate(job)
        return False

    def _embed(self) -> None:
        """Run the EmbedJobs at the head of the FIFO together (API-14): first wait briefly for
        requests of the same burst still tokenizing, as a generation batch does (see
        `_gather_burst`), then take every EmbedJob in a row and run them in one go."""
        deadline = time.monotonic() + self.embed_wait_s
        while self.arrivals() > 0 and self._pending_embeds() < self.batch_capacity:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                self._take(self._jobs.get(timeout=min(left, BURST_POLL_S)))
            except queue.Empty:
                continue
        jobs: list[EmbedJob] = []
        while self._pending and isinstance(self._pending[0], EmbedJob):
            jobs.append(self._pending.popleft())  # type: ignore[arg-type]  # checked just above
        model = self.embedder
        if model is None:
            for job in jobs:
                job.on_end(None, ModelLoadError("The model is not loaded; retry."))
            return
        stats = self.stats
        stats.active_request = jobs[0].request_id
        stats.last_progress_at = self._clock()

        def count(done: PassStats) -> None:  # before the jobs hear their end: counters first
            stats.embedding_passes += done.passes
            stats.inputs_embedded += done.inputs
            stats.tokens_embedded += done.tokens

        try:
            run_jobs(model, jobs, self._clock, count)
        except Exception as exc:  # every job already heard how it ended
            logger.exception("an embedding pass failed")
            stats.requests_failed += 1
            self._fault(exc)
            return
        finally:
            stats.active_request = None
        stats.consecutive_faults = 0
        stats.requests_finished += len(jobs)

    def _pending_embeds(self) -> int:
        return sum(1 for job in self._pending if isinstance(job, EmbedJob))

    def _opens_batch(self) -> bool:
        """Whether the pending head is a generation that would start an idle batch."""
        return (
            self.batch_capacity > 1
            and self.burst_wait_s > 0
            and not self._batch_busy()
            and bool(self._pending)
            and isinstance(self._pending[0], GenerateJob)
        )

    def _gather_burst(self) -> None:
        """Wait briefly for requests still preparing, so a burst is prefilled in one call.

        A burst reaches the worker spread out by each request's own key check, alias lookup and
        chat template. Started at once, the first request would be prefilled alone and every
        other one a step later, behind it. Nobody is decoding yet, so waiting costs no running
        stream anything; it ends as soon as no permit is outstanding, the batch would be full,
        or `burst_wait_s` has passed. A lone request (no other permits) never waits.
        """
        deadline = time.monotonic() + self.burst_wait_s
        try:
            while self.arrivals() > 0 and self._pending_generations() < self.batch_capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if not self.stats.gathering:
                    self.stats.gathering = True
                    self.stats.burst_waits += 1
                try:
                    self._take(self._jobs.get(timeout=min(left, BURST_POLL_S)))
                except queue.Empty:
                    continue
        finally:
            self.stats.gathering = False

    def _pending_generations(self) -> int:
        return sum(1 for job in self._pending if isinstance(job, GenerateJob))

    def _batch_busy(self) -> bool:
        return self._batch is not None and len(self._batch) > 0

    def _batch_for(self, job: GenerateJob) -> BatchScheduler | None:
        """The batch `job` may join now, or None when it must run alone."""
        model = self.model
        if self.batch_capacity <= 1 or model is None:  # None: the exclusive path reloads it, in order
            return None
        batch = self._batch
        if batch is not None and (
            batch.model is not model or (len(batch) == 0 and batch.capacity != self.batch_capacity)
        ):
            self._close_batch()
            batch = None
        if batch is None and model is not self._unbatchable:
            batch = self._open_batch(model)
        return batch if batch is not None and batch.accepts(job) else None

    def _open_batch(self, model: LoadedModel) -> BatchScheduler | None:
        open_batch = getattr(model, "open_batch", None)  # optional in the backend protocol
        try:
            runner = open_batch(self.batch_capacity) if open_batch is not None else None
        except Exception:
            logger.exception("opening a batch failed; serving one request at a time")
            runner = None
        if runner is None:
            self._unbatchable = model
            return None
        self._batch = BatchScheduler(model, runner, self.stats, self._clock)
        return self._batch

    def _close_batch(self) -> None:
        if self._batch is not None:
            self._batch.close()
            self._batch = None

    def _step_batch(self) -> None:
        assert self._batch is not None
        try:
            self._batch.step()
        except Exception as exc:
            # The backend raised outside any one sequence's sampler or processors: nobody can be
            # blamed, so the batch ends and the model's shared state is rebuilt (OPS-2).
            logger.exception("a batch step failed")
            self._batch.fail_all()
            self._batch = None
            self._fault(exc)

    def _end_cancelled_waiters(self) -> bool:
        # A waiter cancelled behind an exclusive turn frees its slot now, not after the batch drains.
        cancelled = [
            j for j in self._pending if isinstance(j, GenerateJob) and j.generation.stop_flag.is_set()
        ]
        for job in cancelled:
            self._pending.remove(job)
            end_unstarted(job, self.stats, self._clock())
        return bool(cancelled)

    def _call(self, job: CallJob) -> None:
        try:
            result = job.fn()
        except BaseException as exc:  # reported to the waiting coroutine, never lost
            job.done(None, exc)
        else:
            job.done(result, None)

    def _generate(self, job: GenerateJob) -> None:
        generation = job.generation
        self.stats.active_request = generation.request_id
        self.stats.last_progress_at = self._clock()
        result = JobResult("error")
        try:
            result = self._generate_tokens(job)
        except GrammarFailedError as exc:  # the request's own grammar: one line, not a fault of the model
            logger.warning("generation %s failed: %s", generation.request_id, exc)
            self.stats.requests_failed += 1
            generation.post_threadsafe(
                Failed(code="generation_failed", message="The model failed while generating.")
            )
            result = JobResult("error", kv=job.unused_kv(), touched=True)
        except Exception as exc:
            logger.exception("generation %s failed", generation.request_id)
            self.stats.requests_failed += 1
            generation.post_threadsafe(
                Failed(code="generation_failed", message="The model failed while generating.")
            )
            result = JobResult("error", kv=job.unused_kv(), touched=True)
            self._fault(exc)
        finally:
            self.stats.active_request = None
            job.on_end(result)

    def _fault(self, error: BaseException) -> None:
        """A failure the worker cannot pin on one request: report it, rebuild the model's shared
        state, and after `reload_after_faults` in a row drop the model so the next request loads
        it afresh, instead of failing every later request (OPS-2)."""
        stats = self.stats
        stats.faults += 1
        stats.consecutive_faults += 1
        stats.last_fault = type(error).__name__
        model = self.model
        if model is None:
            return
        recover = getattr(model, "recover", None)  # optional in the backend protocol
        if recover is not None:
            try:
                recover()
                stats.recoveries += 1
            except Exception:
                logger.exception("recovering the model after a failure failed")
        if stats.consecutive_faults % self.reload_after_faults == 0 and self.reload is not None:
            logger.error("%d failures in a row: loading the model afresh", stats.consecutive_faults)
            self._close_batch()
            self.model = None
            model.close()
            stats.reloads += 1
            try:
                self.reload()  # marks the instance loading, then ready (or error, shown in /readyz)
            except Exception:
                logger.exception("reloading the model after repeated failures failed")

    def _generate_tokens(self, job: GenerateJob) -> JobResult:
        generation, model = job.generation, self.model
        started = self._clock()
        turn = Turn(started=started, queue_ms=(started - job.submitted_at) * 1000)
        if model is None and self.reload is not None:
            # Unloaded (a writer ran) after this request's pre-work: load again, here, in order.
            try:
                model = self.reload()
            except Exception as exc:
                generation.post_threadsafe(Failed(code="model_load_failed", message=str(exc)))
                return JobResult("error")
        if model is None:
            generation.post_threadsafe(Failed(code="model_not_loaded", message="The model is not loaded."))
            return JobResult("error")
        if generation.stop_flag.is_set():  # cancelled while it waited: never touches the model
            post_done(job, turn, self.stats, self._clock(), "cancelled", 0)
            return JobResult("cancelled")
        kv, reuse = job.start_kv(model)  # the cached prefix this prompt shares; the rest is fed
        if kv is None:
            kv, reuse = model.new_cache(), 0
        generation.post_threadsafe(Started(prompt_tokens=len(job.prompt_ids), cached_tokens=reuse))
        turn.cached = reuse
        finish, generated, turn.first_at, matched = self._decode(job, model, kv, reuse)
        self.stats.consecutive_faults = 0  # a clean run: whatever broke before is mended
        post_done(job, turn, self.stats, self._clock(), finish, len(generated), matched)
        length = model.cache_length(kv)
        tokens = (*job.prompt_ids, *generated)[:length]
        return JobResult(finish, kv, tokens, model.cache_nbytes(kv), touched=True)

    def _decode(
        self, job: GenerateJob, model: LoadedModel, kv: object, reuse: int
    ) -> tuple[str, list[int], float | None, str | None]:
        """Stream tokens until a finish; returns it, the token ids, the first token's time and
        the stop string that ended the turn (None unless a stop string did)."""
        generation = job.generation
        matcher = StopMatcher(job.sampling.stop)
        steps = model.generate(job.prompt_ids[reuse:], job.sampling, kv, context=job.prompt_ids[:reuse])
        generated: list[int] = []
        logprobs: list[TokenLogprob] = []  # with a request for them: one per generated token
        sent = 0  # how many of `generated` the reader has been sent
        first_at, finish, tail = None, "length", ""
        try:
            for step in steps:
                if isinstance(step, StepEnd):
                    finish = step.finish_reason
                    tail = matcher.feed(step.text)[0] + matcher.flush()
                    break
                generated.append(step.token_id)
                if step.logprob is not None:
                    logprobs.append(step.logprob)
                self.stats.tokens_generated += 1
                self.stats.last_progress_at = self._clock()
                first_at = first_at or self.stats.last_progress_at
                text, stopped = matcher.feed(step.text)
                if text or stopped:
                    # Tokens whose text was held back (a partial character, a possible stop string)
                    # ride along with the next text, so the token ids add up to completion_tokens.
                    generation.post_threadsafe(Delta(text, tuple(generated[sent:]), tuple(logprobs[sent:])))
                    sent = len(generated)
                if stopped:
                    finish = "stop"
                    break
                # The stop flag is checked on every token: a disconnect frees the model at once.
                if generation.stop_flag.is_set():
                    finish = "cancelled"
                    break
        finally:
            steps.close()  # type: ignore[attr-defined]  # every backend's generate() is a generator
        if tail or sent < len(generated):
            generation.post_threadsafe(Delta(tail, tuple(generated[sent:]), tuple(logprobs[sent:])))
        return finish, generated, first_at, matcher.matched if finish == "stop" else None
