"""The real backend: mlx-lm load, chat templates and `stream_generate`, run on the worker thread."""

from __future__ import annotations

import atexit
import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import stream_generate
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import (
    KVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from mlxhost.engine.backends.base import DraftCounts, ProgressCallback, StepEnd, TokenStep
from mlxhost.engine.backends.mlx.adapters import AdapterBank
from mlxhost.engine.backends.mlx.batch import (
    PREFILL_STEP_ALONE,
    MlxBatch,
    make_processors,
    make_request_sampler,
    reseed_global_random,
    with_context,
)
from mlxhost.engine.backends.mlx.detokenizer import ExactDetokenizer, spelled
from mlxhost.engine.backends.mlx.draft_model import (
    DraftCost,
    DraftModelRows,
    SinglePasses,
    check_draft,
    prefill_draft,
    weight_bytes,
)
from mlxhost.engine.backends.mlx.drafting import SpeculationConfig
from mlxhost.engine.backends.mlx.embedding import MlxEmbedder, load_embedder
from mlxhost.engine.backends.mlx.folders import download, load_folder, read_with_progress
from mlxhost.engine.backends.mlx.grammar import (
    MlxSplitter,
    Vocabulary,
    splitter_for,
    state_machine,
    tool_markers,
)
from mlxhost.engine.errors import ModelLoadError
from mlxhost.engine.structure import template_messages, template_tools
from mlxhost.engine.weights import validate_model_folder

# Tokens the single-stream scheduler drafts per step with a draft model: mlx_lm.server's default
# (`--num-draft-tokens 3`); mlx-lm's `speculative_generate_step` does not adapt it.
NUM_DRAFT_TOKENS = 3

# The main thread's streams too, before the interpreter finalizes (see `thread_exit`).
atexit.register(mx.clear_streams)

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from mlxhost.engine.types import (
        AdapterRef,
        Grammar,
        Image,
        KVQuantization,
        Message,
        ModelSpec,
        SamplingParams,
        Tool,
    )


# Canonical composition (NFC, NFKC) folds at most this many characters into one: no canonical
# decomposition in Unicode is longer (Hangul syllables take three jamo).
MAX_COMPOSED = 4


def chars_per_token(tokenizer: Any) -> int:
    """The most characters of text one token of this Hugging Face tokenizer may cover: its
    longest vocabulary entry, added tokens included (a byte-level entry has one character per
    byte, and a character is at least one byte), times `MAX_COMPOSED` when a normalizer may
    compose characters first (slow tokenizers: SentencePiece normalizes with NFKC)."""
    vocab = tokenizer.get_vocab()
    longest = max((len(entry) for entry in vocab), default=0)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    composes = backend is None or backend.normalizer is not None
    return longest * (MAX_COMPOSED if composes else 1)


class MlxModel:
    """A loaded mlx-lm model and tokenizer; `generate` runs only on the owning worker thread."""

    shared_cache = False  # every request gets its own prompt cache object

    def __init__(
        self, model: Any, tokenizer: Any, path: Path, kv_quantization: KVQuantization | None = None
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self.path = path
        # The KV cache format (quantized_kv.py): None keeps full precision.
        self.kv_quantization = kv_quantization
        self.adapters = AdapterBank(model)  # LoRA adapters on these weights, loaded on first use (issue 28)
        self._bytes = sum(p.stat().st_size for p in path.glob("model*.safetensors"))
        args = getattr(model, "args", None)
        self.vocab_size = int(getattr(args, "vocab_size", 0) or len(tokenizer.vocab))
        self.context_length: int | None = getattr(args, "max_position_embeddings", None)
        self.kv_bytes_per_token = _kv_bytes_per_token(model, kv_quantization)
        self.chars_per_token = chars_per_token(tokenizer._tokenizer)
        # mlx-lm's tokenizer wrapper knows the template's tool format and thinking markers.
        self.knows_tools = bool(tokenizer.has_tool_calling and tokenizer.tool_parser is not None)
        self._markers = state_machine(tokenizer)
        self.vocabulary = Vocabulary(tokenizer, self.vocab_size)
        self._tool_markers: tuple[tuple[str, str] | None] | None = None
        # The draft model (speculative decoding, docs/speculation.md), loaded with this one.
        self.draft: Any | None = None
        self._draft_bytes = 0

    def attach_draft(self, draft: Any, tokenizer: Any, path: Path) -> None:
        """Draft with `draft` (its tokenizer checked against this model's).

        Raises:
            DraftMismatchError: another vocabulary, or a cache that cannot roll back.
        """
        check_draft(self._tokenizer, draft, tokenizer)
        self.draft = draft
        self._draft_bytes = sum(p.stat().st_size for p in path.glob("model*.safetensors"))

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] = (),
        options: dict[str, object] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        chat = template_messages(tuple(messages))
        ids = self._tokenizer.apply_chat_template(
            chat,
            tools=template_tools(tuple(tools)) or None,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            tokenize=True,
            **(options or {}),
        )
        # transformers 5 may return a BatchEncoding-like mapping instead of a list.
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def encode_output(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def splitter(self, prompt_ids: Sequence[int]) -> MlxSplitter | None:
        return splitter_for(self._tokenizer, self._markers, prompt_ids)

    @property
    def tool_markers(self) -> tuple[str, str] | None:
        if self._tool_markers is None:  # needs llguidance's tokenizer: built on first use
            self._tool_markers = (tool_markers(self._tokenizer, self.vocabulary),)
        return self._tool_markers[0]

    def check_grammar(self, grammar: Grammar, param: str) -> None:
        self.vocabulary.check(grammar, param)  # compiled and walked here, off the worker, and cached

    def new_cache(self) -> list[Any]:
        return make_prompt_cache(self._model)

    def trim_cache(self, kv: object, n: int) -> None:
        layers = _layers(kv)
        if n and not can_trim_prompt_cache(layers):
            raise ValueError("This model's cache cannot be trimmed.")
        if n:
            trim_prompt_cache(layers, n)

    def copy_cache(self, kv: object, n: int) -> list[Any] | None:
        layers = _layers(kv)
        if all(type(layer) is KVCache for layer in layers):
            # New slices of the same buffers: MLX copies on the first write (a slice is never
            # donated), so the cached entry stays exactly as it was, at no cost until then.
            return [_kv_prefix(layer, n) for layer in layers]
        copied = copy.deepcopy(layers)  # other cache kinds (rotating, recurrent): as mlx-lm's server does
        extra = self.cache_length(copied) - n
        if extra and not can_trim_prompt_cache(copied):
            return None
        if extra:
            trim_prompt_cache(copied, extra)
        return copied

    def prefill(
        self, kv: object | None, token_ids: Sequence[int], adapter: AdapterRef | None = None
    ) -> list[Any]:
        # As mlx-lm's generate_step feeds a prompt: in chunks, each evaluated before the next.
        layers = make_prompt_cache(self._model) if kv is None else _layers(kv)
        self.adapters.select([self.adapters.slot(adapter)])
        with mx.stream(generation_stream):
            for start in range(0, len(token_ids), PREFILL_STEP_ALONE):
                chunk = mx.array(list(token_ids[start : start + PREFILL_STEP_ALONE]), dtype=mx.uint32)
                self._model(chunk[None], cache=layers)
                mx.eval([layer.state for layer in layers])
        return layers

    def save_cache(self, kv: object, path: Path) -> None:
        # Slices of exactly the tokens held: the padding past them is never written.
        layers = self.copy_cache(kv, self.cache_length(kv)) or _layers(kv)
        save_prompt_cache(str(path), layers, metadata={"writer": "mlxhost"})

    def load_cache(self, path: Path) -> list[Any]:
        return cast("list[Any]", load_prompt_cache(str(path)))

    def cache_length(self, kv: object) -> int:
        layers = _layers(kv)
        return int(layers[0].offset) if layers else 0

    def cache_nbytes(self, kv: object) -> int:
        return sum(int(layer.nbytes) for layer in _layers(kv))

    def dispose_cache(self, kv: object) -> None:
        kv.clear()  # type: ignore[attr-defined]  # a list of mlx-lm caches, typed `object` at the seam; dropping the arrays frees them

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
        if images:
            raise ValueError("This model reads no images (kind chat).")
        slot = self.adapters.slot(adapter)  # InvalidAdapterError: it will not load
        self.adapters.hold(slot, 1)
        try:
            self.adapters.select([slot])  # one stream: every pass of it under this adapter
            yield from self._generate(prompt_ids, sampling, kv, context, max_draft, counts)
        finally:
            self.adapters.hold(slot, -1)

    def _generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        kv: object,
        context: Sequence[int],
        max_draft: int,
        counts: DraftCounts | None,
    ) -> Iterator[TokenStep | StepEnd]:
        sampler = make_request_sampler(sampling)
        processors = make_processors(sampling, self.vocabulary)
        top = sampling.logprobs
        eos = set(self._tokenizer.eos_token_ids)
        everything = [*context, *prompt_ids]
        # A seeded sampled request runs plain: mlx-lm samples every position of a verify pass in
        # one call, which would consume its key otherwise than one token at a time.
        seeded = sampling.seed is not None and sampling.temperature != 0
        draft = self.draft if max_draft > 0 and sampling.grammar is None and not seeded else None
        options: dict[str, Any] = {"prompt_cache": kv}
        if draft is not None:
            # mlx-lm's speculative_generate_step: the draft's cache follows the target's in one
            # list; the cached prefix is prefilled into it here (mlx-lm prefills the rest). Its
            # processors see only the prompt's last token onwards: the rest is their context.
            options = {
                "draft_model": draft,
                "num_draft_tokens": min(max_draft, NUM_DRAFT_TOKENS),
                "prompt_cache": [*_layers(kv), *prefill_draft(draft, context)],
            }
            context = [*context, *prompt_ids[:-1]]
        if context:
            processors = [with_context(p, context) for p in processors]
        responses = stream_generate(
            self._model,
            self._tokenizer,
            prompt_ids,
            max_tokens=sampling.max_tokens,
            sampler=sampler,
            logits_processors=processors,
            **options,
            **self._kv_arguments(),
        )
        # mlx-lm's `response.text` drops the first token's leading space: the text is ours.
        detokenizer = ExactDetokenizer(self._tokenizer, everything)
        passes = SinglePasses(counts, options.get("num_draft_tokens", 0), sampling.max_tokens)
        try:
            for response in responses:
                passes.add(response.from_draft)
                token = int(response.token)
                logprob = None if top is None else self.vocabulary.logprob(response.logprobs, token, top)
                if response.finish_reason is None:
                    text = detokenizer.add_token(token)
                    yield TokenStep(text, token, spelled(logprob, text))
                    continue
                # The last response carries either the EOS token (not text) or the final token.
                if response.finish_reason == "length" and token not in eos:
                    text = detokenizer.add_token(token) + detokenizer.finalize()
                    yield TokenStep(text, token, spelled(logprob, text))
                    yield StepEnd(text="", finish_reason=response.finish_reason)
                else:
                    yield StepEnd(text=detokenizer.finalize(), finish_reason=response.finish_reason)
                return
        finally:
            responses.close()

    def _kv_arguments(self) -> dict[str, Any]:
        """mlx-lm's own KV quantization for a sequence run alone (`generate_step`)."""
        q = self.kv_quantization
        if q is None:
            return {}
        return {"kv_bits": q.bits, "kv_group_size": q.group_size, "quantized_kv_start": q.start}

    def can_batch(self) -> bool:
        """Whether this model's cache can merge sequences (mlx-lm's batch needs `merge`)."""
        return self._model is not None and all(
            hasattr(layer, "merge") for layer in make_prompt_cache(self._model)
        )

    def open_batch(self, capacity: int, *, speculation: bool = False) -> MlxBatch | None:
        """A `BatchGenerator` of `capacity` sequences; None when the cache cannot merge (no batching)."""
        if self._model is None or not self.can_batch():
            return None
        draft = None
        if speculation and self.draft is not None:
            share = weight_bytes(self.draft) / max(1, weight_bytes(self._model))
            draft = DraftModelRows(self.draft, DraftCost(share))
        return MlxBatch(
            self._model,
            self._tokenizer,
            capacity,
            vocabulary=self.vocabulary,
            speculation=SpeculationConfig() if speculation else None,
            kv_quantization=self.kv_quantization,
            draft=draft,
            adapters=self.adapters,
        )

    def memory_bytes(self) -> int:
        return self._bytes + self._draft_bytes + self.adapters.nbytes()

    def recover(self) -> None:
        """After a failure: a fresh global random state and no cached buffers."""
        reseed_global_random()
        mx.clear_cache()

    def close(self) -> None:
        self._model = None
        self.draft = None
        mx.clear_cache()


def _layers(kv: object) -> list[Any]:
    # The engine holds caches as opaque objects; here they are mlx-lm's per-layer lists.
    return cast("list[Any]", kv)


def _kv_prefix(layer: KVCache, n: int) -> KVCache:
    prefix = KVCache()
    keys, values = layer.keys, layer.values
    if n and keys is not None and values is not None:
        prefix.keys, prefix.values, prefix.offset = keys[..., :n, :], values[..., :n, :], n
    return prefix


def check_kv_quantization(model: Any, quantization: KVQuantization) -> None:
    """Whether this model's KV can take the format: mlx quantizes groups along the head dimension.

    Raises:
        ModelLoadError: the head dimension is not a multiple of the group size, or the cache is
            not mlx-lm's plain KV cache (rotating, recurrent caches have no quantized form here).
    """
    args: Any = getattr(model, "args", None)
    heads = int(getattr(args, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(args, "head_dim", None) or (args.hidden_size // heads if heads else 0))
    if not head_dim or head_dim % quantization.group_size:
        raise ModelLoadError(
            f"KV quantization needs a head dimension divisible by the group size: this model's is "
            f"{head_dim or 'unknown'}, the group size {quantization.group_size}. Choose another group size."
        )
    if not all(type(layer) is KVCache for layer in make_prompt_cache(model)):
        raise ModelLoadError("This model's cache cannot be quantized (only plain KV caches can).")


def _kv_bytes_per_token(model: Any, quantization: KVQuantization | None = None) -> int:
    """Keys and values of one token across the layers, in the activations' dtype (quantized: its
    bits plus a scale and a bias per group); 0 if unknown."""
    args: Any = getattr(model, "args", None)
    try:
        heads = int(args.num_attention_heads)
        kv_heads = int(getattr(args, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(args, "head_dim", None) or args.hidden_size // heads)
        layers = len(model.layers)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return 0
    weights = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    floats = [v.dtype for _, v in weights if mx.issubdtype(v.dtype, mx.floating)]
    itemsize = floats[0].size if floats else 4
    per_element = quantization.bytes_per_element(itemsize) if quantization is not None else itemsize
    return round(2 * layers * kv_heads * head_dim * per_element)


class MlxBackend:
    name = "mlx"

    @staticmethod
    def thread_exit() -> None:
        """Destroy the streams MLX made for the calling thread; a worker runs this as it ends.

        MLX (0.32) no longer cleans up a thread's streams by itself: a process whose threads
        skipped this can abort at exit ("terminate called without an active exception").
        """
        mx.clear_streams()

    @staticmethod
    def memory() -> dict[str, int]:
        """MLX's live array bytes and its cache of freed buffers (issue 25)."""
        return {"active": int(mx.get_active_memory()), "cache": int(mx.get_cache_memory())}

    @staticmethod
    def release_memory() -> None:
        """Empty MLX's cache of freed buffers (the engine does it at idle)."""
        mx.clear_cache()

    @staticmethod
    def set_cache_limit(limit: int) -> None:
        """Bound MLX's cache of freed buffers to `limit` bytes (process-wide)."""
        mx.set_cache_limit(limit)

    def load(self, spec: ModelSpec, progress: ProgressCallback) -> MlxModel:
        """Load a local folder (validated first) or a Hugging Face repo id at a pinned revision.

        Raises:
            ModelLoadError: the folder is unsafe or incomplete, or the hub cannot be reached.
        """
        path, model, tokenizer = load_folder(spec, progress)
        if spec.kv_quantization is not None:
            check_kv_quantization(model, spec.kv_quantization)
        loaded = MlxModel(model, tokenizer, path, spec.kv_quantization)
        if spec.draft is not None:  # speculative decoding: loaded, checked and freed with it
            draft_path, draft, draft_tokenizer = load_folder(spec.draft, progress, "draft model")
            loaded.attach_draft(draft, draft_tokenizer, draft_path)
        return loaded

    def load_embedder(self, spec: ModelSpec, progress: ProgressCallback) -> MlxEmbedder:
        """Load an embedding model (API-13) from a local folder or a pinned hub revision.

        Raises:
            ModelLoadError: the folder is unsafe or incomplete, or not an encoder this loader runs.
        """
        path = Path(spec.source)
        if not path.is_absolute():
            path = download(spec.source, spec.revision, progress)
        validate_model_folder(path)
        read_with_progress(path, progress)
        progress(0, 0, "", "build")
        try:
            return load_embedder(path)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"The embedding model could not be loaded: {exc}") from exc
