"""`Turns`: one engine's live chat turns, and the use case that starts them (reserve, submit).

`submit` is two-phase (DESIGN.md): reserve a lane permit synchronously, do the async pre-work
under it (load, template, count), then hand the permit into the lane. Every refusal before the
first event raises, so the API answers with a proper status code. A `Turn` carries the request
from there to its end; the `Ledger` keeps who is live, early cancels, and recently finished ids.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mlxhost.engine.errors import (
    DrainingError,
    DuplicateRequestError,
    QueueFullError,
    RequestCancelledError,
    WrongModelKindError,
)
from mlxhost.engine.images import request_images
from mlxhost.engine.turn import Ledger, Turn
from mlxhost.engine.types import GENERATING_KINDS

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.config import EngineConfig
    from mlxhost.engine.generation import Generation
    from mlxhost.engine.prework import Prework
    from mlxhost.engine.registry import Registry
    from mlxhost.engine.stats import EngineStats, Key
    from mlxhost.engine.types import GenerationRequest

SHUTDOWN_MESSAGE = "The server is shutting down; retry shortly."
CANCELLED_MESSAGE = "The request was cancelled before it started."


class Turns:
    """The turns of one engine, by request id: reserve, submit, cancel (LANE-2/3/5/6)."""

    def __init__(
        self,
        registry: Registry,
        stats: EngineStats,
        config: EngineConfig,
        prework: Prework,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.registry = registry
        self.stats = stats
        self.config = config
        self.prework = prework
        self.ledger = Ledger(
            finished_ttl_s=config.finished_ids_ttl_s,
            early_cancel_ttl_s=config.early_cancel_ttl_s,
            clock=clock,
        )
        self._clock = clock
        self._closing = False  # shutdown began: arrivals are refused as draining (LANE-7)

    @property
    def live(self) -> dict[str, Turn]:
        """The live chat turns by request id, from their submit to their end (the ledger's)."""
        return self.ledger.live

    def check_open(self) -> None:
        """Refuse new work once shutdown began (`close`).

        Raises:
            DrainingError: shut down or still draining, a client hears the same: this host is
                going away, retry (503 `draining`, Anthropic 529), never a bare "engine closed"
                (LANE-7, OPS-5).
        """
        if self._closing:
            raise DrainingError(SHUTDOWN_MESSAGE)

    def close(self) -> None:
        """Shutdown began: from now every reserve, count and bind is refused (`check_open`)."""
        self._closing = True

    def refuse_if_full(self, binding: str) -> None:
        """Refuse a new request for `binding` now when `reserve` would, taking nothing: a
        surface calls this before it validates a body or renders a prompt, so a burst over the
        lane's budget is refused at the cost of a lookup (LANE-2). Counted as `reserve` counts
        its refusals. Nothing bound under `binding`: no refusal here (`reserve` will say why).

        Raises:
            QueueFullError: the lane is over budget (LANE-2).
            DrainingError: the lane or the engine is draining (LANE-7).
            EngineClosedError: the engine has shut down.
        """
        instance = self.registry.bound(binding)
        if instance is None:
            return
        try:
            self.check_open()
            instance.lane.refuse_if_full()
        except (QueueFullError, DrainingError) as exc:
            self.stats.reject((binding, instance.instance_id), exc.code)
            raise

    def reserve(self, request_id: str, binding: str) -> Turn:
        """Take a lane permit on the instance bound to `binding` before a request's async
        pre-work (LANE-3): a `Turn` in its reserved state. Resolves the name only: it never
        binds, swaps or updates settings. A cancel that arrived first wins over a full lane:
        the caller hears "cancelled", not 429 (LANE-6).

        Raises:
            UnknownModelError: nothing is bound under `binding`.
            RequestCancelledError: a cancel for this id arrived first (LANE-6).
            DuplicateRequestError: a request with this id is live (LANE-5).
            QueueFullError: the lane is over budget (LANE-2).
            DrainingError: the lane is draining (LANE-7), or the engine has shut down.
        """
        if request_id in self.live:
            raise DuplicateRequestError(f"A request with id {request_id!r} is already in flight.")
        instance = self.registry.resolve(binding)
        key: Key = (binding, instance.instance_id)
        if self.ledger.take_early_cancel(request_id):
            self.stats.outcome(key, "cancelled")
            raise RequestCancelledError(CANCELLED_MESSAGE)
        try:
            self.check_open()
            ticket = instance.lane.reserve(request_id)
        except (QueueFullError, DrainingError) as exc:
            self.stats.reject(key, exc.code)
            raise
        self.registry.lease(instance)  # an unbind while the permit waits defers teardown (REG-6)
        instance.touch()
        return Turn(self.ledger, self.registry, self.stats, instance, ticket, key)

    async def submit(self, request: GenerationRequest, turn: Turn | None = None) -> Generation:
        """Admit `request`: reserve (or take `turn`), load if needed, render and count the
        prompt, enter the lane. A given turn is consumed, also when this raises.

        Raises:
            QueueFullError: the lane is over budget (LANE-2); nothing was rendered.
            DrainingError: the lane is draining (LANE-7).
            DuplicateRequestError: a request with this id is live (LANE-5).
            RequestCancelledError: a cancel for this id arrived first (LANE-6).
            WrongModelKindError: the name is bound to an embedding model.
            ModelLoadError: the model could not be loaded.
            InvalidRequestError: a sampling value this model cannot use (before templating).
            PromptTooLongError: the prompt exceeds the model's context or max_input_tokens.
            RequestTooLargeError: its KV cache could not fit the memory budget.
        """
        if request.session is not None and request_images(request.messages):
            # A prompt with images never uses or fills the prefix cache: its image tokens are
            # placeholders, the same for every image, so a cached prefix could hold another's.
            request = replace(request, session=None, keep_on_disk=False)
        request_id = request.request_id
        if turn is None:
            turn = self.reserve(request_id, request.binding)
        elif turn.request_id != request_id:
            turn.release()
            raise ValueError(f"The permit is for {turn.request_id!r}, not {request_id!r}.")
        generation = turn.begin(request)
        try:
            if self.ledger.take_early_cancel(request_id):
                raise RequestCancelledError(CANCELLED_MESSAGE)
            prepared = await self.prework.prepare(turn.instance, request)
            generation.reader = prepared.reader
            if generation.cancelled:
                raise RequestCancelledError(CANCELLED_MESSAGE)
            turn.enter(prepared, self._clock())
        except BaseException as exc:
            turn.abandon(exc)
            raise
        return generation

    async def count_tokens(self, request: GenerationRequest) -> int:
        """The number of prompt tokens `request` would feed its model (Anthropic `count_tokens`).

        Resolves, loads if needed and renders like `submit`, but a count is not a generation:
        it never enters the lane, so a full queue does not refuse it (LANE-2), and it is not
        held to `max_input_tokens`.

        Raises:
            UnknownModelError: nothing is bound under `request.binding`.
            ModelLoadError: the model could not be loaded.
            PromptTooLongError: the prompt's text has more characters than the context could hold.
            DrainingError: the engine is shutting down.
        """
        self.check_open()
        instance = self.registry.resolve(request.binding)
        if instance.spec.kind not in GENERATING_KINDS:
            raise WrongModelKindError.embedding_on_chat(request.binding)
        self.registry.lease(instance)  # an unbind while the count renders defers teardown (REG-6)
        try:
            return await self.prework.count(instance, request)
        finally:
            self.registry.unlease(instance)

    def cancel(self, request_id: str) -> bool:
        """Cancel a live turn; an unknown id is remembered for its arrival (LANE-6), unless it
        finished recently (that cancel came late, and must not cancel a reuse of the id)."""
        turn = self.live.get(request_id)
        if turn is not None and turn.generation is not None:
            turn.generation.cancel()
            return True
        if not self.ledger.finished_lately(request_id):
            self.ledger.cancel_early(request_id)
        return False

    def sweep(self) -> None:
        """Drop expired early cancels and finished ids."""
        self.ledger.sweep()
