"""The per-instance worker thread: the only thread that touches the instance's model."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from mlxhost.engine.embeddings import EmbedJob
from mlxhost.engine.jobs import CallJob, GenerateJob, JobResult, WorkerStats, WriteJob, end_unstarted
from mlxhost.engine.scheduling.base import Shutdown
from mlxhost.engine.scheduling.batched import BatchedScheduler
from mlxhost.engine.scheduling.embedding import EmbeddingScheduler
from mlxhost.engine.scheduling.exclusive import ExclusiveScheduler
from mlxhost.engine.scheduling.fifo import Fifo

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.backends.base import EmbeddingModel, LoadedModel
    from mlxhost.engine.scheduling.base import Job, Scheduler

# The job types live in jobs.py and embeddings.py, shared with the schedulers; callers import them from here.
__all__ = ["CallJob", "EmbedJob", "GenerateJob", "InstanceWorker", "JobResult", "WorkerStats", "WriteJob"]

logger = logging.getLogger(__name__)


class InstanceWorker:
    """Runs jobs for one instance, FIFO, on one daemon thread.

    The head of the FIFO goes to the first scheduler that accepts it (`mlxhost.engine.scheduling`):
    the batched one while the lane's capacity (`batch_capacity`) is above 1 and the model can
    batch, the embedding one for an embedding model's EmbedJobs, the exclusive one for any other
    GenerateJob. A load or unload (`CallJob`, a lane writer) and shutdown run here. A head that
    the busy scheduler (a batch with sequences) cannot take waits until it drains, and
    everything behind it waits too, so neither side starves. Between jobs and steps the worker
    runs disk-tier saves (`WriteJob`), and it owns the policy for failures no request can be
    blamed for (`fault`).
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
        self.reload = reload  # loads the model afresh after repeated faults (the instance's)
        # The lane's capacity (LANE-1); the instance changes it through `set_batch_capacity`.
        self.batch_capacity = batch_capacity
        self.reload_after_faults = reload_after_faults  # unattributed failures in a row before a reload
        self.stats = WorkerStats()
        self._clock = clock
        # `arrivals`: requests still preparing (lane permits), which a new batch or pass may wait for.
        self._fifo = Fifo(clock, arrivals)
        # In the order they are offered the FIFO's head: a generation joins the batch when it can.
        self._schedulers: tuple[Scheduler, ...] = (
            BatchedScheduler(self, clock, burst_wait_s),
            EmbeddingScheduler(self, clock, embed_wait_s),
            ExclusiveScheduler(self, clock),
        )
        self._on_exit = on_exit  # the backend's per-thread cleanup, run as the thread ends
        self._thread = threading.Thread(target=self._run, name=f"mlxhost-worker-{name}", daemon=True)
        self._thread.start()

    def set_batch_capacity(self, capacity: int) -> None:
        """The lane's new capacity; the worker reads it per job (LANE-1)."""
        self.batch_capacity = capacity

    def submit(self, job: Job | WriteJob) -> None:
        self._fifo.put(job)

    def shutdown(self, timeout: float) -> None:
        self._fifo.put(Shutdown())
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
        fifo = self._fifo
        while True:
            if not fifo.pending and self._busy() is None:
                if not fifo.writes:
                    fifo.wait()  # idle: block until there is work
                elif fifo.inbox_empty():
                    self._write(fifo.writes.popleft())  # idle: save one kept turn, then look again
                    continue
            fifo.drain()  # never block between decode steps
            self._write_urgent()
            for scheduler in self._schedulers:
                scheduler.prepare(fifo)  # a batch about to start gathers its burst
            if self._start_pending():
                return
            if (busy := self._busy()) is not None:
                busy.step()

    def _busy(self) -> Scheduler | None:
        return next((scheduler for scheduler in self._schedulers if scheduler.busy), None)

    def _start_pending(self) -> bool:
        """Start pending jobs in FIFO order while they can start; True once shutdown is reached."""
        fifo = self._fifo
        while (job := fifo.head) is not None:
            scheduler = next((s for s in self._schedulers if s.accepts(job)), None)
            busy = self._busy()
            if busy is not None and scheduler is not busy:  # the head needs the model: let it drain first
                if self._end_cancelled_waiters():
                    continue
                return False
            if scheduler is not None:
                scheduler.start(fifo)
                continue
            fifo.pop()
            self._flush_writes()  # a load, unload or close may take the model they need
            if isinstance(job, Shutdown):
                self._close_schedulers()
                return True
            assert isinstance(job, CallJob)  # every other job has its scheduler
            self._call(job)
            for each in self._schedulers:
                each.reset()
        return False

    def _close_schedulers(self) -> None:
        for scheduler in self._schedulers:
            scheduler.close()

    def _end_cancelled_waiters(self) -> bool:
        # A waiter cancelled behind an exclusive turn frees its slot now, not after the batch drains.
        pending = self._fifo.pending
        cancelled = [j for j in pending if isinstance(j, GenerateJob) and j.generation.stop_flag.is_set()]
        for job in cancelled:
            pending.remove(job)
            end_unstarted(job, self.stats, self._clock())
        return bool(cancelled)

    def _write_urgent(self) -> None:
        writes = self._fifo.writes
        for job in [j for j in writes if j.urgent()]:
            writes.remove(job)
            self._write(job)

    def _flush_writes(self) -> None:
        writes = self._fifo.writes
        while writes:
            self._write(writes.popleft())

    def _write(self, job: WriteJob) -> None:
        model = self.model
        try:
            if model is not None:
                job.write(model)
        except Exception:
            logger.exception("saving a KV cache to disk failed")
        finally:
            job.done()

    def _call(self, job: CallJob) -> None:
        try:
            result = job.fn()
        except BaseException as exc:  # reported to the waiting coroutine, never lost
            job.done(None, exc)
        else:
            job.done(result, None)

    def fault(self, error: BaseException) -> None:
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
            self._close_schedulers()
            self.model = None
            model.close()
            stats.reloads += 1
            try:
                self.reload()  # marks the instance loading, then ready (or error, shown in /readyz)
            except Exception:
                logger.exception("reloading the model after repeated failures failed")
