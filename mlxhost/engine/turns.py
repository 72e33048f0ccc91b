"""`Turns`: one engine's live chat turns, and the use case that starts them (reserve, submit).

`submit` is two-phase (DESIGN.md): reserve a lane permit synchronously, do the async pre-work
under it (load, template, count), then hand the permit into the lane. Every refusal before the
first event raises, so the API answers with a proper status code. A `Turn` carries the request
from there to its end; this table keeps who is live, early cancels, and recently finished ids.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from mlxhost.engine.errors import (
    DrainingError,
    DuplicateRequestError,
    QueueFullError,
    RequestCancelledError,
    WrongModelKindError,
)
from mlxhost.engine.turn import Turn

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.config import EngineConfig
    from mlxhost.engine.generation import Generation
    from mlxhost.engine.prework import Prework
    from mlxhost.engine.registry import Registry
    from mlxhost.engine.stats import EngineStats, Key
    from mlxhost.engine.types import GenerationRequest

EARLY_CANCEL_LIMIT = 4096
FINISHED_IDS_LIMIT = 4096
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
        check_open: Callable[[], None],
        clock: Callable[[], float],
    ) -> None:
        self.registry = registry
        self.stats = stats
        self.config = config
        self.prework = prework
        self.live: dict[str, Turn] = {}  # chat turns from their submit to their end
        self._check_open = check_open
        self._clock = clock
        self._early_cancels: OrderedDict[str, float] = OrderedDict()
        self._finished_ids: OrderedDict[str, float] = OrderedDict()  # id -> remembered until

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
            self._check_open()
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
        if self.take_early_cancel(request_id):
            self.stats.outcome(key, "cancelled")
            raise RequestCancelledError(CANCELLED_MESSAGE)
        try:
            self._check_open()
            ticket = instance.lane.reserve(request_id)
        except (QueueFullError, DrainingError) as exc:
            self.stats.reject(key, exc.code)
            raise
        self.registry.lease(instance)  # an unbind while the permit waits defers teardown (REG-6)
        instance.touch()
        return Turn(self, instance, ticket, key)

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
        request_id = request.request_id
        if turn is None:
            turn = self.reserve(request_id, request.binding)
        elif turn.request_id != request_id:
            turn.release()
            raise ValueError(f"The permit is for {turn.request_id!r}, not {request_id!r}.")
        generation = turn.begin(request)
        try:
            if self.take_early_cancel(request_id):
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
        self._check_open()
        instance = self.registry.resolve(request.binding)
        if instance.spec.kind != "chat":
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
        _expire(self._finished_ids, self._clock())
        if request_id in self._finished_ids:
            return False
        self._early_cancels[request_id] = self._clock() + self.config.early_cancel_ttl_s
        while len(self._early_cancels) > EARLY_CANCEL_LIMIT:
            self._early_cancels.popitem(last=False)
        return False

    def track(self, turn: Turn) -> None:
        """`turn` took its permit on: it is live (it owns the permit's lease from here)."""
        self.live[turn.request_id] = turn

    def forget(self, turn: Turn) -> None:
        """`turn` ended: its id is remembered as finished, and its instance lease goes."""
        if self.live.get(turn.request_id) is not turn:
            return
        del self.live[turn.request_id]
        self._finished_ids[turn.request_id] = self._clock() + self.config.finished_ids_ttl_s
        self._finished_ids.move_to_end(turn.request_id)
        while len(self._finished_ids) > FINISHED_IDS_LIMIT:
            self._finished_ids.popitem(last=False)
        turn.instance.touch()  # the keep-alive counts from the last request's end (OPS-3)
        self.registry.unlease(turn.instance)

    def take_early_cancel(self, request_id: str) -> bool:
        _expire(self._early_cancels, self._clock())
        return self._early_cancels.pop(request_id, None) is not None

    def sweep(self) -> None:
        """Drop expired early cancels and finished ids."""
        self.take_early_cancel("")
        _expire(self._finished_ids, self._clock())


def _expire(remembered: OrderedDict[str, float], now: float) -> None:
    # Entries are kept in expiry order (each is appended with the same TTL).
    while remembered and next(iter(remembered.values())) < now:
        remembered.popitem(last=False)
