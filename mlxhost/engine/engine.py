"""The `Engine`: owns every model instance in this process and admits requests to them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from mlxhost.engine import limits, prompts, tokenizing
from mlxhost.engine.backends import make_backend
from mlxhost.engine.config import EngineConfig
from mlxhost.engine.embeddings import (
    EmbedJob,
    check_arrays,
    check_characters,
    check_dimensions,
    check_inputs,
    decoded,
    input_limit,
)
from mlxhost.engine.errors import (
    DrainingError,
    DuplicateRequestError,
    EmbeddingFailedError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    QueueFullError,
    QueueTimeoutError,
    RequestCancelledError,
    UnknownModelError,
    WrongModelKindError,
)
from mlxhost.engine.generation import Generation
from mlxhost.engine.instance import Instance
from mlxhost.engine.lane import TicketHooks
from mlxhost.engine.memory import HeapTrimmer, rss_bytes
from mlxhost.engine.registry import Registry
from mlxhost.engine.residency import Residency
from mlxhost.engine.retention import Retention
from mlxhost.engine.sessions import SessionScoper
from mlxhost.engine.stats import REJECTIONS, EngineStats
from mlxhost.engine.types import Done, Failed, Timings, Usage
from mlxhost.engine.worker import GenerateJob, JobResult, WriteJob

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from mlxhost.engine.answer import AnswerReader
    from mlxhost.engine.backends.base import Backend, LoadedModel
    from mlxhost.engine.disk import DiskEntry
    from mlxhost.engine.lane import Ticket
    from mlxhost.engine.residency import MemoryPolicy
    from mlxhost.engine.sessions import SessionLease, SessionQuery
    from mlxhost.engine.stats import Key
    from mlxhost.engine.types import (
        EmbeddingRequest,
        Embeddings,
        Event,
        GenerationRequest,
        ModelSpec,
        SamplingParams,
    )

logger = logging.getLogger(__name__)

EARLY_CANCEL_LIMIT = 4096
# Turns whose cache becomes a warm session (SES-1): `kv_tokens` lists exactly what it holds.
KEPT_FINISHES = frozenset({"stop", "length", "cancelled"})
FINISHED_IDS_LIMIT = 4096
SHUTDOWN_MESSAGE = "The server is shutting down; retry shortly."
EMBEDDING_FAILED_MESSAGE = "The model failed while embedding."
EMBEDDING_ABORTED_MESSAGE = (
    "The model stopped serving (unload, reload or shutdown) before this request ran; retry."
)


class _CountedGeneration(Generation):
    """A Generation that reports its one terminal event to the engine's counters (OPS-1)."""

    def __init__(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, on_end: Callable[[Event], None]
    ) -> None:
        super().__init__(request, loop)
        self._on_end: Callable[[Event], None] | None = on_end
        self.aborted = False  # the server cut it short (drain timeout, shutdown), not the client

    @property
    def ended(self) -> bool:
        """Whether its terminal Done or Failed was posted."""
        return self._on_end is None

    def abort(self) -> None:
        """The lane aborts it (LANE-7): stop within one step, and say so in the `Done`."""
        # The lane also aborts on a client's cancel (Generation.cancel marks that first).
        self.aborted = not self.cancelled
        self.stop_flag.set()

    def post(self, event: Event) -> None:
        if isinstance(event, Done) and event.finish_reason == "cancelled" and self.aborted:
            # The worker only sees its stop flag; a server abort must not read like a client's
            # cancel, let alone a complete answer (the surfaces map "aborted" to an error).
            event = replace(event, finish_reason="aborted")
        if self._on_end is not None and isinstance(event, Done | Failed):
            on_end, self._on_end = self._on_end, None
            on_end(event)
        super().post(event)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A request after its pre-work: the prompt's token ids and its checked, fitted sampling."""

    prompt_ids: list[int]
    sampling: SamplingParams
    disk: DiskEntry | None = None  # the parent's saved KV, checked, when memory no longer holds it
    reader: AnswerReader | None = None  # reads tool calls and reasoning out of the answer


