"""The turn service: one validated request of any surface -> an admitted generation, and its end.

Every generating surface (chat and text completions, Responses over HTTP and the WebSocket,
Anthropic messages and count_tokens) starts its turn here, so the pre-stream sequence is
written once: resolve the alias, build the model spec, take a lane permit, run the surface's
pre-work under it (LANE-3), build the `GenerationRequest`, submit, wait for admission (LANE-7/8).
Before all that the caller's key is checked against its limits (KEY-4), and every admitted turn
has its usage tallied when its terminal event is posted (KEY-2).
A surface that must record its result (Responses, PER-1) passes `TurnHooks`; the service hands
the result to `ended` before the terminal event reaches the encoder, never the encoder itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from mlxhost import request_log
from mlxhost.engine import (
    Delta,
    Done,
    Failed,
    Message,
    QueueFullError,
    QueueTimeoutError,
    RowGroup,
    Tool,
    ToolChoice,
    WrongModelKindError,
)
from mlxhost.engine import GenerationRequest as EngineRequest
from mlxhost.runtime.lifecycle import engine_if_started
from models_app.accounting import limits, usage
from models_app.accounting.limits import KeyLimits
from models_app.catalogue import lookups, specs
from models_app.catalogue.adapters import adapter_ref_for
from models_app.models import Model, ModelAlias
from models_app.turns.binding import engine_for
from models_app.turns.images import turn_images

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping

    from mlxhost.engine import Engine, Event, Generation, Permit
    from models_app.accounting.identity import KeyIdentity


@dataclass(frozen=True, slots=True)
class CacheScope:
    """What picks the warm session a turn may reuse (SES-2/3/8); only fingerprints are kept."""

    salt: str | None = None
    prompt_cache_key: str | None = None
    instructions: str = ""
    previous_response_id: str | None = None
    warm_any: bool = False  # any slot with the same instructions (clients that never name one)
    keep_on_disk: bool = False  # a stored response: its KV also goes to the disk tier


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One turn as a surface asks for it, validated and in the engine's terms."""

    model: str  # the alias name
    owner_id: int  # the caller's tenant: scopes warm sessions (SES-3)
    sampling: Mapping[str, Any]  # overrides in the engine's names (`api.sampling.SAMPLING_KEYS`)
    messages: tuple[Message, ...] = ()
    prompt: str | None = None  # a raw text completion instead of a chat template
    cache: CacheScope = field(default_factory=CacheScope)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    json_format: str | None = None  # None: text; "": any JSON object; else a JSON schema's text
    format_param: str = "response_format"  # the field that holds it, for errors
    continue_final: bool = False  # continue the last (assistant) message instead of answering it
    thinking: bool | None = None  # the request turns the template's thinking on or off (None: the alias's)
    effort: str | None = None  # the reasoning effort asked for, one of `specs.EFFORTS` (API-9)
    key: KeyIdentity | None = None  # the API key it counts against (None: a browser session)
    call_id_prefix: str = "call_"  # how the surface's provider starts tool call ids ("toolu_")
    prediction: str | None = None  # the client's predicted output (OpenAI Predicted Outputs)


@dataclass(frozen=True, slots=True)
class TurnResult:
    """How a turn ended, as `TurnHooks.ended` hears it."""

    text: str
    event: Done | Failed | None  # None: the listener stopped before the generation's end
    session_cache: str = ""  # the generation's session outcome (X-Session-Cache): hit, partial, ...


class TurnHooks:
    """A surface's steps around the shared sequence; the base does nothing.

    `prepare` runs under the lane permit and returns the turn to submit; `refused` runs when
    the turn fails in `prepare` (raised or cancelled part way: it gives back what prepare took so
    far) or after it (submit or the wait for a slot), and may run after a `prepare` that took
    nothing; `ended` runs exactly once
    when an admitted turn ends, and may return a handoff to await before the terminal event.
    """

    async def prepare(
        self, engine: Engine, alias: ModelAlias, permit: Permit, turn: TurnRequest
    ) -> TurnRequest:
        return turn

    def refused(self) -> None:
        return None

    def ended(self, result: TurnResult) -> asyncio.Future[None] | None:
        return None


