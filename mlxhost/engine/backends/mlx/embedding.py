"""Embedding models on MLX (API-13): a BERT encoder, sentence-transformers pooling, `tokenizers`.

Why not `mlx-embeddings` (the maintained MLX loader for BERT-family models), measured on this
Linux CPU machine with mlx 0.32.4: version 0.1.0 requires `mlx-vlm`, whose install brings
datasets, pyarrow, opencv-python, scipy, pandas, fastapi, mlx-audio, sounddevice and pillow
(the virtual environment grows from about 350 MB to 1.1 GB), and `import mlx_embeddings`
imports `mlx_vlm` at module level, which took 14 s. A BERT forward pass is a hundred lines of
MLX, and the pooling is sentence-transformers' own settings, so mlxhost carries its own.
"""

from __future__ import annotations

import json
import math
import re
from array import array
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.normalization import LayerNorm
from tokenizers import Tokenizer

from mlxhost.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

# config.json `model_type`s whose weights this encoder reads (BERT's layout and names).
BERT_TYPES = frozenset({"bert"})
# sentence-transformers' pooling switches, by the mode each one turns on.
POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
}
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# sentence-transformers modules this loader runs; any other (a Dense head, ...) is refused.
KNOWN_MODULES = frozenset(
    {"sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling", NORMALIZE_MODULE}
)


# Canonical composition folds at most this many characters into one (backend.MAX_COMPOSED).
MAX_COMPOSED = 4
# Lowercasing lengthens a word at most twofold ("İ" is "i" and a combining dot): a raw run of
# non-space characters at most half the word limit never becomes a word over it.
LOWERCASE_GROWTH = 2


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BertConfig:
        names = cls.__dataclass_fields__
        return cls(**{key: value for key, value in raw.items() if key in names})


