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
    session_kv: object | None = None  # a leased warm session's cache...
    session_tokens: tuple[int, ...] = ()  # ...the tokens it holds...
    reuse_tokens: int = 0  # ...and how many of them prefix this prompt (SES-8)


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
    last_progress_at: float = 0.0  # the active request's last token (or start): a stall shows here


class InstanceWorker:
    """Runs jobs for one instance, FIFO, on one daemon thread."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.model: LoadedModel | None = None
        self.reload: Callable[[], LoadedModel] | None = None  # set by the instance
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
        self.stats.last_progress_at = self._clock()
        result = JobResult("error")
        try:
            result = self._generate_tokens(job)
        except Exception:
            logger.exception("generation %s failed", generation.request_id)
            self.stats.requests_failed += 1
            generation.post_threadsafe(
                Failed(code="generation_failed", message="The model failed while generating.")
            )
            result = JobResult("error", kv=job.session_kv, touched=True)
        finally:
            self.stats.active_request = None
            job.on_end(result)

    def _generate_tokens(self, job: GenerateJob) -> JobResult:
        generation, model = job.generation, self.model
        started = self._clock()
        queue_ms = (started - job.submitted_at) * 1000
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
            self._finish(job, "cancelled", 0, started, queue_ms, None)
            return JobResult("cancelled")
        kv, reuse = job.session_kv, job.reuse_tokens
        if kv is None:
            kv, reuse = model.new_cache(), 0
        else:  # keep only the prefix this prompt shares, feed the rest (MLX-NOTES: trim, then suffix)
            model.trim_cache(kv, model.cache_length(kv) - reuse)
        generation.post_threadsafe(Started(prompt_tokens=len(job.prompt_ids), cached_tokens=reuse))
        finish, generated, first_at = self._decode(job, model, kv, reuse)
        self._finish(job, finish, len(generated), started, queue_ms, first_at, reuse)
        length = model.cache_length(kv)
        tokens = (*job.prompt_ids, *generated)[:length]
        return JobResult(finish, kv, tokens, model.cache_nbytes(kv), touched=True)

    def _decode(
        self, job: GenerateJob, model: LoadedModel, kv: object, reuse: int
    ) -> tuple[str, list[int], float | None]:
        generation = job.generation
        matcher = StopMatcher(generation.request.sampling.stop)
        steps = model.generate(job.prompt_ids[reuse:], generation.request.sampling, kv)
        generated: list[int] = []
        first_at, finish = None, "length"
        try:
            for step in steps:
                if isinstance(step, StepEnd):
                    finish = step.finish_reason
                    text = matcher.feed(step.text)[0] + matcher.flush()
                    if text:
                        generation.post_threadsafe(Delta(text=text))
                    break
                generated.append(step.token_id)
                self.stats.tokens_generated += 1
                self.stats.last_progress_at = self._clock()
                first_at = first_at or self.stats.last_progress_at
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
        return finish, generated, first_at

    def _finish(
        self,
        job: GenerateJob,
        finish: str,
        count: int,
        started: float,
        queue_ms: float,
        first_at: float | None,
        cached: int = 0,
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
            prefill_tps=(len(job.prompt_ids) - cached) / prefill_s,
            decode_tps=decode_tps,
        )
        usage = Usage(prompt_tokens=len(job.prompt_ids), completion_tokens=count, cached_tokens=cached)
        job.generation.post_threadsafe(Done(finish_reason=finish, usage=usage, timings=timings))  # type: ignore[arg-type]