@dataclass
class StartedTurn:
    """A turn the lane admitted: its identity, its generation, and its end hook."""

    request_id: str
    model: str  # the alias name, as the answer names it
    generation: Generation
    hooks: TurnHooks = field(default_factory=TurnHooks)
    # Every choice's generation, in order (OpenAI `n`); `generation` is the first one.
    generations: tuple[Generation, ...] = ()
    # When it started, to the microsecond: stored with its record, so turns of one second keep
    # their order (a conversation's newest tip, its branches); the API's `created` is whole seconds.
    started_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.generations = self.generations or (self.generation,)

    @property
    def created_at(self) -> int:
        return int(self.started_at)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Session-Cache": self.generation.session_outcome, "X-Request-Id": self.request_id}

    async def events(self) -> AsyncGenerator[Event, None]:
        """The generation's events. Before the terminal one is yielded, `hooks.ended` runs and its
        handoff is awaited (PER-1); a listener that stops early (closes this iterator) still gets
        the turn recorded, in the background, as cut short.
        """
        parts: list[str] = []
        ended = False
        try:
            async for event in self.generation.stream():
                if isinstance(event, Delta):
                    parts.append(event.text)
                elif isinstance(event, Done | Failed) and not ended:
                    ended = True
                    outcome = self.generation.session_outcome
                    await _handed_off(self.hooks.ended(TurnResult("".join(parts), event, outcome)))
                yield event
        finally:
            if not ended:
                self.hooks.ended(TurnResult("".join(parts), None))  # nobody is left to wait


def generation_request(
    alias: ModelAlias,
    turn: TurnRequest,
    request_id: str,
    engine: Engine,
    *,
    row: tuple[str, int, int] | None = None,
) -> EngineRequest:
    """The engine request of `turn` (every surface's one builder). No database access: the alias
    was resolved with its model, so this runs on the loop. It names the alias and carries its
    limits; which weights serve it is the engine's binding, which only control changes.
    `row` is (the request's id, this choice's index, the number of choices) when there are
    several: the choice's place in its group (`RowGroup`), from which the engine derives its seed."""
    cache = turn.cache
    rows = RowGroup(*row) if row is not None and row[2] > 1 else None
    # Vision aliases use no prefix cache yet (issue 29): their image tokens are placeholders.
    session = (
        None
        if alias.model.kind == Model.Kind.VISION
        else engine.scoper.query(
            tenant=str(turn.owner_id),
            salt=cache.salt,
            instructions=cache.instructions,
            previous_response_id=cache.previous_response_id,
            prompt_cache_key=cache.prompt_cache_key,
            warm_any=cache.warm_any,
            adapter=alias.adapter.fingerprint if alias.adapter is not None else "",  # KV per adapter
        )
    )
    return EngineRequest(
        request_id=request_id,
        binding=alias.name,
        sampling=specs.sampling_params_for(alias=alias, overrides=turn.sampling),
        messages=turn.messages,
        prompt=turn.prompt,
        session=session,
        max_input_tokens=alias.max_input_tokens,
        keep_on_disk=cache.keep_on_disk,
        tools=turn.tools,
        tool_choice=turn.tool_choice,
        json_format=turn.json_format,
        format_param=turn.format_param,
        template_options=specs.template_options_for(alias, thinking=turn.thinking, effort=turn.effort),
        continue_final=turn.continue_final,
        call_id_prefix=turn.call_id_prefix,
        max_draft=alias.speculation_max_k if alias.speculation else 0,
        prediction=turn.prediction,
        rows=rows,
        adapter=adapter_ref_for(alias),
    )