class _Embeddings(Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, ids: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None, :]
        # One segment: token type 0 everywhere, as sentence-transformers feeds single texts.
        x = (
            self.word_embeddings(ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings.weight[0]
        )
        out: mx.array = self.LayerNorm(x)
        return out


class _Dense(Module):
    """A linear layer followed by LayerNorm over a residual: BERT's `*.output` blocks."""

    def __init__(self, dims_in: int, dims_out: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(dims_in, dims_out)
        self.LayerNorm = LayerNorm(dims_out, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        out: mx.array = self.LayerNorm(self.dense(x) + residual)
        return out


class _SelfAttention(Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.query = Linear(config.hidden_size, config.hidden_size)
        self.key = Linear(config.hidden_size, config.hidden_size)
        self.value = Linear(config.hidden_size, config.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        batch, length, width = x.shape
        head_dim = width // self.heads

        def heads(t: mx.array) -> mx.array:
            return t.reshape(batch, length, self.heads, head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(head_dim), mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, width)


class _Attention(Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        setattr(self, "self", _SelfAttention(config))  # noqa: B010  # BERT's weight names say "self"
        self.output = _Dense(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        out: mx.array = self.output(self["self"](x, mask), x)
        return out


# erf as a rational function of x on [-4, 4] (Eigen's float erf; beyond, erf is +-1 in float32):
# MLX's CPU `erf` is a scalar libm call, 9x slower here than these multiply-adds, and BERT's
# exact gelu calls it on every intermediate activation. Max error 4e-7 against math.erf.
_ERF_NUMERATOR = (
    -1.60960333262415e-02,
    -2.95459980854025e-03,
    -7.34990630326855e-04,
    -5.69250639462346e-05,
    -2.10102402082508e-06,
    2.77068142495902e-08,
    -2.72614225801306e-10,
)
_ERF_DENOMINATOR = (
    -1.42647390514189e-02,
    -7.37332916720468e-03,
    -1.68282697438203e-03,
    -2.13374055278905e-04,
    -1.45660718464996e-05,
)


def _erf(x: mx.array) -> mx.array:
    x = mx.clip(x, -4.0, 4.0)
    x2 = x * x
    p = x2 * _ERF_NUMERATOR[-1] + _ERF_NUMERATOR[-2]
    for coefficient in reversed(_ERF_NUMERATOR[:-2]):
        p = p * x2 + coefficient
    q = x2 * _ERF_DENOMINATOR[-1] + _ERF_DENOMINATOR[-2]
    for coefficient in reversed(_ERF_DENOMINATOR[:-2]):
        q = q * x2 + coefficient
    return x * p / q


# Elementwise only, so one compiled kernel serves every batch shape (inputs vary in length).
@partial(mx.compile, shapeless=True)
def _gelu(x: mx.array) -> mx.array:
    """BERT's "gelu": the exact (erf) form, with the fast erf above."""
    return x * (1 + _erf(x * (1 / math.sqrt(2)))) / 2


class _Intermediate(Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        return _gelu(self.dense(x))


class _Layer(Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _Dense(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        attended = self.attention(x, mask)
        out: mx.array = self.output(self.intermediate(attended), attended)
        return out


class _Encoder(Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = [_Layer(config) for _ in range(config.num_hidden_layers)]


class Bert(Module):
    """BERT's encoder with Hugging Face's parameter names (no pooler: sentence models pool)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def __call__(self, ids: mx.array, attention: mx.array | None) -> mx.array:
        """Hidden states of padded `ids` (batch, length); `attention` is 1 on real tokens (None:
        no padding, and attention runs without a mask, its faster path)."""
        x = self.embeddings(ids)
        # Padding keys get a large negative score, so no real token attends to them.
        mask = None if attention is None else ((1.0 - attention.astype(x.dtype)) * -1e9)[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


@dataclass(frozen=True, slots=True)
class Pooling:
    """How token states become one vector (sentence-transformers' `1_Pooling/config.json`)."""

    mode: str = "mean"
    normalize: bool = True

    def __call__(self, states: mx.array, attention: mx.array) -> mx.array:
        weights = attention.astype(states.dtype)[:, :, None]
        counts = mx.maximum(weights.sum(axis=1), 1.0)
        if self.mode == "cls":
            pooled = states[:, 0, :]
        elif self.mode == "max":
            pooled = mx.where(weights > 0, states, -1e9).max(axis=1)
        else:
            pooled = (states * weights).sum(axis=1) / counts
            if self.mode == "mean_sqrt_len":
                pooled = pooled * counts / mx.sqrt(counts)
        if self.normalize:
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return pooled


class MlxEmbedder:
    """A loaded BERT sentence model; `embed` runs only on the owning worker thread."""

    shared_cache = False

    def __init__(
        self,
        model: Bert,
        tokenizer: Tokenizer,
        pooling: Pooling,
        config: BertConfig,
        max_tokens: int,
        nbytes: int,
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._pooling = pooling
        self._pad = config.pad_token_id
        self.dimensions = config.hidden_size
        self.max_tokens = max_tokens
        self._bytes = nbytes
        # WordPiece reads at most this many characters a word, and makes a longer one one [UNK].
        self._word_limit: int | None = getattr(tokenizer.model, "max_input_chars_per_word", None)
        limit = self._word_limit
        self._maybe_long = re.compile(rf"\S{{{limit // LOWERCASE_GROWTH + 1},}}") if limit else None
        longest = max((len(entry) for entry in tokenizer.get_vocab()), default=0)
        # A word of at most `limit` characters is at least one token, an [UNK] included.
        self.chars_per_token = max(longest, limit or 0) * (MAX_COMPOSED if tokenizer.normalizer else 1)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        pieces = [self._long_words_split(text) for text in texts]
        return [list(encoding.ids) for encoding in self._tokenizer.encode_batch(pieces)]

    def _long_words_split(self, text: str) -> str:
        """`text` with every word longer than WordPiece reads cut into pieces it reads (of the
        word limit each, the last shorter), each a word of its own; other text as it was. The
        cut runs on the text as the normalizer leaves it, on the words its pre-tokenizer makes
        (words split at punctuation, so a long URL is not cut); normalizing it again is a no-op."""
        limit, tokenizer = self._word_limit, self._tokenizer
        if limit is None or self._maybe_long is None or self._maybe_long.search(text) is None:
            return text
        normalized = tokenizer.normalizer.normalize_str(text) if tokenizer.normalizer else text
        words = (
            tokenizer.pre_tokenizer.pre_tokenize_str(normalized)
            if tokenizer.pre_tokenizer
            else [(normalized, (0, len(normalized)))]
        )
        spans = [(start, end) for _word, (start, end) in words if end - start > limit]
        if not spans:
            return text
        parts, last = [], 0
        for start, end in spans:
            parts.append(normalized[last:start])
            parts.append(" ".join(normalized[at : min(at + limit, end)] for at in range(start, end, limit)))
            last = end
        parts.append(normalized[last:])
        return "".join(parts)

    def embed(self, batch: Sequence[Sequence[int]]) -> list[array[float]]:
        longest = max(len(ids) for ids in batch)
        ids = np.full((len(batch), longest), self._pad, dtype=np.int32)
        attention = np.zeros((len(batch), longest), dtype=np.int32)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = tokens
            attention[row, : len(tokens)] = 1
        ids_mx, attention_mx = mx.array(ids), mx.array(attention)
        padded = bool((attention == 0).any())
        states = self._model(ids_mx, attention_mx if padded else None)
        vectors = self._pooling(states, attention_mx).astype(mx.float32)
        out = np.asarray(vectors)
        return [array("f", row.tobytes()) for row in out]

    def memory_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        self._model = None  # type: ignore[assignment]  # dropped: its arrays are freed
        mx.clear_cache()


def load_embedder(folder: Path) -> MlxEmbedder:
    """Load a BERT sentence-transformers folder (config.json, model.safetensors, tokenizer.json,
    1_Pooling/config.json, modules.json; the last two optional: mean pooling, normalised).

    Raises:
        ModelLoadError: an architecture or module this loader does not run, or unreadable files.
    """
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"config.json could not be read: {exc}") from exc
    if raw.get("model_type") not in BERT_TYPES:
        raise ModelLoadError(
            f"mlxhost embeds with BERT-family encoders; model_type {raw.get('model_type')!r} is not one."
        )
    config = BertConfig.from_dict(raw)
    pooling = _pooling(folder)
    model = Bert(config)
    weights: dict[str, mx.array] = {}
    for path in sorted(folder.glob("model*.safetensors")):
        weights.update(mx.load(str(path)))  # type: ignore[arg-type]  # safetensors: a dict of arrays
    # Names may carry a "bert." prefix (a BertForX checkpoint); the pooler and position ids are unused.
    weights = {key.removeprefix("bert."): value for key, value in weights.items()}
    kept = [
        (k, v.astype(mx.float32)) for k, v in weights.items() if k.startswith(("embeddings.", "encoder."))
    ]
    kept = [(k, v) for k, v in kept if not k.endswith("position_ids")]
    try:
        model.load_weights(kept, strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"The weights do not fit a BERT encoder: {exc}") from exc
    model.eval()
    mx.eval(model.parameters())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()  # an input over the limit is refused by index, never cut (API-14)
    tokenizer.no_padding()
    nbytes = sum(v.nbytes for _, v in kept)
    return MlxEmbedder(model, tokenizer, pooling, config, _max_tokens(folder, config), nbytes)


def _pooling(folder: Path) -> Pooling:
    modules = _read_json(folder / "modules.json", default=[])
    types = {str(m.get("type")) for m in modules if isinstance(m, dict)}
    unknown = sorted(types - KNOWN_MODULES)
    if unknown:
        raise ModelLoadError(f"sentence-transformers modules mlxhost does not run: {', '.join(unknown)}.")
    normalize = NORMALIZE_MODULE in types or not modules  # a plain BERT folder: normalised, as OpenAI's
    settings = _read_json(folder / "1_Pooling" / "config.json", default={})
    chosen = [mode for mode, key in POOLING_KEYS.items() if isinstance(settings, dict) and settings.get(key)]
    if len(chosen) > 1:
        raise ModelLoadError(f"Pooling combines {', '.join(chosen)}; mlxhost pools one way.")
    return Pooling(mode=chosen[0] if chosen else "mean", normalize=normalize)


def _max_tokens(folder: Path, config: BertConfig) -> int:
    settings = _read_json(folder / "sentence_bert_config.json", default={})
    limit = settings.get("max_seq_length") if isinstance(settings, dict) else None
    return min(int(limit), config.max_position_embeddings) if limit else config.max_position_embeddings


def _read_json(path: Path, *, default: Any) -> Any:
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path.name} could not be read: {exc}") from exc