@dataclass(frozen=True, slots=True)
class _Admission:
    """One request entering its lane: where, which generation, what to run, and since when."""

    instance: Instance
    ticket: Ticket
    generation: _CountedGeneration
    prepared: _Prepared
    entered_at: float


class Permit:
    """A lane permit taken before a request's async pre-work (LANE-3), such as loading its stored
    chain: pass it to `Engine.submit`, which hands it into the lane without counting it twice,
    or `release()` it on bail-out (idempotent)."""

    def __init__(self, engine: Engine, instance: Instance, ticket: Ticket, key: Key) -> None:
        self.request_id = ticket.request_id
        self.instance_id = instance.instance_id
        self._engine = engine
        self._instance = instance
        self._ticket = ticket
        self._key = key
        self._state: Literal["held", "submitted", "released"] = "held"

    @property
    def held(self) -> bool:
        return self._state == "held"

    def release(self) -> None:
        """Give the permit back; a no-op once submitted or released."""
        if self._state != "held":
            return
        self._state = "released"
        self._instance.lane.release(self._ticket)
        self._engine.registry.unlease(self._instance)

    def _take(self) -> tuple[Instance, Ticket, Key]:
        if self._state != "held":
            raise RuntimeError(f"The permit for {self.request_id!r} was already {self._state}.")
        self._state = "submitted"
        return self._instance, self._ticket, self._key