async def turn_start(
    turn: TurnRequest,
    *,
    request_id: str,
    hooks: TurnHooks | None = None,
    on_queued: Callable[[int], Awaitable[None]] | None = None,
    choices: int = 1,
) -> StartedTurn:
    """Start `turn`: resolve its alias, take a lane permit, run `hooks.prepare` under it, submit,
    and wait for a slot, so every refusal comes before any header or frame (LANE-7/8).

    `on_queued` hears each queue position while the turn waits (the WebSocket shows them);
    without it the wait is silent. A caller that gives up while it waits cancels the turn, or
    the waiter would later run its whole answer for nobody (LANE-6).

    `choices` > 1 (OpenAI `n`) starts that many rows of one prompt, each its own generation
    with a permit of its own, all taken before any is submitted (refused together), and a seed
    the engine derives for each (`RowGroup`); `StartedTurn.generations` holds them in order.

    Raises:
        RateLimitedError: the caller's key is over one of its limits (KEY-4).
        ModelAlias.DoesNotExist: no enabled alias has that name.
        EngineError: refused by the lane or the engine (429/503 via the error table).
        Exception: whatever `hooks.prepare` raises (the permit goes back first).
    """
    hooks = hooks or TurnHooks()
    key, owner_id = turn.key, turn.owner_id  # `prepare` may rebuild the turn
    await key_admit(key, owner_id=owner_id)
    alias = chat_alias(await lookups.alias_resolve(turn.model))
    # Images: refused for a text model, else decoded (issue 29).
    turn = replace(turn, messages=await turn_images(alias, turn.messages))
    engine = await engine_for(alias.name)
    # Grammars first, holding nothing: a slow schema never takes a place in the lane (API-7).
    if turn.tools or turn.json_format is not None:
        await engine.check_answer(generation_request(alias, turn, request_id, engine))
    ids = [choice_id(request_id, index) for index in range(choices)]
    with overload_counted(key, owner_id=owner_id):
        permits = _reserve_all(engine, ids, alias.name)
    try:
        turn = await hooks.prepare(engine, alias, permits[0], turn)
        requests = [
            generation_request(alias, turn, row_id, engine, row=(request_id, index, choices))
            for index, row_id in enumerate(ids)
        ]
    except BaseException:
        for permit in permits:
            permit.release()  # idempotent; the place goes back to the lane (LANE-3)
        hooks.refused()  # and what prepare took before it failed or was cancelled (REG-6)
        raise
    generations: list[Generation] = []
    try:
        with overload_counted(key, owner_id=owner_id):
            await _submit_all(engine, requests, permits, generations, key, owner_id)
            for generation in generations:
                await _admitted(generation, on_queued)
    except BaseException:
        for generation in generations:
            generation.cancel()
        hooks.refused()
        raise
    # The request's log line (OPS-6) names the turn: its alias, model and how it ended.
    request_log.note_turn(
        request_id=request_id, alias=alias.name, model=alias.model.name, generation=generations[0]
    )
    return StartedTurn(request_id, alias.name, generations[0], hooks, generations=tuple(generations))


def choice_id(request_id: str, index: int) -> str:
    """The engine's id of a request's choice `index`: the request's own for the first one."""
    return request_id if index == 0 else f"{request_id}-{index}"


def _reserve_all(engine: Engine, ids: list[str], binding: str) -> list[Permit]:
    """A permit for each id, or none: a lane that cannot take them all refuses the request."""
    permits: list[Permit] = []
    try:
        for request_id in ids:
            permits.append(engine.reserve(request_id, binding))
    except BaseException:
        for permit in permits:
            permit.release()
        raise
    return permits


async def _submit_all(
    engine: Engine,
    requests: list[EngineRequest],
    permits: list[Permit],
    generations: list[Generation],
    key: KeyIdentity | None,
    owner_id: int,
) -> None:
    """Submit every row, the first one alone first (it reaches the worker first and prefills the
    prompt the others share); each generation joins `generations` as soon as it exists, so the
    caller can cancel every one a failure leaves running."""
    key_id = key.key_id if key is not None else None

    async def submit(index: int) -> None:
        try:
            generation = await engine.submit(requests[index], permits[index])
        except BaseException:
            for permit in permits[index + 1 :] if index == 0 else ():
                permit.release()  # the rows never submitted give their places back
            raise
        generations.append(generation)
        # Tallied as the Done is posted, read or not: a client that hangs up still used tokens.
        # The prompt and the request count once, with the first choice (KEY-2).
        generation.add_end_listener(
            partial(usage.recorder().turn_ended, owner_id=owner_id, key_id=key_id, choice=index)
        )

    await submit(0)
    if len(requests) > 1:
        results = await asyncio.gather(*(submit(i) for i in range(1, len(requests))), return_exceptions=True)
        order = {request.request_id: index for index, request in enumerate(requests)}
        generations.sort(key=lambda generation: order[generation.request_id])
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise errors[0]


