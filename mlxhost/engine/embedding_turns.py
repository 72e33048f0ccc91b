"""An embedding request's way through the engine (API-14): permit, pre-work, lane, the pass.

The pure checks and the worker's passes are in `embeddings`; this is the engine-side use case.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from mlxhost.engine.embeddings import (
    EmbedJob,
    check_arrays,
    check_characters,
    check_dimensions,
    check_inputs,
    decoded,
    input_limit,
)
from mlxhost.engine.errors import (
    DrainingError,
    EmbeddingFailedError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    QueueFullError,
    QueueTimeoutError,
    RequestCancelledError,
    WrongModelKindError,
)
from mlxhost.engine.prework import UNLOADED_MESSAGE

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.instance import Instance
    from mlxhost.engine.residency import Residency
    from mlxhost.engine.stats import EngineStats
    from mlxhost.engine.tokenizing import TokenizePool
    from mlxhost.engine.turn import Turn
    from mlxhost.engine.types import EmbeddingRequest, Embeddings

EMBEDDING_FAILED_MESSAGE = "The model failed while embedding."
EMBEDDING_ABORTED_MESSAGE = (
    "The model stopped serving (unload, reload or shutdown) before this request ran; retry."
)


class EmbeddingTurns:
    """Runs embedding requests on reserved turns; see `Engine.embed`."""

    def __init__(
        self,
        residency: Residency,
        tokenizers: TokenizePool,
        stats: EngineStats,
        clock: Callable[[], float],
    ) -> None:
        self.residency = residency
        self.tokenizers = tokenizers
        self.stats = stats
        self._clock = clock

    async def embed(self, request: EmbeddingRequest, turn: Turn) -> Embeddings:
        """Embed `request`'s texts on `turn` (a reserved permit, taken on here): load if needed,
        tokenize and check every input, wait for a lane slot, then join the worker's next forward
        pass with whatever other requests for this model are admitted by then. Cancelling the
        caller frees the slot; a pass already running finishes for the others.

        Raises:
            WrongModelKindError: the name is bound to a chat model.
            QueueFullError, DrainingError, DuplicateRequestError: as `Turns.submit` (LANE-2/5/7).
            QueueTimeoutError: it waited longer than the lane's queue timeout (LANE-8).
            ModelLoadError: the model could not be loaded.
            InvalidRequestError: an input is too long (its index named) or `dimensions` is refused.
            EmbeddingFailedError: the forward pass failed.
        """
        turn.claim()
        instance, key = turn.instance, turn.key
        started = self._clock()
        outcome, result, job = "failed", None, None
        try:
            job, done = await self._job(instance, request)
            turn.enter_embedding(job)
            await asyncio.shield(turn.ticket.admitted)
            result = await done
            outcome = "completed"
            return result
        except (asyncio.CancelledError, RequestCancelledError):
            outcome = "cancelled"
            raise
        except (QueueFullError, DrainingError, QueueTimeoutError) as exc:
            outcome = ""  # refused, as on every surface (LANE-2/7/8)
            self.stats.reject(key, exc.code)
            raise
        except (WrongModelKindError, InvalidRequestError):
            outcome = ""  # refused before it ran: not an embedding request that ended
            raise
        finally:
            if job is not None:
                job.cancel()  # a no-op once it ran; a queued or waiting job never runs
            turn.end_embedding()
            if outcome:
                inputs, tokens = (len(result.vectors), result.prompt_tokens) if result else (0, 0)
                latency = self._clock() - started
                self.stats.embedded(key, outcome, inputs=inputs, tokens=tokens, latency_s=latency)

    async def _job(
        self, instance: Instance, request: EmbeddingRequest
    ) -> tuple[EmbedJob, asyncio.Future[Embeddings]]:
        """The pre-work of an embedding under its permit (LANE-3): load, check, tokenize off the
        loop; the job and the future its worker-side end settles."""
        if instance.spec.kind != "embedding":
            raise WrongModelKindError.chat_on_embeddings(request.binding)
        await self.residency.ensure_loaded(instance)
        model = instance.embedder
        if model is None:
            raise ModelLoadError(UNLOADED_MESSAGE)
        dimensions = check_dimensions(
            request.dimensions, width=model.dimensions, truncatable=request.truncatable
        )
        limit = input_limit(model.max_tokens, request.max_input_tokens)
        if any(not isinstance(text, str) for text in request.texts):
            check_arrays(request.texts, limit=limit)  # before decoding: a huge array never is
            texts = await self.tokenizers.run(decoded, request.texts, request.decode)
        else:
            texts = [text for text in request.texts if isinstance(text, str)]
        check_characters(texts, chars_per_token=model.chars_per_token, limit=limit)
        ids = await self.tokenizers.run(model.tokenize, texts)
        check_inputs(ids, limit=limit)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Embeddings] = loop.create_future()

        def on_end(result: Embeddings | None, error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed first (shutdown)
                loop.call_soon_threadsafe(_settle, done, result, error)

        return EmbedJob(request.request_id, ids, dimensions, self._clock(), on_end), done


def _settle(
    future: asyncio.Future[Embeddings], result: Embeddings | None, error: BaseException | None
) -> None:
    if future.done():
        return
    if result is not None:
        future.set_result(result)
        return
    if error is None:  # its job was cancelled before its pass: only a drain's abort does that
        error = DrainingError(EMBEDDING_ABORTED_MESSAGE)
    elif not isinstance(error, EngineError):  # the backend's own exception stays in the log (API-4)
        error = EmbeddingFailedError(EMBEDDING_FAILED_MESSAGE)
    future.set_exception(error)
    future.exception()  # retrieved: the caller may have stopped waiting
