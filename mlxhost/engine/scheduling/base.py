"""What the worker's schedulers share: the jobs they run, what they read of the worker, and the
protocol each one keeps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mlxhost.engine.embeddings import EmbedJob
from mlxhost.engine.jobs import CallJob, GenerateJob

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.backends.base import EmbeddingModel, LoadedModel
    from mlxhost.engine.jobs import WorkerStats
    from mlxhost.engine.scheduling.fifo import Fifo

Job = GenerateJob | CallJob | EmbedJob


class Shutdown:
    """The worker's last job: every pending write runs, the schedulers close, the thread ends."""


Queued = Job | Shutdown  # what waits in the FIFO (saves wait apart, see `WriteJob`)


class Host(Protocol):
    """What a scheduler reads of the worker that runs it (`InstanceWorker`)."""

    model: LoadedModel | None  # a chat instance's resident model; None while unloaded
    embedder: EmbeddingModel | None  # an embedding instance's (API-13)
    batch_capacity: int  # the lane's capacity (LANE-1)
    reload: Callable[[], LoadedModel] | None  # loads the model afresh, on the worker thread
    stats: WorkerStats

    def fault(self, error: BaseException) -> None:
        """A failure no one request can be blamed for: the worker's fault policy (OPS-2)."""


class Scheduler:
    """One way of running jobs on the worker thread.

    The worker offers the head of its FIFO to each scheduler in turn; the first that `accepts`
    it `start`s it. A scheduler that is `busy` has started work that needs more `step()` calls;
    while it is, a head that another scheduler (or the worker itself) must run waits until the
    busy one drains, and so does everything behind it. Failures no request can be blamed for go
    to `Host.fault`. The defaults are those of a scheduler that runs what it starts to its end
    inside `start`, and so is never busy.
    """

    @property
    def busy(self) -> bool:
        return False

    def accepts(self, job: Queued) -> bool:
        """Whether this scheduler may start `job`, the FIFO's head, now."""
        raise NotImplementedError

    def prepare(self, fifo: Fifo) -> None:
        """Called once a pass, before any job starts: wait for work worth starting together."""

    def start(self, fifo: Fifo) -> None:
        """Take the head (and the jobs that run with it) off `fifo` and start it; only after `accepts`."""
        raise NotImplementedError

    def step(self) -> None:
        """Advance the started work by one step; the worker calls it while `busy`."""

    def reset(self) -> None:
        """The worker ran a load, unload or close (a `CallJob`): let go of what belongs to weights
        no longer resident."""

    def close(self) -> None:
        """Let go of the model: the worker shuts down, or drops it to load it afresh."""
