"""Vision-language models through mlx-vlm (issue 29): its load and processor, images into the
prompt's tokens, and its `stream_generate`, one request at a time on the worker thread.

mlx-vlm is the optional vision extra: this module is imported only when a vision model loads
(`MlxBackend.load` for `kind == "vision"`), so the app without it never imports mlx_vlm.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_vlm.generate import stream_generate as vlm_stream_generate
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.utils import load as vlm_load
from PIL import Image as PILImage

from mlxhost.engine.backends.base import StepEnd, TokenStep
from mlxhost.engine.backends.mlx.backend import MlxModel
from mlxhost.engine.backends.mlx.batch import (
    PREFILL_STEP_ALONE,
    make_processors,
    make_request_sampler,
    with_context,
)
from mlxhost.engine.backends.mlx.detokenizer import ExactDetokenizer, spelled
from mlxhost.engine.errors import ModelLoadError
from mlxhost.engine.structure import template_messages, template_tools

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from pathlib import Path

    from mlxhost.engine.backends.base import DraftCounts
    from mlxhost.engine.types import AdapterRef, Image, Message, SamplingParams, Tool

# The model types mlx-vlm ships that this backend has been run with (docs/models.md); other
# mlx-vlm architectures are detected as vision (weights.py) and may load, untested here.
TESTED_MODEL_TYPES = ("llava",)


class MlxVisionModel(MlxModel):
    """A loaded mlx-vlm model and its processor. Reuses `MlxModel`'s tokenizer-side parts (the
    vocabulary, grammars, logprobs, cache handling) through mlx-lm's tokenizer wrapper of the same
    folder; generation goes through mlx-vlm. Never batched: `open_batch` is None (capacity 1)."""

    def __init__(self, model: Any, processor: Any, tokenizer: Any, path: Path) -> None:
        super().__init__(model, tokenizer, path)
        self._processor = processor
        self._features = _Features()
        text_config = getattr(model.config, "text_config", None)
        self.context_length = getattr(text_config, "max_position_embeddings", None)

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] = (),
        options: dict[str, object] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """The template's text with an image part where each image goes, then the processor's
        tokens: each image's placeholder expanded to as many tokens as the model reads for it."""
        chat = template_messages(tuple(messages))
        for item, message in zip(chat, messages, strict=True):
            if message.images:
                parts = [{"type": "image"} for _ in message.images]
                item["content"] = [*parts, {"type": "text", "text": message.content}]
        text = self._tokenizer.apply_chat_template(
            chat,
            tools=template_tools(tuple(tools)) or None,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            tokenize=False,
            **(options or {}),
        )
        images = [image for message in messages for image in message.images]
        if not images:
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        # The processor itself (text and images, no other keyword: transformers 5 refuses
        # tokenizer keywords in an image processor's), as mlx-vlm's LLaVA path needs.
        inputs = self._processor(text=[text], images=[_pil(image) for image in images])
        features = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        self._features.put(_key(images), features)
        return [int(i) for i in np.array(inputs["input_ids"]).reshape(-1)]

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        kv: object,
        *,
        context: Sequence[int] = (),
        max_draft: int = 0,
        counts: DraftCounts | None = None,
        adapter: AdapterRef | None = None,
        images: Sequence[Image] = (),
    ) -> Iterator[TokenStep | StepEnd]:
        # A vision model neither drafts (`max_draft`, `counts`: no draft model runs here) nor
        # takes LoRA adapters yet.
        if adapter is not None:
            raise ValueError("A vision model takes no LoRA adapter here.")
        if context and images:
            raise ValueError("A prompt with images is never continued from a cached prefix.")
        extra: dict[str, Any] = {}
        if images:  # the features the render made, else the image processor's again
            extra = self._features.get(_key(images)) or {
                key: mx.array(np.asarray(value))
                for key, value in self._processor.image_processor([_pil(i) for i in images]).items()
            }
        processors = make_processors(sampling, self.vocabulary)
        if context:  # a cached prefix: the penalties look back over it too, as `MlxModel.generate`
            processors = [with_context(p, context) for p in processors]
        responses = vlm_stream_generate(
            self._model,
            self._processor,
            "",
            input_ids=mx.array([prompt_ids]),
            pixel_values=extra.pop("pixel_values", None),
            mask=None,
            max_tokens=sampling.max_tokens,
            sampler=make_request_sampler(sampling),
            logits_processors=processors,
            prompt_cache=kv,
            **extra,
        )
        top = sampling.logprobs
        detokenizer = ExactDetokenizer(self._tokenizer, [*context, *prompt_ids])
        try:
            for response in responses:
                token = int(response.token or 0)
                logprob = (
                    None
                    if top is None
                    else self.vocabulary.logprob(cast("mx.array", response.logprobs), token, top)
                )
                if response.finish_reason is None:
                    text = detokenizer.add_token(token)
                    yield TokenStep(text, token, spelled(logprob, text))
                    continue
                # mlx-vlm's last response repeats the last token ("length") or carries the EOS
                # ("stop"): every generated token was yielded before it.
                yield StepEnd(text=detokenizer.finalize(), finish_reason=response.finish_reason)
                return
        finally:
            responses.close()

    def new_cache(self) -> list[Any]:
        return list(vlm_cache.make_prompt_cache(self._model.language_model))

    def prefill(
        self, kv: object | None, token_ids: Sequence[int], adapter: AdapterRef | None = None
    ) -> list[Any]:
        layers: list[Any] = self.new_cache() if kv is None else kv  # type: ignore[assignment]
        for start in range(0, len(token_ids), PREFILL_STEP_ALONE):
            chunk = mx.array(list(token_ids[start : start + PREFILL_STEP_ALONE]), dtype=mx.uint32)
            self._model.language_model(chunk[None], cache=layers)
            mx.eval([layer.state for layer in layers])
        return layers

    def can_batch(self) -> bool:
        return False  # mlx-vlm rows are not batched here yet (docs/models.md): capacity 1

    def open_batch(self, capacity: int, *, speculation: bool = False) -> None:
        return None


class _Features:
    """The image features (pixel values, ...) the last few renders made, by their images' digests,
    so generation does not run the image processor again (a render runs on a tokenizing thread,
    generation on the worker: hence the lock)."""

    KEEP = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, ...], dict[str, Any]] = OrderedDict()

    def put(self, key: tuple[str, ...], features: dict[str, Any]) -> None:
        with self._lock:
            self._entries[key] = features
            self._entries.move_to_end(key)
            while len(self._entries) > self.KEEP:
                self._entries.popitem(last=False)

    def get(self, key: tuple[str, ...]) -> dict[str, Any] | None:
        with self._lock:
            features = self._entries.get(key)
        return dict(features) if features is not None else None


def _key(images: Sequence[Image]) -> tuple[str, ...]:
    return tuple(image.digest for image in images)


def load_vision(path: Path) -> MlxVisionModel:
    """mlx-vlm's model and processor from a local folder, and mlx-lm's tokenizer wrapper of it.

    Raises:
        ModelLoadError: mlx-vlm could not load the folder.
    """
    try:
        model, processor = vlm_load(str(path))
        eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
        tokenizer = load_tokenizer(path, eos_token_ids=eos)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"mlx-vlm could not load the model: {exc}") from exc
    return MlxVisionModel(model, processor, tokenizer, path)


def _pil(image: Image) -> PILImage.Image:
    """A decoded image (RGB pixels, `images.decode_image`) as the processors take it."""
    if not image.decoded:
        raise ValueError(f"{image.param}: the image was not decoded before generation.")
    return PILImage.frombytes("RGB", (image.width, image.height), image.pixels)
