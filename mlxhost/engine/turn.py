"""A `Turn`: one request's life in the engine, from its lane permit to its terminal event.

A turn owns the request's lane ticket, its registry lease on the instance (REG-6), its
generation and its prefix-cache lease, and moves through explicit states:

    reserved ──► preparing ──► queued ──► running ──► ended
        └─────────────┴───────────┴──────────────────────┘ (released, refused, failed, cancelled)

`reserved` is what callers hold as a permit (LANE-3): `release()` gives the place back.
`preparing` runs the pre-work (`prework.Prework`), `queued` waits in the lane, `running` is
on the worker: the lane admitted it and ran its `prework.Start`, and the job's result comes back
to the loop, never through turn code on the worker. Every way out goes through `end`, which does
the ordered work in one place. `Ledger` is the engine's table of request ids that turns enter at
`begin` and leave at `end`; `Turns` reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, cast

from mlxhost.engine.errors import (
    DrainingError,
    ImagesNotSupportedError,
    ModelLoadError,
    RequestCancelledError,
    WrongModelKindError,
)
from mlxhost.engine.generation import Generation
from mlxhost.engine.images import request_images
from mlxhost.engine.lane import TicketHooks
from mlxhost.engine.prework import Start, dispatch_on_admit
from mlxhost.engine.stats import REJECTIONS
from mlxhost.engine.types import GENERATING_KINDS, Done, Failed, Timings, Usage
from mlxhost.engine.worker import WriteJob

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.backends.base import LoadedModel
    from mlxhost.engine.embeddings import EmbedJob
    from mlxhost.engine.instance import Instance
    from mlxhost.engine.lane import Ticket
    from mlxhost.engine.prework import Prepared
    from mlxhost.engine.registry import Registry
    from mlxhost.engine.sessions import SessionQuery
    from mlxhost.engine.stats import EngineStats, Key
    from mlxhost.engine.types import GenerationRequest
    from mlxhost.engine.worker import JobResult

TurnState = Literal["reserved", "preparing", "queued", "running", "ended"]
# Turns whose cache becomes a warm session (SES-1): `kv_tokens` lists exactly what it holds.
KEPT_FINISHES = frozenset({"stop", "length", "cancelled"})
EARLY_CANCEL_LIMIT = 4096
FINISHED_IDS_LIMIT = 4096


class Ledger:
    """The engine's request ids: its live chat turns (LANE-5), the ids that ended lately (a late
    cancel must not cancel a reuse of the id) and the cancels that arrived first (LANE-6).

    Turns enter it when they take their permit on and leave it at their end; `Turns` reads it.
    """

    def __init__(
        self, *, finished_ttl_s: float, early_cancel_ttl_s: float, clock: Callable[[], float]
    ) -> None:
        self.live: dict[str, Turn] = {}  # chat turns from their submit to their end
        self._finished_ttl_s = finished_ttl_s
        self._early_cancel_ttl_s = early_cancel_ttl_s
        self._clock = clock
        self._early_cancels: OrderedDict[str, float] = OrderedDict()
        self._finished_ids: OrderedDict[str, float] = OrderedDict()  # id -> remembered until

    def enter(self, turn: Turn) -> None:
        """`turn` took its permit on: it is live (it owns the permit's lease from here)."""
        self.live[turn.request_id] = turn

    def leave(self, turn: Turn) -> bool:
        """`turn` ended: its id is remembered as finished. False: it was not the live one."""
        if self.live.get(turn.request_id) is not turn:
            return False
        del self.live[turn.request_id]
        self._finished_ids[turn.request_id] = self._clock() + self._finished_ttl_s
        self._finished_ids.move_to_end(turn.request_id)
        while len(self._finished_ids) > FINISHED_IDS_LIMIT:
            self._finished_ids.popitem(last=False)
        return True

    def finished_lately(self, request_id: str) -> bool:
        _expire(self._finished_ids, self._clock())
        return request_id in self._finished_ids

    def cancel_early(self, request_id: str) -> None:
        """Remember a cancel for an id not live yet, for its arrival (LANE-6)."""
        self._early_cancels[request_id] = self._clock() + self._early_cancel_ttl_s
        while len(self._early_cancels) > EARLY_CANCEL_LIMIT:
            self._early_cancels.popitem(last=False)

    def take_early_cancel(self, request_id: str) -> bool:
        _expire(self._early_cancels, self._clock())
        return self._early_cancels.pop(request_id, None) is not None

    def sweep(self) -> None:
        """Drop expired early cancels and finished ids."""
        self.take_early_cancel("")
        _expire(self._finished_ids, self._clock())


class Turn:
    """One request in one instance's lane; see the module's docstring for its states.

    The public face of a reserved turn is a permit's: `request_id`, `instance_id`, `held` and
    `release()`; `Engine.submit` (or `Engine.embed`) takes it on from there.
    """

    def __init__(
        self,
        ledger: Ledger,
        registry: Registry,
        stats: EngineStats,
        instance: Instance,
        ticket: Ticket,
        key: Key,
    ) -> None:
        self.request_id = ticket.request_id
        self.instance_id = instance.instance_id
        self.instance = instance
        self.ticket = ticket
        self.key = key  # what its counters are kept under: (binding, instance id)
        self.generation: Generation | None = None
        self._state: TurnState = "reserved"
        self._ledger = ledger
        self._registry = registry
        self._stats = stats
        self._start: Start | None = None  # a chat turn's admission, set when it enters the lane
        self._terminal: Done | Failed | None = None  # a worker's Failed, held until its job ends
        self._prompt_tokens: int | None = None  # what its kept session's prompt was (SES-1)
        self._released = False
        self._posted = False

    @property
    def state(self) -> TurnState:
        if self._state == "queued" and self.ticket.state == "active":
            return "running"  # the lane admitted it and ran its start
        return self._state

    @property
    def aborted(self) -> bool:
        """Whether the server cut it short (drain timeout, shutdown), not the client."""
        return self._start is not None and self._start.aborted

    @property
    def held(self) -> bool:
        """Whether it is still a reserved permit, neither taken on nor released."""
        return self.state == "reserved"

    def release(self) -> None:
        """Give the reserved place back (a bail-out before submit); a no-op once taken or released."""
        if self._state != "reserved":
            return
        self._state, self._released = "ended", True
        self.instance.lane.release(self.ticket)
        self._registry.unlease(self.instance)

    def claim(self) -> None:
        """reserved → preparing, for the one caller that takes the permit on.

        Raises:
            RuntimeError: it was already taken on or released.
        """
        if self._state != "reserved":
            taken = "released" if self._released else "submitted"
            raise RuntimeError(f"The permit for {self.request_id!r} was already {taken}.")
        self._state = "preparing"

    def begin(self, request: GenerationRequest) -> Generation:
        """Take the permit on for a chat request: its generation, live in the engine from here.

        Raises:
            RuntimeError: the permit was already taken on or released.
            WrongModelKindError: the instance is an embedding model (the place goes back).
            ImagesNotSupportedError: the request has images and the model is not a vision model.
        """
        self.claim()
        kind = self.instance.spec.kind
        images = kind != "vision" and bool(request_images(request.messages))
        if kind not in GENERATING_KINDS or images:
            self._state = "ended"
            self.instance.lane.release(self.ticket)
            self._registry.unlease(self.instance)
            if images:  # the service refuses these first; a rebinding between the two lands here
                raise ImagesNotSupportedError(request.binding, kind)
            raise WrongModelKindError.embedding_on_chat(request.binding)
        generation = Generation(request, asyncio.get_running_loop())
        generation.instance_id = self.instance_id
        generation.end_through(self._terminal_posted)
        self.generation = generation
        self._ledger.enter(self)
        return generation

    def enter(self, prepared: Prepared, entered_at: float) -> None:
        """preparing → queued: hand the ticket into the lane; its admission runs the turn's
        `Start` (→ running), whose job's result the worker hands to the loop (`_job_ended`)."""
        generation, instance = self._generation(), self.instance
        self._state = "queued"
        on_end = _on_loop(asyncio.get_running_loop(), self._job_ended)
        start = self._start = Start(instance, generation, prepared, entered_at, on_end)
        hooks = TicketHooks(on_admit=start.admitted, on_position=generation.queued, on_abort=start.abort)
        generation.on_cancel(functools.partial(instance.lane.cancel, self.request_id))
        self.ticket.admitted.add_done_callback(self._left_queue)
        instance.lane.enter(self.ticket, hooks)

    def enter_embedding(self, job: EmbedJob) -> None:
        """preparing → queued for an embedding: its job joins the worker's next pass once admitted."""
        self._state = "queued"
        hooks = TicketHooks(on_admit=dispatch_on_admit(self.instance, job), on_abort=job.cancel)
        self.instance.lane.enter(self.ticket, hooks)

    def end_embedding(self) -> None:
        """An embedding's end, however it went: the slot, the lease, the keep-alive (OPS-3)."""
        self._state = "ended"
        self.instance.lane.release(self.ticket)
        self._registry.unlease(self.instance)
        self.instance.touch()

    def abandon(self, error: BaseException) -> None:
        """The pre-work failed or was cancelled, and submit raises `error`: count why, then end."""
        stats = self._stats
        if isinstance(error, RequestCancelledError | asyncio.CancelledError):
            stats.outcome(self.key, "cancelled")
        elif isinstance(error, DrainingError):
            stats.reject(self.key, error.code)
        elif isinstance(error, ModelLoadError):
            stats.outcome(self.key, "failed")
        self.end(None)

    def end(self, event: Done | Failed | None, result: JobResult | None = None) -> None:
        """End the turn, once, in this order:

        1. count it in the engine's stats (OPS-1);
        2. keep its KV (SES-1): release its session lease, adopt the cache as a warm session (and
           queue its write to the disk tier) or discard it, before the slot goes: releasing admits
           the next waiter at once, and a continuation queued behind its parent must find it;
        3. release its lane slot, then leave the ledger (the id is remembered as finished, the
           keep-alive counts from here, the registry lease goes);
        4. post the terminal event: the generation tells its end listeners (usage accounting),
           then queues it for the reader. Only now, so a client that sends its next request the
           moment it has this answer finds the slot free (API-3). The reader then runs the
           surface's `TurnHooks.ended` (the persist hand-off, awaited) before the encoder sees
           it, and the request log reads `Generation.result`.

        `event` None: nothing to post (a failed pre-work raises instead).
        """
        if self._state == "ended":  # never expected; what arrives late is still handed on
            if result is not None:
                self._keep(result)
            if event is not None and not self._posted:
                self._post(event)
            return
        self._state = "ended"
        if event is not None:
            event = self._as_posted(event)
            self._count(event)
        if result is not None:
            self._keep(result)
        self.instance.lane.release(self.ticket)
        if self._ledger.leave(self):
            self.instance.touch()  # the keep-alive counts from the last request's end (OPS-3)
            self._registry.unlease(self.instance)
        if event is not None:
            self._post(event)

    # The steps, in the order they run ------------------------------------------------------

    def _left_queue(self, future: asyncio.Future[None]) -> None:
        if future.cancelled() or future.exception() is None:
            return  # admitted (it runs from on_admit), or released by submit's cleanup
        error = future.exception()
        assert isinstance(error, Exception), error  # the lane fails tickets with EngineErrors
        if isinstance(error, RequestCancelledError):
            self.end(_cancelled_done())
        else:
            code, retry_after = getattr(error, "code", "engine_error"), getattr(error, "retry_after", None)
            self.end(Failed(code=code, message=str(error), retry_after=retry_after))
        self._generation().refuse(error)

    def _terminal_posted(self, event: Done | Failed) -> None:
        """A terminal event posted to the generation: a worker's Failed waits for its job's end."""
        if self.state == "running":
            self._terminal = event
        else:
            self.end(event)

    def _job_ended(self, result: JobResult) -> None:
        """The worker's result, on the loop: the job's Done travels with its end (not ahead of it
        by the courier), so the slot is free before the client reads it (see `end`)."""
        start = self._start
        assert start is not None and start.job is not None, "a job ends only after its start"
        self._prompt_tokens = len(start.prepared.prompt_ids)
        done = start.job.done
        self.end(done if done is not None else self._terminal, result)

    def _as_posted(self, event: Done | Failed) -> Done | Failed:
        if isinstance(event, Done) and event.finish_reason == "cancelled" and self.aborted:
            # The worker only sees its stop flag; a server abort must not read like a client's
            # cancel, let alone a complete answer (the surfaces map "aborted" to an error).
            return replace(event, finish_reason="aborted")
        return event

    def _count(self, event: Done | Failed) -> None:
        stats = self._stats
        if isinstance(event, Done):
            stats.finished(self.key, event)
            adapter = self.generation.request.adapter if self.generation is not None else None
            if adapter is not None:  # counted per adapter too (issue 28)
                stats.adapter_finished((adapter.name, self.instance_id), event)
        elif event.code in REJECTIONS:
            stats.reject(self.key, event.code)  # left the queue without running (LANE-7/8)
        else:
            stats.outcome(self.key, "failed")

    def _keep(self, result: JobResult) -> None:
        instance, generation, start = self.instance, self._generation(), self._start
        if start is not None and start.lease is not None:
            instance.sessions.release(start.lease, consumed=result.touched)
            start.lease = None
        if result.kv is None:
            return
        query = generation.request.session
        # What the cache holds is kept (SES-1): a turn that finished, was cut by its length or
        # was cancelled, up to the tokens it produced; never a failed or aborted one.
        if query is None or result.finish_reason not in KEPT_FINISHES or self.aborted:
            instance.sessions.discard(result.kv)
            return
        kept = instance.sessions.adopt(
            response_id=self.request_id,
            query=query,
            tokens=result.kv_tokens,
            kv=result.kv,
            nbytes=result.kv_nbytes,
            prompt_tokens=self._prompt_tokens,
        )
        if kept and generation.request.keep_on_disk:
            write_behind(instance, self.request_id, query)

    def _post(self, event: Done | Failed) -> None:
        self._posted = True
        generation = self._generation()
        generation.end_through(None)  # its end ran: the generation posts it, listeners first
        generation.post(event)

    def _generation(self) -> Generation:
        assert self.generation is not None, "a chat turn's generation is set by begin()"
        return self.generation


def write_behind(instance: Instance, response_id: str, query: SessionQuery) -> None:
    """Save a stored turn's kept KV to the disk tier, from the worker when it is idle; the
    entry stays pinned (its kv alive even if evicted) until the write is done."""
    disk, entry = instance.disk, instance.sessions.entry(response_id)
    if disk is None or entry is None or not instance.sessions.copies:
        return  # a single-use cache's kv may be reused in place before the write runs
    sessions, loop = instance.sessions, asyncio.get_running_loop()
    sessions.pin(entry)

    def write(model: LoadedModel) -> None:
        disk.save(response_id, query, entry.tokens, lambda path: model.save_cache(entry.kv, path))

    def done() -> None:
        # RuntimeError: the loop closed first (shutdown), and the process frees it anyway.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(sessions.unpin, entry)

    instance.write_behind(WriteJob(write, urgent=lambda: not entry.cached, done=done))


def _on_loop(
    loop: asyncio.AbstractEventLoop, receiver: Callable[[JobResult], None]
) -> Callable[[JobResult], None]:
    """`receiver`, run on `loop` whichever thread calls the result: asyncio's thread-safe call
    bound to it, so the worker runs no turn code (the turn runs from the loop)."""
    post: Callable[..., object] = loop.call_soon_threadsafe
    return cast("Callable[[JobResult], None]", functools.partial(post, receiver))


def _cancelled_done() -> Done:
    return Done(finish_reason="cancelled", usage=Usage(0, 0), timings=Timings(0.0, 0.0, 0.0, 0.0))


def _expire(remembered: OrderedDict[str, float], now: float) -> None:
    # Entries are kept in expiry order (each is appended with the same TTL).
    while remembered and next(iter(remembered.values())) < now:
        remembered.popitem(last=False)
