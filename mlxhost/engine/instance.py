"""An `Instance`: one registration of weights (REG-3) with its worker thread and load state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mlxhost.engine.errors import ModelLoadError
from mlxhost.engine.worker import CallJob, GenerateJob, InstanceWorker

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import Backend
    from mlxhost.engine.generation import Generation
    from mlxhost.engine.types import ModelSpec

State = Literal["unloaded", "loading", "ready", "error"]


@dataclass(slots=True)
class LoadProgress:
    done: int = 0
    total: int = 0


class Instance:
    """Owns the worker thread that holds the model; the asyncio side only awaits it."""

    def __init__(
        self, spec: ModelSpec, backend: Backend, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.spec = spec
        self.state: State = "unloaded"
        self.last_error: str | None = None
        self.progress = LoadProgress()
        self.last_used = clock()
        self.waiting = 0
        self._backend = backend
        self._clock = clock
        self._worker = InstanceWorker(str(spec.instance_id), clock)
        self._loading: asyncio.Future[None] | None = None

    @property
    def model(self):  # noqa: ANN201 - the backend's LoadedModel
        return self._worker.model

    @property
    def stats(self):  # noqa: ANN201
        return self._worker.stats

    async def ensure_loaded(self) -> None:
        """Load the weights on the worker thread unless resident; concurrent callers share one load.

        Raises:
            ModelLoadError: the load failed (the reason is kept in `last_error`).
        """
        if self.state == "ready":
            return
        if self._loading is None or self._loading.done():
            self._loading = asyncio.get_running_loop().create_future()
            self.state, self.last_error = "loading", None
            self._run_on_worker(self._load, self._loading, is_load=True)
        await asyncio.shield(self._loading)

    async def unload(self) -> None:
        """Free the model's memory on the worker thread (after any queued work)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._run_on_worker(self._close_model, future, is_load=False)
        await future
        self.state = "unloaded"

    def submit(self, generation: Generation, prompt_ids: list[int]) -> None:
        self.last_used = self._clock()
        self._worker.submit(GenerateJob(generation, prompt_ids, self._clock()))

    def shutdown(self, timeout: float) -> None:
        self._worker.submit(CallJob(self._close_model, lambda _r, _e: None))
        self._worker.shutdown(timeout)

    def snapshot(self) -> dict[str, object]:
        stats = self._worker.stats
        model = self._worker.model
        return {
            "instance_id": self.spec.instance_id,
            "state": self.state,
            "last_error": self.last_error,
            "active": 1 if stats.active_request else 0,
            "waiting": self.waiting,
            "tokens_generated": stats.tokens_generated,
            "requests_finished": stats.requests_finished,
            "requests_cancelled": stats.requests_cancelled,
            "requests_failed": stats.requests_failed,
            "decode_tps": round(stats.last_decode_tps, 2),
            "memory_bytes": model.memory_bytes() if model is not None else 0,
            "load_progress": {"done": self.progress.done, "total": self.progress.total},
            "worker_alive": self._worker.alive,
        }

    def _load(self) -> None:
        if self._worker.model is None:
            self._worker.model = self._backend.load(self.spec, self._on_progress)

    def _close_model(self) -> None:
        model, self._worker.model = self._worker.model, None
        if model is not None:
            model.close()

    def _on_progress(self, done: int, total: int) -> None:
        self.progress = LoadProgress(done, total)

    def _run_on_worker(self, fn: Callable[[], None], future: asyncio.Future[None], *, is_load: bool) -> None:
        loop = future.get_loop()

        def settle(_result: object, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(self._settle, future, error, is_load)

        self._worker.submit(CallJob(fn, settle))

    def _settle(self, future: asyncio.Future[None], error: BaseException | None, is_load: bool) -> None:
        if is_load:
            self.state = "error" if error else "ready"
            self.last_error = _describe(error) if error else None
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(ModelLoadError(_describe(error)) if is_load else error)


def _describe(error: BaseException) -> str:
    # A short reason for the admin and clients: the exception type and first line, no traceback.
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:300] if text else type(error).__name__
