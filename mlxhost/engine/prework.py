"""A request's pre-work under its lane permit (LANE-3): load, check, render, count, fit.

None of it touches the KV cache: templating, tokenizing and grammar compiling run off the
loop, a few at a time (`tokenizing.TokenizePool`), and every refusal raises before the
request enters its lane.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mlxhost.engine import limits, prompts, tokenizing
from mlxhost.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from mlxhost.engine.answer import AnswerReader
    from mlxhost.engine.backends.base import LoadedModel
    from mlxhost.engine.config import EngineConfig
    from mlxhost.engine.disk import DiskEntry
    from mlxhost.engine.instance import Instance
    from mlxhost.engine.residency import Residency
    from mlxhost.engine.sessions import SessionQuery
    from mlxhost.engine.types import GenerationRequest, SamplingParams

UNLOADED_MESSAGE = "The model was unloaded while the request waited; retry."


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request after its pre-work: the prompt's token ids and its checked, fitted sampling."""

    prompt_ids: list[int]
    sampling: SamplingParams
    disk: DiskEntry | None = None  # the parent's saved KV, checked, when memory no longer holds it
    reader: AnswerReader | None = None  # reads tool calls and reasoning out of the answer


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
        if instance.state != "ready":  # the residency pass (the budget, evictions, the load)
            await self.residency.ensure_loaded(instance)
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
        return Prepared(prompt_ids, sampling, disk, reader)

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
