"""The per-instance worker thread: the only thread that touches the instance's model."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxhost.engine.backends.base import StepEnd
from mlxhost.engine.stops import StopMatcher
from mlxhost.engine.types import Delta, Done, Failed, Started, Timings, Usage

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import LoadedModel
    from mlxhost.engine.generation import Generation

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerateJob:
    generation: Generation
    prompt_ids: list[int]
    submitted_at: float


@dataclass(slots=True)
class CallJob:
    """Run `fn` on the worker thread (load, unload) and report through `done`."""

    fn: Callable[[], object]
    done: Callable[[object, BaseException | None], None]


class _Shutdown:
    pass


@dataclass(slots=True)
class WorkerStats:
    tokens_generated: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    active_request: str | None = None
    last_decode_tps: float = 0.0


class InstanceWorker:
    """Runs jobs for one instance, FIFO, on one daemon thread."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.model: LoadedModel | None = None
        self.stats = WorkerStats()
        self._clock = clock
        self._jobs: queue.Queue[GenerateJob | CallJob | _Shutdown] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"mlxhost-worker-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: GenerateJob | CallJob) -> None:
        self._jobs.put(job)

    def shutdown(self, timeout: float) -> None:
        self._jobs.put(_Shutdown())
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, _Shutdown):
                return
            if isinstance(job, CallJob):
                self._call(job)
            else:
                self._generate(job)

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
        try:
            self._generate_tokens(job)
        except Exception:
            logger.exception("generation %s failed", generation.request_id)
            self.stats.requests_failed += 1
            generation.post_threadsafe(
                Failed(code="generation_failed", message="The model failed while generating.")
            )
        finally:
            self.stats.active_request = None

    def _generate_tokens(self, job: GenerateJob) -> None:
        generation, model = job.generation, self.model
        request = generation.request
        started = self._clock()
        queue_ms = (started - job.submitted_at) * 1000
        if model is None:
            generation.post_threadsafe(Failed(code="model_not_loaded", message="The model is not loaded."))
            return
        if generation.stop_flag.is_set():  # cancelled while it waited: never touches the model
            self._finish(job, "cancelled", 0, started, queue_ms, None)
            return
        generation.post_threadsafe(Started(prompt_tokens=len(job.prompt_ids)))
        matcher = StopMatcher(request.sampling.stop)
        steps = model.generate(job.prompt_ids, request.sampling)
        count, first_token_at, finish = 0, None, "length"
        try:
            for step in steps:
                if isinstance(step, StepEnd):
                    finish = step.finish_reason
                    text, _ = matcher.feed(step.text)
                    text += matcher.flush()
                    if text:
                        generation.post_threadsafe(Delta(text=text))
                    break
                count += 1
                self.stats.tokens_generated += 1
                first_token_at = first_token_at or self._clock()
                text, stopped = matcher.feed(step.text)
                if text or stopped:
                    generation.post_threadsafe(Delta(text=text, token_ids=(step.token_id,)))
                if stopped:
                    finish = "stop"
                    break
                # The stop flag is checked on every token: a disconnect frees the model at once.
                if generation.stop_flag.is_set():
                    finish = "cancelled"
                    break
        finally:
            steps.close()  # type: ignore[attr-defined]
        self._finish(job, finish, count, started, queue_ms, first_token_at)

    def _finish(
        self,
        job: GenerateJob,
        finish: str,
        count: int,
        started: float,
        queue_ms: float,
        first_at: float | None,
    ) -> None:
        now = self._clock()
        first_at = first_at or now
        decode_s = max(now - first_at, 1e-9)
        prefill_s = max(first_at - started, 1e-9)
        decode_tps = (count - 1) / decode_s if count > 1 else 0.0
        self.stats.last_decode_tps = decode_tps or self.stats.last_decode_tps
        if finish == "cancelled":
            self.stats.requests_cancelled += 1
        else:
            self.stats.requests_finished += 1
        timings = Timings(
            queue_ms=queue_ms,
            ttft_ms=(first_at - job.submitted_at) * 1000,
            prefill_tps=len(job.prompt_ids) / prefill_s,
            decode_tps=decode_tps,
        )
        usage = Usage(prompt_tokens=len(job.prompt_ids), completion_tokens=count)
        job.generation.post_threadsafe(Done(finish_reason=finish, usage=usage, timings=timings))  # type: ignore[arg-type]
