"""A queued turn's start: what its lane runs, synchronously, the moment it admits the turn.

The lane calls these hooks, never the turn's own code: a chat turn's `Start` leases the longest
warm prefix of its prompt (or picks the disk tier's saved KV), builds its job and hands it to the
worker; the job's end goes to the loop, which ends the turn (`Turn.end`). Admission is synchronous
(a release admits the next waiter at once), so a continuation admitted behind its parent finds the
parent's KV that `Turn.end` adopted just before releasing the slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxhost.engine.worker import GenerateJob

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.disk import DiskEntry
    from mlxhost.engine.embeddings import EmbedJob
    from mlxhost.engine.generation import Generation
    from mlxhost.engine.instance import Instance
    from mlxhost.engine.lane import Ticket
    from mlxhost.engine.prework import Prepared
    from mlxhost.engine.sessions import SessionLease
    from mlxhost.engine.worker import JobResult


class Start:
    """A queued chat turn's admission (the lane's `on_admit`) and abort (its `on_abort`), and what
    they leave for the turn's end: the session lease it started from, its job, whether it was
    aborted."""

    def __init__(
        self,
        instance: Instance,
        generation: Generation,
        prepared: Prepared,
        entered_at: float,
        on_end: Callable[[JobResult], None],
    ) -> None:
        self.instance = instance
        self.generation = generation
        self.prepared = prepared
        self.entered_at = entered_at  # queue time counts from here
        self.on_end = on_end  # called once, on the worker thread, with the job's result
        self.lease: SessionLease | None = None  # the warm session it started from, until its end
        self.job: GenerateJob | None = None
        self.aborted = False  # the server cut it short (drain timeout, shutdown), not the client

    def admitted(self, _ticket: Ticket) -> None:
        """The lane admitted the turn: start from a warm session or the disk tier, on the worker."""
        generation, instance, prepared = self.generation, self.instance, self.prepared
        lease, saved = self._start_from(prepared.prompt_ids, prepared.disk)
        self.lease = lease
        generation.cached_tokens = lease.reuse_tokens if lease else saved.reuse_tokens if saved else 0
        job = GenerateJob(generation, prepared.prompt_ids, self.entered_at, self.on_end, prepared.sampling)
        if lease is not None:
            job.session_kv, job.session_tokens = lease.entry.kv, lease.entry.tokens
            job.reuse_tokens, job.owns_session = lease.reuse_tokens, lease.owned
        elif saved is not None:
            assert instance.disk is not None
            job.disk, job.reuse_tokens = (instance.disk, saved), saved.reuse_tokens
        self.job = job
        generation.admit()
        instance.dispatch(job)

    def abort(self) -> None:
        """The lane aborts it (LANE-7): stop within one step, and say so in the `Done`."""
        generation = self.generation
        # The lane also aborts on a client's cancel (Generation.cancel marks that first).
        self.aborted = not generation.cancelled
        generation.stop_flag.set()

    def _start_from(
        self, prompt_ids: list[int], saved: DiskEntry | None
    ) -> tuple[SessionLease | None, DiskEntry | None]:
        """What the turn starts from: a prefix-cache lease, the parent's saved KV (the disk tier,
        when it reuses more), or neither; sets the generation's cache outcome (SES-2, SES-9)."""
        generation, instance = self.generation, self.instance
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


def dispatch_on_admit(instance: Instance, job: EmbedJob) -> Callable[[Ticket], None]:
    """An embedding's admission: its job joins the worker's next pass."""

    def admitted(_ticket: Ticket) -> None:
        instance.dispatch(job)

    return admitted
