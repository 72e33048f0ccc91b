"""A `Turn`: one request's life in the engine, from its lane permit to its terminal event.

A turn owns the request's lane ticket, its registry lease on the instance (REG-6), its
generation and its prefix-cache lease, and moves through explicit states:

    reserved ──► preparing ──► queued ──► running ──► ended
        └─────────────┴───────────┴──────────────────────┘ (released, refused, failed, cancelled)

`reserved` is what callers hold as a permit (LANE-3): `release()` gives the place back.
`preparing` runs the pre-work (`prework.Prework`), `queued` waits in the lane, `running` is
on the worker. Every way out goes through `end`, which does the ordered work in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

from mlxhost.engine.errors import (
    DrainingError,
    ModelLoadError,
    RequestCancelledError,
    WrongModelKindError,
)
from mlxhost.engine.generation import Generation
from mlxhost.engine.lane import TicketHooks
from mlxhost.engine.stats import REJECTIONS
from mlxhost.engine.types import Done, Failed, Timings, Usage
from mlxhost.engine.worker import GenerateJob, JobResult, WriteJob

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import LoadedModel
    from mlxhost.engine.disk import DiskEntry
    from mlxhost.engine.embeddings import EmbedJob
    from mlxhost.engine.instance import Instance
    from mlxhost.engine.lane import Ticket
    from mlxhost.engine.prework import Prepared
    from mlxhost.engine.sessions import SessionLease, SessionQuery
    from mlxhost.engine.stats import Key
    from mlxhost.engine.turns import Turns
    from mlxhost.engine.types import GenerationRequest

TurnState = Literal["reserved", "preparing", "queued", "running", "ended"]
# Turns whose cache becomes a warm session (SES-1): `kv_tokens` lists exactly what it holds.
KEPT_FINISHES = frozenset({"stop", "length", "cancelled"})


class Turn:
    """One request in one instance's lane; see the module's docstring for its states.

    The public face of a reserved turn is a permit's: `request_id`, `instance_id`, `held` and
    `release()`; `Engine.submit` (or `Engine.embed`) takes it on from there.
    """

    def __init__(self, turns: Turns, instance: Instance, ticket: Ticket, key: Key) -> None:
        self.request_id = ticket.request_id
        self.instance_id = instance.instance_id
        self.instance = instance
        self.ticket = ticket
        self.key = key  # what its counters are kept under: (binding, instance id)
        self.state: TurnState = "reserved"
        self.generation: Generation | None = None
        self.aborted = False  # the server cut it short (drain timeout, shutdown), not the client
        self._turns = turns
        self._lease: SessionLease | None = None
        self._terminal: Done | Failed | None = None  # a worker's Failed, held until its job ends
        self._prompt_tokens: int | None = None  # what its kept session's prompt was (SES-1)
        self._released = False
        self._posted = False

    @property
    def held(self) -> bool:
        """Whether it is still a reserved permit, neither taken on nor released."""
        return self.state == "reserved"

    def release(self) -> None:
        """Give the reserved place back (a bail-out before submit); a no-op once taken or released."""
        if self.state != "reserved":
            return
        self.state, self._released = "ended", True
        self.instance.lane.release(self.ticket)
        self._turns.registry.unlease(self.instance)

    def claim(self) -> None:
        """reserved → preparing, for the one caller that takes the permit on.

        Raises:
            RuntimeError: it was already taken on or released.
        """
        if self.state != "reserved":
            taken = "released" if self._released else "submitted"
            raise RuntimeError(f"The permit for {self.request_id!r} was already {taken}.")
        self.state = "preparing"

    def begin(self, request: GenerationRequest) -> Generation:
        """Take the permit on for a chat request: its generation, live in the engine from here.

        Raises:
            RuntimeError: the permit was already taken on or released.
            WrongModelKindError: the instance is an embedding model (the place goes back).
        """
        self.claim()
        if self.instance.spec.kind != "chat":
            self.state = "ended"
            self.instance.lane.release(self.ticket)
            self._turns.registry.unlease(self.instance)
            raise WrongModelKindError.embedding_on_chat(request.binding)
        generation = Generation(request, asyncio.get_running_loop())
        generation.instance_id = self.instance_id
        generation.end_through(self._terminal_posted)
        self.generation = generation
        self._turns.track(self)
        return generation

    def enter(self, prepared: Prepared, entered_at: float) -> None:
        """preparing → queued: hand the ticket into the lane; admission runs it (→ running)."""
        generation, instance = self._generation(), self.instance
        self.state = "queued"
        hooks = TicketHooks(
            on_admit=lambda _t: self._run(prepared, entered_at),
            on_position=generation.queued,
            on_abort=self.abort,
        )

        def cancel() -> None:
            instance.lane.cancel(self.request_id)

        generation.on_cancel(cancel)
        self.ticket.admitted.add_done_callback(self._left_queue)
        instance.lane.enter(self.ticket, hooks)

    def enter_embedding(self, job: EmbedJob) -> None:
        """preparing → queued for an embedding: its job joins the worker's next pass once admitted."""
        self.state = "queued"

        def admit(_ticket: Ticket) -> None:
            self.state = "running"
            self.instance.dispatch(job)

        self.instance.lane.enter(self.ticket, TicketHooks(on_admit=admit, on_abort=job.cancel))

    def end_embedding(self) -> None:
        """An embedding's end, however it went: the slot, the lease, the keep-alive (OPS-3)."""
        self.state = "ended"
        self.instance.lane.release(self.ticket)
        self._turns.registry.unlease(self.instance)
        self.instance.touch()

    def abort(self) -> None:
        """The lane aborts it (LANE-7): stop within one step, and say so in the `Done`."""
        generation = self._generation()
        # The lane also aborts on a client's cancel (Generation.cancel marks that first).
        self.aborted = not generation.cancelled
        generation.stop_flag.set()

    def abandon(self, error: BaseException) -> None:
        """The pre-work failed or was cancelled, and submit raises `error`: count why, then end."""
        stats = self._turns.stats
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
        3. release its lane slot, then forget it (the id is remembered as finished, the keep-alive
           counts from here, the registry lease goes);
        4. post the terminal event: the generation tells its end listeners (usage accounting),
           then queues it for the reader. Only now, so a client that sends its next request the
           moment it has this answer finds the slot free (API-3). The reader then runs the
           surface's `TurnHooks.ended` (the persist hand-off, awaited) before the encoder sees
           it, and the request log reads `Generation.result`.

        `event` None: nothing to post (a failed pre-work raises instead).
        """
        if self.state == "ended":  # never expected; what arrives late is still handed on
            if result is not None:
                self._keep(result)
            if event is not None and not self._posted:
                self._post(event)
            return
        self.state = "ended"
        if event is not None:
            event = self._as_posted(event)
            self._count(event)
        if result is not None:
            self._keep(result)
        self.instance.lane.release(self.ticket)
        self._turns.forget(self)
        if event is not None:
            self._post(event)

    # The steps, in the order they run ------------------------------------------------------

    def _run(self, prepared: Prepared, entered_at: float) -> None:
        """queued → running: the lane admitted it; start from a warm session or the disk tier."""
        generation, instance = self._generation(), self.instance
        self.state = "running"
        prompt_ids = prepared.prompt_ids
        lease, saved = self._start_from(prompt_ids, prepared.disk)
        self._lease = lease
        generation.cached_tokens = lease.reuse_tokens if lease else saved.reuse_tokens if saved else 0
        loop = asyncio.get_running_loop()

        def on_end(result: JobResult) -> None:
            # The Done travels with the end (not ahead of it by the courier): see `end`.
            loop.call_soon_threadsafe(self._job_ended, result, job.done, len(prompt_ids))

        job = GenerateJob(generation, prompt_ids, entered_at, on_end, prepared.sampling)
        if lease is not None:
            job.session_kv, job.session_tokens = lease.entry.kv, lease.entry.tokens
            job.reuse_tokens, job.owns_session = lease.reuse_tokens, lease.owned
        elif saved is not None:
            assert instance.disk is not None
            job.disk, job.reuse_tokens = (instance.disk, saved), saved.reuse_tokens
        generation.admit()
        instance.dispatch(job)

    def _start_from(
        self, prompt_ids: list[int], saved: DiskEntry | None
    ) -> tuple[SessionLease | None, DiskEntry | None]:
        """What the turn starts from: a prefix-cache lease, the parent's saved KV (the disk tier,
        when it reuses more), or neither; sets the generation's cache outcome (SES-2, SES-9)."""
        generation, instance = self._generation(), self.instance
        query = generation.request.session
        if query is None:
            return None, None
        lease, generation.session_outcome = instance.sessions.lease(query, prompt_ids)
        disk = instance.disk
        if saved is None or disk is None:
            return lease, None
        if lease is not None and lease.reuse_tokens >= saved.reuse_tokens:
            disk.counted(None)
            return lease, None
        if lease is not None:
            instance.sessions.unlease(lease)
        disk.counted(saved)
        generation.session_outcome = "disk"
        return None, saved

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

    def _job_ended(self, result: JobResult, done: Done | None, prompt_tokens: int) -> None:
        self._prompt_tokens = prompt_tokens
        self.end(done if done is not None else self._terminal, result)

    def _as_posted(self, event: Done | Failed) -> Done | Failed:
        if isinstance(event, Done) and event.finish_reason == "cancelled" and self.aborted:
            # The worker only sees its stop flag; a server abort must not read like a client's
            # cancel, let alone a complete answer (the surfaces map "aborted" to an error).
            return replace(event, finish_reason="aborted")
        return event

    def _count(self, event: Done | Failed) -> None:
        stats = self._turns.stats
        if isinstance(event, Done):
            stats.finished(self.key, event)
        elif event.code in REJECTIONS:
            stats.reject(self.key, event.code)  # left the queue without running (LANE-7/8)
        else:
            stats.outcome(self.key, "failed")

    def _keep(self, result: JobResult) -> None:
        instance, generation = self.instance, self._generation()
        if self._lease is not None:
            instance.sessions.release(self._lease, consumed=result.touched)
            self._lease = None
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


def _cancelled_done() -> Done:
    return Done(finish_reason="cancelled", usage=Usage(0, 0), timings=Timings(0.0, 0.0, 0.0, 0.0))
