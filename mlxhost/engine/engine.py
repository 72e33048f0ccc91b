"""The `Engine`: owns every model instance in this process and admits requests to them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlxhost.engine.backends import make_backend
from mlxhost.engine.config import EngineConfig
from mlxhost.engine.errors import EngineClosedError, ModelLoadError, PromptTooLongError, UnknownModelError
from mlxhost.engine.generation import Generation
from mlxhost.engine.instance import Instance

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import Backend
    from mlxhost.engine.types import GenerationRequest, ModelSpec


class Engine:
    """Hosts instances keyed by instance id (REG-2: aliases of one instance share it)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        backend: Backend | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or EngineConfig()
        self.backend = backend or make_backend(self.config.backend)
        self._clock = clock
        self._instances: dict[int, Instance] = {}
        self._closed = False

    def register(self, spec: ModelSpec) -> Instance:
        """Return the instance for `spec.instance_id`, creating it (unloaded) on first sight.

        Settings that may change in place (max_input_tokens) take effect for the next request.
        """
        if self._closed:
            raise EngineClosedError("The engine is shutting down.")
        instance = self._instances.get(spec.instance_id)
        if instance is None:
            instance = Instance(spec, self.backend, self._clock)
            self._instances[spec.instance_id] = instance
        else:
            instance.spec = spec
        return instance

    def get(self, instance_id: int) -> Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise UnknownModelError(f"Instance {instance_id} is not registered.") from None

    async def load(self, spec: ModelSpec) -> Instance:
        """Register and load `spec`; returns once the weights are resident.

        Raises:
            ModelLoadError: the weights could not be loaded.
        """
        instance = self.register(spec)
        await instance.ensure_loaded()
        return instance

    async def unload(self, instance_id: int) -> None:
        await self.get(instance_id).unload()

    async def submit(self, request: GenerationRequest) -> Generation:
        """Admit `request`: load its instance if needed, render and count the prompt, queue it.

        Raises:
            ModelLoadError: the model could not be loaded.
            PromptTooLongError: the prompt exceeds the model's max_input_tokens.
            EngineClosedError: the engine is shutting down.
        """
        instance = self.register(request.model)
        instance.waiting += 1
        try:
            await instance.ensure_loaded()
            model = instance.model
            if model is None:  # unloaded between the load wait and now; the client may retry
                raise ModelLoadError("The model was unloaded while the request waited; retry.")
            if request.prompt is not None:
                prompt_ids = await asyncio.to_thread(model.encode, request.prompt)
            else:
                prompt_ids = await asyncio.to_thread(model.render_chat, request.messages)
        finally:
            instance.waiting -= 1
        limit = request.model.max_input_tokens
        if limit and len(prompt_ids) > limit:
            raise PromptTooLongError(len(prompt_ids), limit)
        generation = Generation(request, asyncio.get_running_loop())
        instance.submit(generation, prompt_ids)
        return generation

    def snapshot(self) -> list[dict[str, object]]:
        return [instance.snapshot() for instance in self._instances.values()]

    async def shutdown(self) -> None:
        self._closed = True
        timeout = self.config.shutdown_timeout_s
        await asyncio.gather(*(asyncio.to_thread(i.shutdown, timeout) for i in self._instances.values()))
