"""A request's pre-work under its lane permit (LANE-3): load, check, render, count, fit; and
its `Start`, which the lane runs the moment it admits the request.

Nothing before the admission touches the KV cache: templating, tokenizing and grammar compiling
run off the loop, a few at a time (`tokenizing.TokenizePool`), and every refusal raises before
the request enters its lane. The lane then calls the `Start`'s hooks, never the turn's own code:
it leases the longest warm prefix of the prompt (or picks the disk tier's saved KV), builds the
job and hands it to the worker; the job's end goes to the loop, which ends the turn
(`Turn.end`). Admission is synchronous (a release admits the next waiter at once), so a
continuation admitted behind its parent finds the parent's KV that `Turn.end` adopted just
before it released the slot.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mlxhost.engine import limits, prompts, tokenizing
from mlxhost.engine.errors import ModelLoadError
from mlxhost.engine.jobs import GenerateJob

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.answer import AnswerReader
    from mlxhost.engine.backends.base import LoadedModel
    from mlxhost.engine.config import EngineConfig
    from mlxhost.engine.disk import DiskEntry
    from mlxhost.engine.embeddings import EmbedJob
    from mlxhost.engine.generation import Generation
    from mlxhost.engine.instance import Instance
    from mlxhost.engine.jobs import JobResult
    from mlxhost.engine.lane import Ticket
    from mlxhost.engine.residency import Residency
    from mlxhost.engine.sessions import SessionLease, SessionQuery
    from mlxhost.engine.types import GenerationRequest, SamplingParams

UNLOADED_MESSAGE = "The model was unloaded while the request waited; retry."


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request after its pre-work: the prompt's token ids and its checked, fitted sampling."""

    prompt_ids: list[int]
    sampling: SamplingParams
    disk: DiskEntry | None = None  # the parent's saved KV, checked, when memory no longer holds it
    reader: AnswerReader | None = None  # reads tool calls and reasoning out of the answer
    # Speculation (docs/speculation.md): drafts per step allowed (0: none) and the prediction's ids.
    max_draft: int = 0
    prediction_ids: tuple[int, ...] = ()


class Prework:
    """The checks and renders a chat request needs before it may enter its lane."""

    def __init__(
        self, config: EngineConfig, residency: Residency, tokenizers: tokenizing.TokenizePool
    ) -> None:
        self.config = config
        self.residency = residency
        self.tokenizers = tokenizers
        self.ram_bytes = limits.physical_memory_bytes()

    async def loaded(self, instance: Instance) -> LoadedModel:
        """The instance's model, loaded first if needed (a keep-alive reload, a budget eviction).

        Raises:
            ModelLoadError: it could not be loaded, or was unloaded again before this returned.
        """
        await self.residency.ensure_loaded(instance)  # at once when resident
        model = instance.model
        if model is None:  # unloaded between the load wait and now; the client may retry
            raise ModelLoadError(UNLOADED_MESSAGE)
        return model

    async def prepare(self, instance: Instance, request: GenerationRequest) -> Prepared:
        """Load, check the sampling, render and count the prompt, fit it to the model and the
        memory budget, and probe the disk tier for its parent (see `Engine.submit`'s refusals)."""
        model = await self.loaded(instance)  # a reload waits here, under the permit (LANE-3)
        # Checked before any work: nothing a request sets may reach MLX unchecked (limits.py).
        sampling = limits.checked_sampling(request.sampling, vocab_size=model.vocab_size)
        if request.rows is not None:  # one choice of several: a seed of its own
            sampling = replace(sampling, seed=limits.choice_seed(sampling.seed, request.rows.index))
        # A prompt too long in characters to fit is refused before it is rendered (bounded work).
        limits.check_prompt_characters(
            tokenizing.request_characters(request),
            chars_per_token=model.chars_per_token,
            limit=limits.input_limit(request.max_input_tokens, model.context_length),
        )
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
            budget_bytes=self.kv_budget(model.memory_bytes()),
        )
        disk = await self.probe_disk(instance, request.session, prompt_ids)
        reader = prompts.reader_for(model, rendered, request.call_id_prefix)
        max_draft = max(0, request.max_draft) if self.config.speculation else 0
        prediction = await self.prediction_ids(model, request, sampling) if max_draft else ()
        return Prepared(prompt_ids, sampling, disk, reader, max_draft, prediction)

    async def prediction_ids(
        self, model: LoadedModel, request: GenerationRequest, sampling: SamplingParams
    ) -> tuple[int, ...]:
        """The prediction's token ids, as the model's output would hold them (no special
        tokens). An answer of `max_tokens` tokens covers at most `chars_per_token` characters
        each, so text past twice that could never be followed in order and is not tokenized."""
        text = request.prediction
        if not text:
            return ()
        if model.chars_per_token:
            text = text[: 2 * model.chars_per_token * sampling.max_tokens]
        return tuple(await self.tokenizers.run(model.encode_output, text))

    async def check_answer(self, instance: Instance | None, request: GenerationRequest) -> None:
        """Compile `request`'s grammars on the loaded model, if there is one; see `Engine.check_answer`."""
        if not request.tools and request.json_format is None:
            return
        model = instance.model if instance is not None else None
        if model is not None:
            await self.tokenizers.run(prompts.check_answer, model, request)

    async def count(self, instance: Instance, request: GenerationRequest) -> int:
        """The prompt tokens `request` would feed the instance's model; see `Engine.count_tokens`."""
        model = await self.loaded(instance)
        # Not held to max_input_tokens, but nothing longer than the context is worth rendering.
        limits.check_prompt_characters(
            tokenizing.request_characters(request),
            chars_per_token=model.chars_per_token,
            limit=limits.input_limit(None, model.context_length),
        )
        return len((await self.tokenizers.run(prompts.render, model, request)).prompt_ids)

    async def probe_disk(
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

    def kv_budget(self, weights_bytes: int) -> int | None:
        """The most KV cache one request may need: the configured cap, else what the memory
        budget (or the machine's RAM) leaves beside the weights."""
        if self.config.max_request_kv_bytes is not None:
            return self.config.max_request_kv_bytes
        total = self.config.memory_budget_bytes or self.ram_bytes
        return max(total - weights_bytes, 0) if total else None


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
        job.max_draft, job.prediction_ids = prepared.max_draft, prepared.prediction_ids
        job.rows, job.adapter = generation.request.rows, generation.request.adapter
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
