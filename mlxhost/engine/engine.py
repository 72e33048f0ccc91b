"""The `Engine`: owns every model instance in this process and admits requests to them."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from mlxhost.engine import tokenizing
from mlxhost.engine.backends import make_backend
from mlxhost.engine.config import EngineConfig
from mlxhost.engine.embedding_turns import EmbeddingTurns
from mlxhost.engine.errors import UnknownModelError
from mlxhost.engine.instance import Instance
from mlxhost.engine.memory import HeapTrimmer, rss_bytes
from mlxhost.engine.names import default_name, staging_name
from mlxhost.engine.prework import Prework
from mlxhost.engine.registry import Registry
from mlxhost.engine.residency import Residency
from mlxhost.engine.retention import Retention
from mlxhost.engine.sessions import SessionScoper
from mlxhost.engine.stats import EngineStats
from mlxhost.engine.turn import Turn
from mlxhost.engine.turns import Turns

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from mlxhost.engine.backends.base import Backend
    from mlxhost.engine.generation import Generation
    from mlxhost.engine.residency import MemoryPolicy
    from mlxhost.engine.types import EmbeddingRequest, Embeddings, GenerationRequest, ModelSpec

logger = logging.getLogger(__name__)

# What a caller holds between `reserve` and `submit` (LANE-3): a turn in its reserved state.
Permit = Turn


class Engine:
    """Hosts instances, one per distinct weights, bound to names by the registry (REG-2).

    A façade over names, loads, reloads, drain and shutdown. Requests go through `Turns`
    (`reserve`, `submit`, `count_tokens`, `cancel`: each request a `Turn`, its pre-work run by
    `Prework`) and `EmbeddingTurns` (`embed`).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        backend: Backend | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or EngineConfig()
        self.backend = backend or make_backend(self.config.backend)
        self.scoper = SessionScoper(self.config.session_secret)
        self.registry = Registry(self._create_instance, self._schedule_teardown)
        self._clock = clock
        # Told the aliases of an instance whose folder no longer matches its fingerprint (REG-3),
        # so the service layer registers the new weights under a new instance id.
        self._weights_listeners: list[Callable[[list[str]], None]] = []
        self._teardowns: set[asyncio.Task[None]] = set()
        self.stats = EngineStats()
        self.residency = Residency(self.registry, self.config.memory_budget_bytes, self.stats)
        self._stopping = False  # shutdown began: arrivals are refused as draining (LANE-7)
        self._closed = False
        # Every render and tokenization of every surface runs here, a few at a time (issue 25).
        self.tokenizers = tokenizing.TokenizePool(self.config.tokenize_threads)
        self.prework = Prework(self.config, self.residency, self.tokenizers)
        self.turns = Turns(self.registry, self.stats, self.config, self.prework, clock=clock)
        self.embeddings = EmbeddingTurns(self.residency, self.tokenizers, self.stats, clock)
        # Memory given back at idle, and MLX's cache bound (issue 25); backends may lack both.
        self.trimmer = HeapTrimmer(getattr(self.backend, "release_memory", _nothing))
        set_cache_limit = getattr(self.backend, "set_cache_limit", None)
        if self.config.mlx_cache_limit_bytes is not None and set_cache_limit is not None:
            set_cache_limit(self.config.mlx_cache_limit_bytes)

    # Registry -----------------------------------------------------------------------------

    def bind(self, name: str, spec: ModelSpec) -> Instance:
        """Bind a name (an alias) to the instance of `spec`'s weights; see `Registry.bind`.

        Raises:
            DrainingError: the engine is draining for shutdown, or has shut down.
        """
        self.turns.check_open()
        instance = self.registry.bind(name, spec)
        self.residency.bound(name, spec)
        return instance

    def on_weights_changed(self, listener: Callable[[list[str]], None]) -> None:
        """Call `listener` with the bound names of an instance whose local folder no longer
        matches its fingerprint at load (REG-3), so control registers the new weights."""
        self._weights_listeners.append(listener)

    def unbind(self, name: str) -> None:
        self.registry.unbind(name)
        self.residency.unbound(name)

    def get(self, instance_id: int) -> Instance:
        return self.registry.get(instance_id)

    def retain(self, instance_id: int) -> Retention:
        """Hold the live instance `instance_id` until a response it produced is stored (REG-6).

        Raises:
            UnknownModelError: no live instance has that id.
        """
        instance = self.get(instance_id)
        self.registry.retain(instance)
        return Retention(self.registry, instance)

    async def load(self, spec: ModelSpec, *, name: str = "") -> Instance:
        """Bind (by `name`, or by instance id) and load `spec`; returns once the weights are resident.

        Raises:
            ModelLoadError: the weights could not be loaded.
        """
        instance = self.bind(name or default_name(spec), spec)
        await self.residency.ensure_loaded(instance)
        return instance

    async def serve(self, names: Sequence[str], spec: ModelSpec) -> Instance:
        """Bind every name in `names` to `spec`'s weights and load them (an admin's load).
        Without names the weights are bound by instance id, resident for aliases to come.

        Raises:
            ModelLoadError: the weights could not be loaded.
        """
        for name in names[1:]:
            self.bind(name, spec)
        return await self.load(spec, name=names[0] if names else "")

    async def reload(
        self,
        names: Sequence[str],
        spec: ModelSpec,
        *,
        on_resident: Callable[[], Awaitable[None]] | None = None,
    ) -> int:
        """Load `spec` again for `names` (OPS-4) and return the instance id now serving them.

        The same weights as now: load them in place as a lane writer (LANE-4), after the running
        requests (aborted past the drain timeout); arrivals wait in the lane. Other weights: load them
        beside the old instance under a staging binding, run `on_resident` (control records the
        switch), then move every name at once; the old instance ends after its requests (REG-6).
        A failed load raises and leaves every name on the old instance.

        Raises:
            ModelLoadError: the new weights could not be loaded.
        """
        current = {self.registry.resolve(name) for name in names if self.bound(name)}
        if any(instance.spec.weights_key == spec.weights_key for instance in current) or (
            not names and self.hosts(spec.instance_id)
        ):
            for name in names or [default_name(spec)]:
                instance = self.bind(name, spec)  # in place: new settings apply (REG-5)
            await instance.reload(self.config.drain_timeout_s)
            await self.residency.ensure_loaded(instance)
            return instance.instance_id
        staging = staging_name(spec)
        try:
            instance = await self.load(spec, name=staging)
            if on_resident is not None:
                await on_resident()
            for name in names:
                self.bind(name, spec)  # the hot swap
        finally:
            self.unbind(staging)
        return instance.instance_id

    async def unload(self, instance_id: int) -> None:
        """Free an instance's memory once its lane is empty; it stays registered (REG-3)."""
        await self.get(instance_id).unload()

    async def drain(
        self, instance_id: int, mode: Literal["wait", "abort"] = "wait", timeout: float | None = None
    ) -> None:
        """Drain an instance (LANE-7): refuse arrivals, cancel the queue, finish or abort, free."""
        instance = self.get(instance_id)
        await instance.lane.drain(mode, timeout)
        try:
            await instance.free()
        finally:
            instance.lane.reopen()  # the next request loads it again

    # Requests -----------------------------------------------------------------------------

    def resolve(self, name: str) -> int:
        """The instance id bound to `name` now; requests resolve names and never bind them.

        Raises:
            UnknownModelError: nothing is bound under that name (control has not bound it).
        """
        return self.registry.resolve(name).instance_id

    def bound(self, name: str) -> bool:
        """Whether `name` is bound now (every request asks, through `bind_on_demand`)."""
        return self.registry.is_bound(name)

    def bound_names(self) -> list[str]:
        """Every name bound now (aliases, and internal names such as "reload:<id>")."""
        return self.registry.names()

    def hosts(self, instance_id: int) -> bool:
        """Whether an instance with this id is registered here (bound, leased or retained)."""
        try:
            self.registry.get(instance_id)
        except UnknownModelError:
            return False
        return True

    def refuse_if_full(self, binding: str) -> None:
        """Refuse a new request for `binding` now when `reserve` would, taking nothing (LANE-2);
        see `Turns.refuse_if_full`."""
        self.turns.refuse_if_full(binding)

    def reserve(self, request_id: str, binding: str) -> Permit:
        """Take a lane permit (a reserved `Turn`) before a request's async pre-work (LANE-3);
        see `Turns.reserve`."""
        return self.turns.reserve(request_id, binding)

    async def check_answer(self, request: GenerationRequest) -> None:
        """Compile and walk `request`'s grammars (its JSON format, its tools' schemas) before it
        takes a lane permit, so a schema that is slow to refuse holds no place in the lane
        (API-7). Needs the loaded model's vocabulary: when it is not loaded, `submit` checks
        them after the load, under the permit. A grammar that passes is cached, and `submit`
        finds it there.

        Raises:
            InvalidRequestError: a grammar cannot be served (naming its field).
        """
        await self.prework.check_answer(self.registry.bound(request.binding), request)

    async def submit(self, request: GenerationRequest, permit: Permit | None = None) -> Generation:
        """Admit `request` under `permit` (or a new one) and return its generation; see `Turns.submit`."""
        return await self.turns.submit(request, permit)

    async def count_tokens(self, request: GenerationRequest) -> int:
        """The number of prompt tokens `request` would feed its model; see `Turns.count_tokens`."""
        return await self.turns.count_tokens(request)

    async def embed(self, request: EmbeddingRequest, permit: Permit | None = None) -> Embeddings:
        """Embed `request`'s texts under `permit` (or a new one) (API-14); see `EmbeddingTurns.embed`."""
        if permit is None:
            permit = self.reserve(request.request_id, request.binding)
        return await self.embeddings.embed(request, permit)

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request, or remember the id for its arrival (LANE-6); see
        `Turns.cancel`."""
        return self.turns.cancel(request_id)

    # Lifecycle ----------------------------------------------------------------------------

    def _create_instance(self, spec: ModelSpec) -> Instance:
        return Instance(
            spec, self.backend, self.config, self._clock, on_weights_changed=self._weights_changed
        )

    def _weights_changed(self, instance: Instance) -> None:
        names = self.registry.names_of(instance)
        logger.warning("instance %s: its weights changed on disk since registration", instance.instance_id)
        for listener in self._weights_listeners:
            listener(names)

    def _schedule_teardown(self, instance: Instance) -> None:
        # The registry already forgot it; free memory and the thread without blocking the caller.
        logger.info("tearing down instance %s", instance.instance_id)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            instance.stop(self.config.shutdown_timeout_s)
            return
        task = loop.create_task(self._teardown(instance))
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    async def _teardown(self, instance: Instance) -> None:
        await instance.lane.drain("wait", self.config.shutdown_timeout_s)
        instance.sessions.clear()
        await asyncio.to_thread(instance.stop, self.config.shutdown_timeout_s)
        instance.state = "unloaded"

    def sweep(self) -> int:
        """Dispose expired warm sessions on every instance; returns how many went."""
        self.turns.sweep()  # expired early cancels and finished ids
        return sum(instance.sessions.sweep() for instance in self.registry.instances())

    async def housekeeping(self, interval_s: float | None = None) -> None:
        """Every `interval_s` (default `config.housekeeping_interval_s`), until shutdown: dispose
        expired warm sessions (SES-6) and free instances idle past their keep-alive (OPS-3)."""
        interval = self.config.housekeeping_interval_s if interval_s is None else interval_s
        while not (self._closed or self._stopping):
            await asyncio.sleep(interval)
            if swept := self.sweep():
                logger.info("disposed %d expired warm sessions", swept)
            try:
                await self.unload_idle()
            except Exception:  # one failed unload must not stop the keep-alive for the others
                logger.exception("keep-alive unload failed")
            await self.trim_if_idle()

    async def trim_if_idle(self) -> bool:
        """Give memory back once every instance has been idle `config.idle_trim_s` and work ran
        (or RSS grew) since the last time: MLX's buffer cache and glibc's free heap pages
        (`memory.HeapTrimmer`). Returns whether it trimmed."""
        after = self.config.idle_trim_s
        instances = self.registry.instances()
        if after is None or any(i.busy() or i.idle_for() < after for i in instances):
            return False
        last_use = max((i.last_used for i in instances), default=0.0)
        if not self.trimmer.due(last_use):
            return False
        await asyncio.to_thread(self.trimmer.trim, last_use)
        return True

    def memory(self) -> dict[str, int]:
        """What the process holds now: RSS, the backend's live and cached array bytes, trims."""
        backend = getattr(self.backend, "memory", None)
        held: dict[str, int] = backend() if backend is not None else {}
        return {
            "rss_bytes": rss_bytes(),
            "backend_active_bytes": held.get("active", 0),
            "backend_cache_bytes": held.get("cache", 0),
            "trims": self.trimmer.trims,
        }

    # Keep-alive and the memory budget (OPS-3) ---------------------------------------------

    def policy(self, instance: Instance) -> MemoryPolicy:
        """The instance's keep-alive and pin, merged over every alias that binds it (REG-2)."""
        return self.residency.policy(instance)

    async def unload_idle(self) -> list[int]:
        """Free every resident, unpinned instance idle at least its keep-alive; returns their ids."""
        return await self.residency.unload_idle()

    def resident_bytes(self) -> int:
        """Bytes every instance holds now: weights plus warm sessions (the budget's measure)."""
        return self.residency.resident_bytes()

    def snapshot(self) -> list[dict[str, Any]]:
        snapshots = []
        for instance in self.registry.instances():
            snap = instance.snapshot()
            policy = self.policy(instance)
            snap["aliases"] = self.registry.names_of(instance)
            snap["stalled"] = instance.stalled_for() >= self.config.stall_after_s
            snap["idle_s"] = round(instance.idle_for(), 1)
            snap["pinned"] = policy.pinned
            snap["keep_alive_s"] = policy.keep_alive_s
            snapshots.append(snap)
        return snapshots

    async def shutdown(self) -> None:
        """Drain every instance (LANE-7, OPS-5), then stop the workers.

        From the first call, new requests are refused with `DrainingError`; queued ones fail
        with it; running ones get `shutdown_timeout_s` to finish, then are aborted (their
        streams still end with a `Done`). Then the engine is closed.
        """
        self._stopping = self.residency.stopped = True
        self.turns.close()
        timeout = self.config.shutdown_timeout_s
        instances = self.registry.instances()
        await asyncio.gather(*(i.lane.drain("wait", timeout) for i in instances), return_exceptions=True)
        self._closed = True
        for instance in instances:
            instance.sessions.clear()
        await asyncio.gather(*(asyncio.to_thread(i.stop, timeout) for i in instances))
        if self._teardowns:
            await asyncio.gather(*self._teardowns, return_exceptions=True)
        self.tokenizers.close()


def _nothing() -> None:
    return None