class Engine:
    """Hosts instances, one per distinct weights, bound to names by the registry (REG-2).

    `submit` is two-phase (DESIGN.md): reserve a lane permit synchronously, do the async
    pre-work under it (load, template, count), then hand the permit into the lane. Every
    refusal before the first event raises, so the API answers with a proper status code.
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
        self._live: dict[str, Generation] = {}
        self._early_cancels: OrderedDict[str, float] = OrderedDict()
        self._finished_ids: OrderedDict[str, float] = OrderedDict()  # id -> remembered until
        # Told the aliases of an instance whose folder no longer matches its fingerprint (REG-3),
        # so the service layer registers the new weights under a new instance id.
        self._weights_listeners: list[Callable[[list[str]], None]] = []
        self._teardowns: set[asyncio.Task[None]] = set()
        self.stats = EngineStats()
        self.residency = Residency(self.registry, self.config.memory_budget_bytes, self.stats)
        self._stopping = False  # shutdown began: arrivals are refused as draining (LANE-7)
        self._closed = False
        self._ram_bytes = limits.physical_memory_bytes()
        # Every render and tokenization of every surface runs here, a few at a time (issue 25).
        self.tokenizers = tokenizing.TokenizePool(self.config.tokenize_threads)
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
        self._check_open()
        instance = self.registry.bind(name, spec)
        self.residency.bound(name, spec)
        return instance

    def on_weights_changed(self, listener: Callable[[list[str]], None]) -> None:
        """Call `listener` with the bound names of an instance whose local folder no longer
        matches its fingerprint at load (REG-3), so control registers the new weights."""
        self._weights_listeners.append(listener)

    def _check_open(self) -> None:
        # Shut down or still draining, a client hears the same: this host is going away, retry
        # (503 `draining`, Anthropic 529), never a bare "engine closed" (LANE-7, OPS-5).
        if self._closed or self._stopping:
            raise DrainingError(SHUTDOWN_MESSAGE)

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
        instance = self.bind(name or _default_name(spec), spec)
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
            for name in names or [_default_name(spec)]:
                instance = self.bind(name, spec)  # in place: new settings apply (REG-5)
            await instance.reload(self.config.drain_timeout_s)
            await self.residency.ensure_loaded(instance)
            return instance.instance_id
        staging = _staging_name(spec)
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

    def reserve(self, request_id: str, binding: str) -> Permit:
        """Take a lane permit on the instance bound to `binding` before a request's async
        pre-work (LANE-3). Resolves the name only: it never binds, swaps or updates settings.

        A cancel that arrived first wins over a full lane: the caller hears "cancelled",
        not 429 (LANE-6).

        Raises:
            UnknownModelError: nothing is bound under `binding`.
            RequestCancelledError: a cancel for this id arrived first (LANE-6).
            DuplicateRequestError: a request with this id is live (LANE-5).
            QueueFullError: the lane is over budget (LANE-2).
            DrainingError: the lane is draining (LANE-7), or the engine has shut down.
        """
        if request_id in self._live:
            raise DuplicateRequestError(f"A request with id {request_id!r} is already in flight.")
        instance = self.registry.resolve(binding)
        key: Key = (binding, instance.instance_id)
        if self._take_early_cancel(request_id):
            self.stats.outcome(key, "cancelled")
            raise RequestCancelledError("The request was cancelled before it started.")
        try:
            self._check_open()
            ticket = instance.lane.reserve(request_id)
        except (QueueFullError, DrainingError) as exc:
            self.stats.reject(key, exc.code)
            raise
        self.registry.lease(instance)  # an unbind while the permit waits defers teardown (REG-6)
        instance.touch()
        return Permit(self, instance, ticket, key)

    async def check_answer(self, request: GenerationRequest) -> None:
        """Compile and walk `request`'s grammars (its JSON format, its tools' schemas) before it
        takes a lane permit, so a schema that is slow to refuse holds no place in the lane
        (API-7). Needs the loaded model's vocabulary: when it is not loaded, `submit` checks
        them after the load, under the permit. A grammar that passes is cached, and `submit`
        finds it there.

        Raises:
            InvalidRequestError: a grammar cannot be served (naming its field).
        """
        if not request.tools and request.json_format is None:
            return
        instance = self.registry.bound(request.binding)
        model = instance.model if instance is not None else None
        if model is not None:
            await self.tokenizers.run(prompts.check_answer, model, request)

    async def submit(self, request: GenerationRequest, permit: Permit | None = None) -> Generation:
        """Admit `request`: reserve (or take `permit`), load if needed, render and count the
        prompt, enter the lane. A given permit is consumed, also when this raises.

        Raises:
            QueueFullError: the lane is over budget (LANE-2); nothing was rendered.
            DrainingError: the lane is draining (LANE-7).
            DuplicateRequestError: a request with this id is live (LANE-5).
            RequestCancelledError: a cancel for this id arrived first (LANE-6).
            ModelLoadError: the model could not be loaded.
            InvalidRequestError: a sampling value this model cannot use (before templating).
            PromptTooLongError: the prompt exceeds the model's context or max_input_tokens.
            RequestTooLargeError: its KV cache could not fit the memory budget.
        """
        request_id = request.request_id
        if permit is None:
            permit = self.reserve(request_id, request.binding)
        elif permit.request_id != request_id:
            permit.release()
            raise ValueError(f"The permit is for {permit.request_id!r}, not {request_id!r}.")
        instance, ticket, key = permit._take()
        if instance.spec.kind != "chat":
            instance.lane.release(ticket)
            self.registry.unlease(instance)
            raise WrongModelKindError.embedding_on_chat(request.binding)
        generation = _CountedGeneration(
            request, asyncio.get_running_loop(), lambda event: self._count_end(key, event)
        )
        generation.instance_id = instance.instance_id
        self._live[request_id] = generation  # owns the permit's lease from here (see _forget)
        try:
            if self._take_early_cancel(request_id):
                raise RequestCancelledError("The request was cancelled before it started.")
            prepared = await self._prepare(instance, request)
            generation.reader = prepared.reader
            if generation.cancelled:
                raise RequestCancelledError("The request was cancelled before it started.")
            self._enter(_Admission(instance, ticket, generation, prepared, self._clock()))
        except BaseException as exc:
            instance.lane.release(ticket)
            self._forget(instance, generation)
            if isinstance(exc, RequestCancelledError | asyncio.CancelledError):
                self.stats.outcome(key, "cancelled")
            elif isinstance(exc, DrainingError):
                self.stats.reject(key, exc.code)
            elif isinstance(exc, ModelLoadError):
                self.stats.outcome(key, "failed")
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
            await self.residency.ensure_loaded(instance)
            model = instance.model
            if model is None:
                raise ModelLoadError("The model was unloaded while the request waited; retry.")
            # Not held to max_input_tokens, but nothing longer than the context is worth rendering.
            limits.check_prompt_characters(
                tokenizing.request_characters(request),
                chars_per_token=model.chars_per_token,
                limit=limits.input_limit(None, model.context_length),
            )
            return len((await self.tokenizers.run(prompts.render, model, request)).prompt_ids)
        finally:
            self.registry.unlease(instance)

    async def embed(self, request: EmbeddingRequest, permit: Permit | None = None) -> Embeddings:
        """Embed `request`'s texts (API-14): reserve (or take `permit`), load if needed, tokenize and
        check every input, wait for a lane slot, then join the worker's next forward pass with
        whatever other requests for this model are admitted by then. Cancelling the caller frees
        the slot; a pass already running finishes for the others.

        Raises:
            WrongModelKindError: the name is bound to a chat model.
            QueueFullError, DrainingError, DuplicateRequestError: as `submit` (LANE-2/5/7).
            QueueTimeoutError: it waited longer than the lane's queue timeout (LANE-8).
            ModelLoadError: the model could not be loaded.
            InvalidRequestError: an input is too long (its index named) or `dimensions` is refused.
            EmbeddingFailedError: the forward pass failed.
        """
        if permit is None:
            permit = self.reserve(request.request_id, request.binding)
        instance, ticket, key = permit._take()
        started = self._clock()
        outcome, result, job = "failed", None, None
        try:
            job, done = await self._embed_job(instance, request)
            instance.lane.enter(
                ticket, TicketHooks(on_admit=lambda _t: instance.dispatch(job), on_abort=job.cancel)
            )
            await asyncio.shield(ticket.admitted)
            result = await done
            outcome = "completed"
            return result
        except (asyncio.CancelledError, RequestCancelledError):
            outcome = "cancelled"
            raise
        except (QueueFullError, DrainingError, QueueTimeoutError) as exc:
            outcome = ""  # refused, as on every surface (LANE-2/7/8)
            self.stats.reject(key, exc.code)
            raise
        except (WrongModelKindError, InvalidRequestError):
            outcome = ""  # refused before it ran: not an embedding request that ended
            raise
        finally:
            if job is not None:
                job.cancel()  # a no-op once it ran; a queued or waiting job never runs
            instance.lane.release(ticket)
            self.registry.unlease(instance)
            instance.touch()  # the keep-alive counts from the last request's end (OPS-3)
            if outcome:
                inputs, tokens = (len(result.vectors), result.prompt_tokens) if result else (0, 0)
                latency = self._clock() - started
                self.stats.embedded(key, outcome, inputs=inputs, tokens=tokens, latency_s=latency)

    async def _embed_job(
        self, instance: Instance, request: EmbeddingRequest
    ) -> tuple[EmbedJob, asyncio.Future[Embeddings]]:
        """The pre-work of an embedding under its permit (LANE-3): load, check, tokenize off the
        loop; the job and the future its worker-side end settles."""
        if instance.spec.kind != "embedding":
            raise WrongModelKindError.chat_on_embeddings(request.binding)
        await self.residency.ensure_loaded(instance)
        model = instance.embedder
        if model is None:
            raise ModelLoadError("The model was unloaded while the request waited; retry.")
        dimensions = check_dimensions(
            request.dimensions, width=model.dimensions, truncatable=request.truncatable
        )
        limit = input_limit(model.max_tokens, request.max_input_tokens)
        if any(not isinstance(text, str) for text in request.texts):
            check_arrays(request.texts, limit=limit)  # before decoding: a huge array never is
            texts = await self.tokenizers.run(decoded, request.texts, request.decode)
        else:
            texts = [text for text in request.texts if isinstance(text, str)]
        check_characters(texts, chars_per_token=model.chars_per_token, limit=limit)
        ids = await self.tokenizers.run(model.tokenize, texts)
        check_inputs(ids, limit=limit)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Embeddings] = loop.create_future()

        def on_end(result: Embeddings | None, error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed first (shutdown)
                loop.call_soon_threadsafe(_settle_embeddings, done, result, error)

        return EmbedJob(request.request_id, ids, dimensions, self._clock(), on_end), done

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request; an unknown id is remembered for its arrival (LANE-6).

        An id that finished recently is not remembered: that cancel came late, and a later
        request reusing the id must not be cancelled by it.
        """
        generation = self._live.get(request_id)
        if generation is not None:
            generation.cancel()
            return True
        _expire(self._finished_ids, self._clock())
        if request_id in self._finished_ids:
            return False
        self._early_cancels[request_id] = self._clock() + self.config.early_cancel_ttl_s
        while len(self._early_cancels) > EARLY_CANCEL_LIMIT:
            self._early_cancels.popitem(last=False)
        return False

    async def _prepare(self, instance: Instance, request: GenerationRequest) -> _Prepared:
        # A keep-alive reload (or a budget eviction) waits here, under the permit (LANE-3).
        await self.residency.ensure_loaded(instance)
        model = instance.model
        if model is None:  # unloaded between the load wait and now; the client may retry
            raise ModelLoadError("The model was unloaded while the request waited; retry.")
        # Checked before any work: nothing a request sets may reach MLX unchecked (limits.py).
        sampling = limits.checked_sampling(request.sampling, vocab_size=model.vocab_size)
        # A prompt too long in characters to fit is refused before it is rendered (bounded work).
        limits.check_prompt_characters(
            tokenizing.request_characters(request),
            chars_per_token=model.chars_per_token,
            limit=limits.input_limit(request.max_input_tokens, model.context_length),
        )
        # Templating, tokenizing and grammar compiling run off the loop, a few at a time
        # (`self.tokenizers`); none touches the KV cache.
        rendered = await self.tokenizers.run(prompts.render, model, request)
        prompt_ids = rendered.prompt_ids
        if rendered.plan.grammar is not None:
            sampling = replace(sampling, grammar=rendered.plan.grammar)
        if not rendered.plan.free_text:  # all JSON: its grammar ends it, never a stop string (API-7)
            sampling = replace(sampling, stop=())
        sampling = limits.fitted(
            sampling,
            len(prompt_ids),
            alias_limit=request.max_input_tokens,
            context_length=model.context_length,
        )
        limits.check_kv_cost(
            len(prompt_ids) + sampling.max_tokens,
            bytes_per_token=model.kv_bytes_per_token,
            budget_bytes=self._kv_budget(model.memory_bytes()),
        )
        disk = await self._probe_disk(instance, request.session, prompt_ids)
        reader = prompts.reader_for(model, rendered, request.call_id_prefix)
        return _Prepared(prompt_ids, sampling, disk, reader)

    async def _probe_disk(
        self, instance: Instance, query: SessionQuery | None, prompt_ids: list[int]
    ) -> DiskEntry | None:
        """The saved KV of the parent a continuation names, when memory lacks it (the disk tier)."""
        disk = instance.disk
        if disk is None or query is None or query.previous_response_id is None:
            return None
        if instance.sessions.entry(query.previous_response_id) is not None:
            return None
        found = await asyncio.to_thread(disk.probe, query.previous_response_id, query, prompt_ids)
        if found is None:
            disk.counted(None)
        return found

    def _kv_budget(self, weights_bytes: int) -> int | None:
        """The most KV cache one request may need: the configured cap, else what the memory
        budget (or the machine's RAM) leaves beside the weights."""
        if self.config.max_request_kv_bytes is not None:
            return self.config.max_request_kv_bytes
        total = self.config.memory_budget_bytes or self._ram_bytes
        return max(total - weights_bytes, 0) if total else None

    def _enter(self, admission: _Admission) -> None:
        instance, ticket, generation = admission.instance, admission.ticket, admission.generation
        hooks = TicketHooks(
            on_admit=lambda _t: self._dispatch(admission),
            on_position=generation.queued,
            on_abort=generation.abort,
        )

        def cancel() -> None:
            instance.lane.cancel(generation.request_id)

        generation.on_cancel(cancel)
        ticket.admitted.add_done_callback(lambda f: self._left_queue(instance, ticket, generation, f))
        instance.lane.enter(ticket, hooks)

    def _left_queue(
        self, instance: Instance, ticket: Ticket, generation: Generation, future: asyncio.Future[None]
    ) -> None:
        if future.cancelled() or future.exception() is None:
            return  # admitted (dispatch runs from on_admit), or released by submit's cleanup
        error = future.exception()
        if isinstance(error, RequestCancelledError):
            generation.post(_cancelled_done(len(generation.request.messages)))
        else:
            generation.post(
                Failed(
                    code=getattr(error, "code", "engine_error"),
                    message=str(error),
                    retry_after=getattr(error, "retry_after", None),
                )
            )
        assert isinstance(error, Exception), error  # the lane fails tickets with EngineErrors
        generation.refuse(error)
        instance.lane.release(ticket)
        self._forget(instance, generation)

    def _dispatch(self, admission: _Admission) -> None:
        instance, ticket, generation = admission.instance, admission.ticket, admission.generation
        prompt_ids, sampling = admission.prepared.prompt_ids, admission.prepared.sampling
        lease, saved = self._start_from(instance, generation, prompt_ids, admission.prepared.disk)
        generation.cached_tokens = lease.reuse_tokens if lease else saved.reuse_tokens if saved else 0
        loop = asyncio.get_running_loop()

        def on_end(result: JobResult) -> None:
            # The Done travels with the end (not ahead of it by the courier): see `_finished`.
            loop.call_soon_threadsafe(
                self._finished, instance, ticket, generation, lease, result, job.done, len(prompt_ids)
            )

        job = GenerateJob(generation, prompt_ids, admission.entered_at, on_end, sampling)
        if lease is not None:
            job.session_kv, job.session_tokens = lease.entry.kv, lease.entry.tokens
            job.reuse_tokens, job.owns_session = lease.reuse_tokens, lease.owned
        elif saved is not None:
            assert instance.disk is not None
            job.disk, job.reuse_tokens = (instance.disk, saved), saved.reuse_tokens
        generation.admit()
        instance.dispatch(job)

    @staticmethod
    def _start_from(
        instance: Instance, generation: Generation, prompt_ids: list[int], saved: DiskEntry | None
    ) -> tuple[SessionLease | None, DiskEntry | None]:
        """What the turn starts from: a prefix-cache lease, the parent's saved KV (the disk tier,
        when it reuses more), or neither; sets the generation's cache outcome (SES-2, SES-9)."""
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

    def _finished(
        self,
        instance: Instance,
        ticket: Ticket,
        generation: _CountedGeneration,
        lease: SessionLease | None,
        result: JobResult,
        done: Done | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        # Adopt before releasing the slot: release admits (and leases for) the next waiter at
        # once, and a continuation queued behind its parent must find the parent's session.
        if lease is not None:
            instance.sessions.release(lease, consumed=result.touched)
        if result.kv is not None:
            query = generation.request.session
            # What the cache holds is kept (SES-1): a turn that finished, was cut by its length or
            # was cancelled, up to the tokens it produced; never a failed or aborted one.
            if query is not None and result.finish_reason in KEPT_FINISHES and not generation.aborted:
                kept = instance.sessions.adopt(
                    response_id=generation.request_id,
                    query=query,
                    tokens=result.kv_tokens,
                    kv=result.kv,
                    nbytes=result.kv_nbytes,
                    prompt_tokens=prompt_tokens,
                )
                if kept and generation.request.keep_on_disk:
                    self._write_behind(instance, generation.request_id, query)
            else:
                instance.sessions.discard(result.kv)
        instance.lane.release(ticket)
        # The answer goes out only now, after the slot is free: a client that sends its next
        # request the moment it has this one is admitted, not refused as queue_full (API-3).
        if done is not None and not generation.ended:
            generation.post(done)
        self._forget(instance, generation)

    def _write_behind(self, instance: Instance, response_id: str, query: SessionQuery) -> None:
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

    def _forget(self, instance: Instance, generation: Generation) -> None:
        if self._live.get(generation.request_id) is generation:
            del self._live[generation.request_id]
            self._finished_ids[generation.request_id] = self._clock() + self.config.finished_ids_ttl_s
            self._finished_ids.move_to_end(generation.request_id)
            while len(self._finished_ids) > FINISHED_IDS_LIMIT:
                self._finished_ids.popitem(last=False)
            instance.touch()  # the keep-alive counts from the last request's end (OPS-3)
            self.registry.unlease(instance)

    def _count_end(self, key: Key, event: Event) -> None:
        if isinstance(event, Done):
            self.stats.finished(key, event)
        elif isinstance(event, Failed) and event.code in REJECTIONS:
            self.stats.reject(key, event.code)  # left the queue without running (LANE-7/8)
        else:
            self.stats.outcome(key, "failed")

    def _take_early_cancel(self, request_id: str) -> bool:
        _expire(self._early_cancels, self._clock())
        return self._early_cancels.pop(request_id, None) is not None

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
        self._take_early_cancel("")  # also drops expired early cancels
        _expire(self._finished_ids, self._clock())
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


def _settle_embeddings(
    future: asyncio.Future[Embeddings], result: Embeddings | None, error: BaseException | None
) -> None:
    if future.done():
        return
    if result is not None:
        future.set_result(result)
        return
    if error is None:  # its job was cancelled before its pass: only a drain's abort does that
        error = DrainingError(EMBEDDING_ABORTED_MESSAGE)
    elif not isinstance(error, EngineError):  # the backend's own exception stays in the log (API-4)
        error = EmbeddingFailedError(EMBEDDING_FAILED_MESSAGE)
    future.set_exception(error)
    future.exception()  # retrieved: the caller may have stopped waiting


def _expire(remembered: OrderedDict[str, float], now: float) -> None:
    # Entries are kept in expiry order (each is appended with the same TTL).
    while remembered and next(iter(remembered.values())) < now:
        remembered.popitem(last=False)


# Names the engine binds for itself, beside aliases: weights loaded by instance id, and new
# weights loading beside the old ones during a reload. An alias (a slug) never has a colon.
INTERNAL_NAME_MARK = ":"


def _default_name(spec: ModelSpec) -> str:
    return f"instance:{spec.instance_id}"


def instance_id_of_name(name: str) -> int | None:
    """The instance id a binding by id names (`instance:<id>`, a load with no alias); else None."""
    kind, _, number = name.partition(INTERNAL_NAME_MARK)
    return int(number) if kind == "instance" and number.isdigit() else None


def _staging_name(spec: ModelSpec) -> str:
    return f"reload:{spec.instance_id}"


def is_internal_name(name: str) -> bool:
    """Whether a bound name is one of the engine's own (by instance id, a reload's staging)."""
    return INTERNAL_NAME_MARK in name


def _cancelled_done(_messages: int) -> Done:
    return Done(finish_reason="cancelled", usage=Usage(0, 0), timings=Timings(0.0, 0.0, 0.0, 0.0))


def _nothing() -> None:
    return None
