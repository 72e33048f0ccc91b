"""The embedding scheduler: an embedding model's requests together, in as few forward passes as fit."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mlxhost.engine.embeddings import EmbedJob, PassStats, run_jobs
from mlxhost.engine.errors import ModelLoadError
from mlxhost.engine.scheduling.base import Scheduler

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.scheduling.base import Host, Queued
    from mlxhost.engine.scheduling.fifo import Fifo

logger = logging.getLogger(__name__)


class EmbeddingScheduler(Scheduler):
    """Runs the EmbedJobs at the head of the FIFO together (API-14), inside `start`: first it
    waits up to `wait_s` for requests of the same burst still tokenizing, as a new generation
    batch does, then it takes every EmbedJob in a row and runs them in one go (`run_jobs`)."""

    def __init__(self, host: Host, clock: Callable[[], float], wait_s: float) -> None:
        self._host = host
        self._clock = clock
        self.wait_s = wait_s

    def accepts(self, job: Queued) -> bool:
        return isinstance(job, EmbedJob)

    def start(self, fifo: Fifo) -> None:
        host = self._host
        fifo.gather(self.wait_s, lambda: fifo.count(EmbedJob) < host.batch_capacity)
        jobs: list[EmbedJob] = []
        while isinstance(job := fifo.head, EmbedJob):
            fifo.pop()
            jobs.append(job)
        model = host.embedder
        if model is None:
            for job in jobs:
                job.on_end(None, ModelLoadError("The model is not loaded; retry."))
            return
        stats = host.stats
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
            host.fault(exc)
            return
        finally:
            stats.active_request = None
        stats.consecutive_faults = 0
        stats.requests_finished += len(jobs)
