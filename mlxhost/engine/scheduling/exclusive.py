"""The exclusive scheduler: one generation alone on the model, through `model.generate`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mlxhost.engine.backends.base import StepEnd
from mlxhost.engine.errors import GrammarFailedError
from mlxhost.engine.images import request_images
from mlxhost.engine.jobs import GenerateJob, JobResult, Turn, post_done
from mlxhost.engine.scheduling.base import Scheduler
from mlxhost.engine.stops import StopMatcher
from mlxhost.engine.types import Delta, Failed, Started

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.backends.base import LoadedModel
    from mlxhost.engine.scheduling.base import Host, Queued
    from mlxhost.engine.scheduling.fifo import Fifo
    from mlxhost.engine.types import TokenLogprob

logger = logging.getLogger(__name__)

FAILED_MESSAGE = "The model failed while generating."


class ExclusiveScheduler(Scheduler):
    """Runs a GenerateJob alone, to its end, inside `start`: every generation the batched
    scheduler does not take (a lane of capacity 1, a model that cannot batch, a request the
    batch refuses). The stop flag is read on every token: a disconnect frees the model at once."""

    def __init__(self, host: Host, clock: Callable[[], float]) -> None:
        self._host = host
        self._clock = clock

    def accepts(self, job: Queued) -> bool:
        return isinstance(job, GenerateJob)

    def start(self, fifo: Fifo) -> None:
        job = fifo.pop()
        assert isinstance(job, GenerateJob)  # see `accepts`
        self._generate(job)

    def _generate(self, job: GenerateJob) -> None:
        generation, stats = job.generation, self._host.stats
        stats.active_request = generation.request_id
        stats.last_progress_at = self._clock()
        result = JobResult("error")
        try:
            result = self._generate_tokens(job)
        except GrammarFailedError as exc:  # the request's own grammar: one line, not a fault of the model
            logger.warning("generation %s failed: %s", generation.request_id, exc)
            stats.requests_failed += 1
            generation.post_threadsafe(Failed(code="generation_failed", message=FAILED_MESSAGE))
            result = JobResult("error", kv=job.unused_kv(), touched=True)
        except Exception as exc:
            logger.exception("generation %s failed", generation.request_id)
            stats.requests_failed += 1
            generation.post_threadsafe(Failed(code="generation_failed", message=FAILED_MESSAGE))
            result = JobResult("error", kv=job.unused_kv(), touched=True)
            self._host.fault(exc)
        finally:
            stats.active_request = None
            job.on_end(result)

    def _generate_tokens(self, job: GenerateJob) -> JobResult:
        host = self._host
        generation, model = job.generation, host.model
        started = self._clock()
        turn = Turn(started=started, queue_ms=(started - job.submitted_at) * 1000)
        if model is None and host.reload is not None:
            # Unloaded (a writer ran) after this request's pre-work: load again, here, in order.
            try:
                model = host.reload()
            except Exception as exc:
                generation.post_threadsafe(Failed(code="model_load_failed", message=str(exc)))
                return JobResult("error")
        if model is None:
            generation.post_threadsafe(Failed(code="model_not_loaded", message="The model is not loaded."))
            return JobResult("error")
        if generation.stop_flag.is_set():  # cancelled while it waited: never touches the model
            post_done(job, turn, host.stats, self._clock(), "cancelled", 0)
            return JobResult("cancelled")
        kv, reuse = job.start_kv(model)  # the cached prefix this prompt shares; the rest is fed
        if kv is None:
            kv, reuse = model.new_cache(), 0
        generation.post_threadsafe(Started(prompt_tokens=len(job.prompt_ids), cached_tokens=reuse))
        turn.cached = reuse
        finish, generated, turn.first_at, matched = self._decode(job, model, kv, reuse)
        host.stats.consecutive_faults = 0  # a clean run: whatever broke before is mended
        post_done(job, turn, host.stats, self._clock(), finish, len(generated), matched)
        length = model.cache_length(kv)
        tokens = (*job.prompt_ids, *generated)[:length]
        return JobResult(finish, kv, tokens, model.cache_nbytes(kv), touched=True)

    def _decode(
        self, job: GenerateJob, model: LoadedModel, kv: object, reuse: int
    ) -> tuple[str, list[int], float | None, str | None]:
        """Stream tokens until a finish; returns it, the token ids, the first token's time and
        the stop string that ended the turn (None unless a stop string did)."""
        generation, stats = job.generation, self._host.stats
        matcher = StopMatcher(job.sampling.stop)
        images = request_images(generation.request.messages)
        if images:  # a vision model's turn with images: never from a cached prefix (reuse is 0)
            steps = model.generate(
                job.prompt_ids[reuse:], job.sampling, kv, context=(), images=images, adapter=job.adapter
            )
        else:
            steps = model.generate(
                job.prompt_ids[reuse:],
                job.sampling,
                kv,
                context=job.prompt_ids[:reuse],
                max_draft=job.max_draft,
                counts=stats.speculation,  # a draft model's drafts, as the batch counts its rows'
                adapter=job.adapter,
            )
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
                stats.tokens_generated += 1
                stats.last_progress_at = self._clock()
                first_at = first_at or stats.last_progress_at
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
