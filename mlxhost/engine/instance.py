"""An `Instance`: one registration of weights (REG-3) with its lane, warm sessions and worker thread."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from mlxhost.engine.config import prefix_cache_bytes
from mlxhost.engine.disk import DiskTier, weights_folder
from mlxhost.engine.disk import snapshot as disk_snapshot
from mlxhost.engine.errors import ModelLoadError, WeightsChangedError
from mlxhost.engine.lane import Lane
from mlxhost.engine.limits import physical_memory_bytes
from mlxhost.engine.memory import KvDisposer
from mlxhost.engine.sessions import SessionCache, tier_figures
from mlxhost.engine.stats import speculation_figures
from mlxhost.engine.weights import folder_fingerprint, with_draft
from mlxhost.engine.worker import CallJob, EmbedJob, GenerateJob, InstanceWorker, WriteJob

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.backends.base import Backend, EmbeddingModel, LoadedModel
    from mlxhost.engine.config import EngineConfig
    from mlxhost.engine.types import ModelSpec
    from mlxhost.engine.worker import WorkerStats

State = Literal["unloaded", "loading", "ready", "error"]


logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadProgress:
    """Where a load is (OPS-4): its phase, and within a phase that can count, how far."""

    done: int = 0
    total: int = 0
    unit: str = "bytes"  # or "files" (a count of files, for a backend that reports them)
    # "starting", "verify" (hashing a local folder), "download" (a hub's files, in bytes), "read"
    # (bytes), or "build" (mlx-lm makes the model from the read weights; nothing to count).
    phase: str = "starting"
    # A hub download's file in flight (issue 28): its path, and its bytes of its size.
    file: str = ""
    file_done: int = 0
    file_total: int = 0


PHASE_OF_UNIT = {"files": "download", "bytes": "read"}


class Instance:
    """Owns the worker thread that holds the model; the asyncio side only awaits it.

    Loads and unloads are the lane's writers (LANE-4): they wait for running requests to
    finish, and nothing is admitted while they run.
    """

    def __init__(
        self,
        spec: ModelSpec,
        backend: Backend,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        on_weights_changed: Callable[[Instance], None] | None = None,
    ) -> None:
        self.instance_id = spec.instance_id
        self.spec = spec
        self.state: State = "unloaded"
        self.last_error: str | None = None
        # Whether the loaded weights can batch (None: not known before the first load). A chat
        # model that cannot runs one request at a time, so its lane's capacity is clamped to 1
        # (LANE-1): otherwise N-1 admitted requests would wait inside the worker, unseen by the
        # queue positions, the queue timeout and `active`.
        self.can_batch: bool | None = None
        self.reloading = False  # an in-place reload runs: requests wait in the lane for it
        self.progress = LoadProgress()
        self.last_used = clock()
        self._backend = backend
        self._config = config
        self._clock = clock
        self.lane = Lane(clock=clock)
        self._configure_lane(spec)
        # The disk tier of these weights (None: off); every instance of the same weights shares it.
        self.disk = (
            DiskTier(weights_folder(Path(config.kv_dir), spec.weights_key), config.kv_disk_bytes)
            if config.kv_dir and config.kv_disk_bytes > 0 and spec.kind == "chat"
            else None
        )
        # The lane's capacity is the batch's sequence capacity (LANE-1); the worker reads it per job.
        self._worker = InstanceWorker(
            str(spec.instance_id),
            clock,
            getattr(backend, "thread_exit", None),
            reload=self._reload_on_worker,
            batch_capacity=self.effective_capacity(spec),
            arrivals=lambda: self.lane.permits,
            burst_wait_s=config.burst_wait_s,
            speculation=config.speculation,
            reload_after_faults=config.reload_after_faults,
            embed_wait_s=config.embed_wait_s,
        )
        self.sessions = SessionCache(
            max_entries=config.max_sessions,
            max_bytes=prefix_cache_bytes(config, physical_memory_bytes()),
            ttl_s=config.session_ttl_s,
            clock=clock,
            dispose=KvDisposer(self._worker),
        )
        self._loading: asyncio.Future[None] | None = None
        # Called on the loop when a load found the folder changed since registration (REG-3).
        self.on_weights_changed = on_weights_changed

    @property
    def model(self) -> LoadedModel | None:
        return self._worker.model

    @property
    def embedder(self) -> EmbeddingModel | None:
        """An embedding instance's resident model (API-13); None for chat models."""
        return self._worker.embedder

    def weights_bytes(self) -> int:
        """Bytes of the resident weights, of either kind (0 when not loaded)."""
        resident = self._worker.model or self._worker.embedder
        return resident.memory_bytes() if resident is not None else 0

    @property
    def stats(self) -> WorkerStats:
        return self._worker.stats

    def update_spec(self, spec: ModelSpec) -> None:
        """New settings for the next request (REG-5); the identity (instance id) never changes."""
        if spec.instance_id != self.instance_id:
            from dataclasses import replace

            spec = replace(spec, instance_id=self.instance_id)
        if spec.lane != self.spec.lane:
            self._configure_lane(spec)
            self._worker.set_batch_capacity(self.effective_capacity(spec))
        self.spec = spec

    def effective_capacity(self, spec: ModelSpec | None = None) -> int:
        """The lane capacity this instance serves: the model's setting, or 1 for a chat model
        whose weights cannot batch (LANE-1)."""
        spec = spec or self.spec
        if spec.kind == "vision":
            return 1  # vision rows are not batched yet: one generation at a time (docs/models.md)
        if spec.kind == "chat" and self.can_batch is False:
            return 1
        return spec.lane.capacity

    async def ensure_loaded(self) -> None:
        """Load the weights unless resident; concurrent callers share one load.

        Raises:
            ModelLoadError: the load failed (the reason is kept in `last_error`).
        """
        if self.state == "ready":
            return
        if self._loading is None or self._loading.done():
            self._loading = asyncio.ensure_future(self._load_exclusive())
        await asyncio.shield(self._loading)

    async def unload(self) -> None:
        """Free the model's memory and its warm sessions once the lane is empty (a writer)."""
        async with self.lane.exclusive():
            await self.free()

    async def reload(self, drain_timeout_s: float | None) -> None:
        """Load the same weights afresh in place (OPS-4), as a writer (LANE-4): after the running
        requests (aborted past `drain_timeout_s`); requests arriving meanwhile wait in the lane,
        never refused, and run on the new load.

        Raises:
            ModelLoadError: the load failed (the reason is kept in `last_error`).
        """
        self.reloading = True
        try:
            async with self.lane.exclusive(abort_after=drain_timeout_s):
                await self.free()
                await self._load_held()
        finally:
            self.reloading = False

    async def free(self) -> None:
        """Free the model and its warm sessions now; the caller guarantees the lane is empty.

        Marked unloaded first: a request that arrives meanwhile waits for a reload under its
        permit (LANE-3) instead of finding a model that is being freed.
        """
        self.state = "unloaded"
        self.sessions.clear()
        await self._on_worker(self._close_model)

    def dispatch(self, job: GenerateJob | EmbedJob) -> None:
        self.last_used = self._clock()
        self._worker.submit(job)

    def touch(self) -> None:
        """A request arrived or left, or the weights loaded: the idle clock restarts (OPS-3)."""
        self.last_used = self._clock()

    def busy(self) -> bool:
        """Whether anything holds or waits for the lane: a permit, a request, a writer."""
        probe = self.lane.probe()
        return bool(probe.active or probe.queued or probe.permits or probe.writers)

    def idle_for(self) -> float:
        """Seconds since the last request left (or the load finished); 0 while the lane is busy."""
        if self.busy():
            return 0.0
        return max(0.0, self._clock() - self.last_used)

    def stop(self, timeout: float) -> None:
        """Free the model and end the worker thread (blocking; call off the loop)."""
        self._worker.submit(CallJob(self._close_model, lambda _r, _e: None))
        self._worker.shutdown(timeout)

    def stalled_for(self) -> float:
        """Seconds the worker has held a request without producing a token (OPS-2)."""
        if self.stats.active_request is None:
            return 0.0
        return max(0.0, self._clock() - self.stats.last_progress_at)

    def snapshot(self) -> dict[str, Any]:
        stats = self._worker.stats
        return {
            "instance_id": self.instance_id,
            "kind": self.spec.kind,
            "state": self.state,
            "last_error": self.last_error,
            "reloading": self.reloading,
            "lane": self.lane.probe().as_dict(),
            # The capacity the model's settings ask for; `lane.capacity` is what is served (LANE-1).
            "configured_capacity": self.spec.lane.capacity,
            "can_batch": self.can_batch,
            "tokens_generated": stats.tokens_generated,
            "requests_finished": stats.requests_finished,
            "requests_cancelled": stats.requests_cancelled,
            "requests_failed": stats.requests_failed,
            "decode_tps": round(stats.last_decode_tps, 2),
            "ttft_ms": round(stats.last_ttft_ms, 1),  # includes the queue wait...
            "queue_ms": round(stats.last_queue_ms, 1),  # ...which is this much of it
            "batch_size": stats.batch_size,  # sequences sharing decode steps now (batched scheduler)
            "stalled_s": round(self.stalled_for(), 1),
            # Unattributed failures (OPS-2): degraded until a generation finishes cleanly again.
            "faults": {
                "total": stats.faults,
                "in_a_row": stats.consecutive_faults,
                "last": stats.last_fault,
                "recoveries": stats.recoveries,
                "reloads": stats.reloads,
            },
            "memory_bytes": self.weights_bytes(),
            # An embedding model's work (API-14); zeros on a chat model.
            "embeddings": {
                "passes": stats.embedding_passes,
                "inputs": stats.inputs_embedded,
                "tokens": stats.tokens_embedded,
            },
            # Speculative decoding (docs/speculation.md), over the batch's finished rows that
            # could draft: tokens drafted, drafted tokens accepted, decode passes, tokens emitted.
            "speculation": speculation_figures(stats.speculation),
            "load_progress": {
                "done": self.progress.done,
                "total": self.progress.total,
                "unit": self.progress.unit,
                "phase": self.progress.phase,
                "file": self.progress.file,
                "file_done": self.progress.file_done,
                "file_total": self.progress.file_total,
            },
            "prefix_cache": self._cache_snapshot(),
            "worker_alive": self._worker.alive,
        }

    def _cache_snapshot(self) -> dict[str, Any]:
        tiers = {"memory": tier_figures(self.sessions.stats, self.sessions.max_bytes)}
        if self.disk is not None:
            tiers["disk"] = disk_snapshot(self.disk.stats, self.disk.max_bytes)
        return tiers

    def write_behind(self, job: WriteJob) -> None:
        """Hand a disk-tier save to the worker, which runs it when idle (see `WriteJob`)."""
        self._worker.submit(job)

    async def _load_exclusive(self) -> None:
        async with self.lane.exclusive():
            if self.state != "ready":
                await self._load_held()

    async def _load_held(self) -> None:
        """Load the weights; the caller holds the lane as a writer."""
        self.state, self.last_error = "loading", None
        try:
            await self._on_worker(self._load)
        except Exception as exc:
            self.state, self.last_error = "error", _describe(exc)
            if isinstance(exc, WeightsChangedError):
                if self.on_weights_changed is not None:
                    self.on_weights_changed(self)
                raise
            raise ModelLoadError(self.last_error) from exc
        self.state = "ready"
        self.touch()  # a fresh load is not idle yet: its keep-alive starts now
        if self.model is not None and self.model.shared_cache:
            self.sessions.single_use()  # one shared mutable cache: one entry, taken out (SES-5)
        if self.model is not None:
            self._learn_batching(self.model)

    def _learn_batching(self, model: LoadedModel) -> None:
        can_batch = getattr(model, "can_batch", None)  # optional, as `open_batch` is
        batches = bool(can_batch()) if can_batch is not None else hasattr(model, "open_batch")
        if batches == self.can_batch:
            return
        self.can_batch = batches
        if not batches and self.spec.lane.capacity > 1:
            logger.warning(
                "instance %s cannot batch: serving one request at a time, not %d (lane capacity 1)",
                self.instance_id,
                self.spec.lane.capacity,
            )
        self._configure_lane(self.spec)
        self._worker.set_batch_capacity(self.effective_capacity())

    def _configure_lane(self, spec: ModelSpec) -> None:
        settings = spec.lane
        self.lane.configure(
            capacity=self.effective_capacity(spec),
            queue_depth=settings.queue_depth,
            unbounded=settings.unbounded,
            queue_timeout_s=settings.queue_timeout_s,
        )

    def _load(self) -> None:
        worker = self._worker
        self.progress = LoadProgress(phase="verify")
        if self.spec.kind == "embedding":
            if worker.embedder is None:
                self._verify_weights()
                worker.embedder = self._backend.load_embedder(self.spec, self._on_progress)
        elif worker.model is None:
            self._verify_weights()
            worker.model = self._backend.load(self.spec, self._on_progress)

    def _verify_weights(self) -> None:
        """Refuse a folder whose files changed since registration, so the old instance id is never
        stamped on new bytes (REG-3): a reload, a restart or a keep-alive reload reads the folder
        afresh. A small TOCTOU window remains between this hash and the backend's read. A draft
        model's folder is checked the same way; the target's identity includes the draft's."""
        spec = self.spec
        _verify_folder(spec, spec.draft.fingerprint if spec.draft is not None else None)
        if spec.draft is not None:
            _verify_folder(spec.draft, None)

    def _reload_on_worker(self) -> LoadedModel:
        self.state, self.last_error = "loading", None
        try:
            self._load()
        except Exception as exc:
            self.state, self.last_error = "error", _describe(exc)
            raise ModelLoadError(self.last_error) from exc
        self.state = "ready"
        assert self._worker.model is not None
        return self._worker.model

    def _close_model(self) -> None:
        model, self._worker.model = self._worker.model, None
        embedder, self._worker.embedder = self._worker.embedder, None
        for resident in (model, embedder):
            if resident is not None:
                resident.close()

    def _on_progress(
        self,
        done: int,
        total: int,
        unit: str = "bytes",
        phase: str = "",
        file: tuple[str, int, int] = ("", 0, 0),
    ) -> None:
        if not total:  # a phase with nothing to count (the build) keeps what was read, for the record
            last = self.progress
            done, total, unit = last.done, last.total, last.unit
        self.progress = LoadProgress(done, total, unit, phase or PHASE_OF_UNIT.get(unit, "read"), *file)

    async def _on_worker(self, fn: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def settle(_result: object, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, future, error)

        self._worker.submit(CallJob(fn, settle))
        await future


def _verify_folder(spec: ModelSpec, draft_fingerprint: str | None) -> None:
    folder = Path(spec.source)
    if not spec.verify_weights or spec.revision or not folder.is_absolute():
        return  # hub weights are named by an immutable commit
    try:
        actual = with_draft(folder_fingerprint(folder), draft_fingerprint)
    except OSError as exc:
        raise ModelLoadError(f"The weights could not be read: {exc}") from exc
    if actual != spec.fingerprint:
        raise WeightsChangedError("The weights changed since the alias was saved; re-save the alias.")


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _describe(error: BaseException) -> str:
    # A short reason for the admin and clients: the exception type and first line, no traceback.
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:300] if text else type(error).__name__