async def turn_refuse_if_full(model: object, key: KeyIdentity | None = None, *, owner_id: int = 0) -> None:
    """Refuse a turn for the alias named `model` when its lane has no room now (LANE-2).

    Surfaces call this before they validate the body: a request over a full lane's budget
    is refused at the cost of cached lookups, never a serializer run or a prompt render, so a
    burst's refusals stay fast. It takes no place; `turn_start` checks the lane again.
    Anything else (no such alias, an embedding model, nothing loaded yet) is left to the
    full path, which answers it in order. A refusal counts as `overloaded` for `key` (KEY-2).

    Raises:
        QueueFullError: the lane is over its budget.
        DrainingError: the lane or the engine is draining.
    """
    engine = engine_if_started()
    if not isinstance(model, str) or engine is None:
        return
    try:
        alias = await lookups.alias_resolve(model)
    except ModelAlias.DoesNotExist:
        return
    if alias.model.kind in Model.GENERATING_KINDS:
        with overload_counted(key, owner_id=owner_id):
            engine.refuse_if_full(alias.name)


async def turn_count_tokens(turn: TurnRequest) -> int:
    """The prompt tokens `turn` would feed its model, without generating or queueing (API-2).

    A count is held to the key's requests per minute in a window of its own (an agent that
    counts before each turn keeps its turns), never to the day's tokens (it uses none); it is
    tallied as a count, not a request (KEY-2, KEY-4).

    Raises:
        RateLimitedError: the key made as many counts as its requests-per-minute limit allows.
        ModelAlias.DoesNotExist: no enabled alias has that name.
        ModelLoadError: the model could not be loaded.
    """
    await key_admit(turn.key, owner_id=turn.owner_id, window="counts")
    alias = chat_alias(await lookups.alias_resolve(turn.model))
    turn = replace(turn, messages=await turn_images(alias, turn.messages))
    engine = await engine_for(alias.name)
    count = await engine.count_tokens(generation_request(alias, turn, "count", engine))
    usage.recorder().counted(owner_id=turn.owner_id, key_id=turn.key.key_id if turn.key else None)
    return count


async def key_admit(key: KeyIdentity | None, *, owner_id: int, window: limits.Window = "requests") -> None:
    """Count one request of `key` against its limits (KEY-4); a refusal is tallied for the key.

    `window` "counts" (count_tokens) checks only the requests per minute, in a log of its own.

    Raises:
        RateLimitedError: over a limit.
    """
    if key is None:
        return
    held = key.limits if window == "requests" else KeyLimits(key.limits.requests_per_minute)
    if not held.any:
        return
    try:
        await limits.limiter().admit(key.key_id, held, window=window)
    except limits.RateLimitedError:
        usage.recorder().refused("rate_limited", owner_id=owner_id, key_id=key.key_id)
        raise


@contextlib.contextmanager
def overload_counted(key: KeyIdentity | None, *, owner_id: int) -> Iterator[None]:
    """Tally a refusal by a busy model (a full queue, a queue timeout) for `key` (KEY-2)."""
    try:
        yield
    except (QueueFullError, QueueTimeoutError):
        usage.recorder().refused("overloaded", owner_id=owner_id, key_id=key.key_id if key else None)
        raise


def chat_alias(alias: ModelAlias) -> ModelAlias:
    """`alias`, when it names a chat model: every generating surface refuses an embedding model
    with a 400 that says where to send it, before it takes a lane permit (API-13).

    Raises:
        WrongModelKindError: the alias names an embedding model.
    """
    if alias.model.kind not in Model.GENERATING_KINDS:
        raise WrongModelKindError.embedding_on_chat(alias.name)
    return alias


async def _admitted(generation: Generation, on_queued: Callable[[int], Awaitable[None]] | None) -> None:
    if on_queued is None:
        await generation.admitted()
        return
    async for position in generation.queue_positions():
        await on_queued(position)


async def _handed_off(handoff: asyncio.Future[None] | None) -> None:
    # The handoff never raises (failures are logged and left to the breaker); a cancelled waiter
    # leaves the shielded write running.
    if handoff is not None:
        await handoff
