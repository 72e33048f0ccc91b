"""Quantized KV inside the continuous batch (docs/models.md, "Quantized KV cache").

mlx-lm quantizes one sequence's KV (`QuantizedKVCache`, `kv_bits` in `generate_step`), and its
attention reads quantized keys and values wherever a cache has `bits`
(`quantized_scaled_dot_product_attention`). Its batch cache (`BatchKVCache`) holds full-precision
arrays only, and `QuantizedKVCache` has no `merge`, so `mlx_lm.server` stops batching under
`--kv-bits`. What is written here, on those classes:

- `BatchQuantizedKVCache`: a `BatchKVCache` whose keys and values are mlx's quantized triples
  (packed, scales, biases). Every array operation of the parent (grow, write, roll the right
  padding away, filter rows, extend with joining rows, extract one row) runs on each part of the
  triple along the token axis; offsets, left padding, masks and trim are the parent's unchanged.
  Extending with a full-precision `BatchKVCache` (rows just prefilled) quantizes them on the way
  in; `extract` gives mlx-lm's own `QuantizedKVCache`, which the prefix cache and the disk tier
  keep as it is (`save_prompt_cache` knows it).
- Quantization runs per token and head along the head dimension, so a token's quantized values
  do not depend on the batch it ran in: a batched row matches the same row run alone through
  mlx-lm's `generate_step` with the same `kv_bits`, group size and start.
- In the batch every row is quantized from its first token: one layer of a batch has one
  cache, so rows cannot be quantized from different offsets. mlx-lm's per-sequence
  `quantized_kv_start` is honoured where a sequence runs alone (`MlxModel.generate`).
- `BatchGenerator` merges the sequence caches of rows prefilled together with the first one's
  `merge`. Rows of a quantized model enter the batch as `RowKVCache` / `RowQuantizedKVCache`
  (`batch_rows`: mlx-lm's classes, with a `merge` that builds a `BatchQuantizedKVCache`), so a
  fresh row, a full-precision cached prefix and a quantized one merge together. A quantized
  prefix is copied as it is: quantizing dequantized numbers again is not exact in mlx (a value
  may move a whole step), and a chain would drift turn after turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll

if TYPE_CHECKING:
    from mlxhost.engine.types import KVQuantization

Triple = tuple[mx.array, mx.array, mx.array]


def _quantize(x: mx.array, q: KVQuantization) -> Triple:
    return tuple(mx.quantize(x, group_size=q.group_size, bits=q.bits))  # type: ignore[return-value]


class BatchQuantizedKVCache(BatchKVCache):
    """`BatchKVCache` with quantized keys and values (module docstring)."""

    keys: Any  # (packed, scales, biases), or None while empty
    values: Any

    def __init__(self, left_padding: list[int], quantization: KVQuantization) -> None:
        super().__init__(left_padding)
        self.quantization = quantization
        self.bits = quantization.bits  # what mlx-lm's attention looks for
        self.group_size = quantization.group_size

    @classmethod
    def from_batch(cls, cache: BatchKVCache, quantization: KVQuantization) -> BatchQuantizedKVCache:
        """`cache`'s rows, quantized: the same offsets, padding and write index."""
        new = cls([], quantization)
        new.left_padding, new.offset, new._idx = cache.left_padding, cache.offset, cache._idx
        if cache.keys is not None:
            new.keys = _quantize(cache.keys[..., : cache._idx, :], quantization)
            new.values = _quantize(cache.values[..., : cache._idx, :], quantization)
        return new

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        prev, steps = self._idx, keys.shape[2]
        if self.keys is None or prev + steps > self.keys[0].shape[2]:
            grow = (self.step + steps - 1) // self.step * self.step
            new_k = _quantize(mx.zeros((*keys.shape[:2], grow, keys.shape[3]), keys.dtype), self.quantization)
            new_v = _quantize(
                mx.zeros((*values.shape[:2], grow, values.shape[3]), values.dtype), self.quantization
            )
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                kept = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                self.keys, self.values = tree_map(
                    lambda a, b: mx.concatenate([a, b], axis=2), kept, (new_k, new_v)
                )
        self.offset = self.offset + steps
        self._idx += steps
        for part, new in zip(self.keys, _quantize(keys, self.quantization), strict=True):
            part[..., prev : self._idx, :] = new
        for part, new in zip(self.values, _quantize(values, self.quantization), strict=True):
            part[..., prev : self._idx, :] = new
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))  # type: ignore[no-any-return]

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys, self.values = tree_map(
                lambda x: dynamic_roll(x, padding[:, None], axis=2), (self.keys, self.values)
            )
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        least = min(cast("list[int]", self.left_padding.tolist()))
        if least > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., least:, :], (self.keys, self.values))
            self._idx -= least
            self.left_padding -= least

    def extend(self, other: BatchKVCache) -> None:
        """Add `other`'s rows (quantized first when they are full precision), right-aligned to the
        longer of the two write indices, as the parent does."""
        if not isinstance(other, BatchQuantizedKVCache):
            other = BatchQuantizedKVCache.from_batch(other, self.quantization)
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        most = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        template = self.keys if self.keys is not None else other.keys
        vtemplate = self.values if self.values is not None else other.values

        def aligned(c: BatchQuantizedKVCache) -> tuple[Any, Any, mx.array, mx.array]:
            rows = c.offset.shape[0]
            k = c.keys or tuple(mx.zeros((rows, t.shape[1], 0, t.shape[3]), t.dtype) for t in template)
            v = c.values or tuple(mx.zeros((rows, t.shape[1], 0, t.shape[3]), t.dtype) for t in vtemplate)
            left = most - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k, v = tree_map(lambda x: x[..., :right, :], (k, v))
                right = 0
            if left or right:
                k, v = tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), (k, v))
            return k, v, c.offset, c.left_padding + left

        mine, theirs = aligned(self), aligned(other)
        self.keys, self.values = tree_map(
            lambda a, b: mx.concatenate([a, b]), (mine[0], mine[1]), (theirs[0], theirs[1])
        )
        self.offset = mx.concatenate([mine[2], theirs[2]])
        self.left_padding = mx.concatenate([mine[3], theirs[3]])
        self._idx = most

    def extract(self, idx: int) -> QuantizedKVCache:
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        padding = cast("list[int]", self.left_padding.tolist())[idx]
        cache.keys, cache.values = tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]), (self.keys, self.values)
        )
        cache.offset = self._idx - padding
        return cache

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """Rows of sequence caches, left-padded to the longest, quantized where they are not."""
        quantization = caches[0].quantization
        lengths = [int(c.offset) for c in caches]
        most = max(lengths)
        batch = cls([most - n for n in lengths], quantization)
        if most == 0:
            return batch
        parts: list[tuple[Triple, Triple] | None] = [_row_parts(c, quantization) for c in caches]
        sample = next(p for p in parts if p is not None)

        def padded(row: tuple[Triple, Triple] | None, pad: int) -> tuple[Triple, Triple]:
            if row is None:
                return tree_map(lambda t: mx.zeros((1, *t.shape[1:2], most, t.shape[3]), t.dtype), sample)  # type: ignore[no-any-return]
            return tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (pad, 0), (0, 0)]), row)  # type: ignore[no-any-return]

        rows = [padded(p, most - n) for p, n in zip(parts, lengths, strict=True)]
        batch.keys, batch.values = tree_map(lambda *xs: mx.concatenate(list(xs)), *rows)
        batch.offset = batch.offset + most
        batch._idx = most
        return batch


def _row_parts(cache: Any, quantization: KVQuantization) -> tuple[Triple, Triple] | None:
    """One sequence cache's keys and values as quantized triples of exactly its tokens."""
    if cache.keys is None or int(cache.offset) == 0:
        return None
    n = int(cache.offset)
    if isinstance(cache, QuantizedKVCache):
        if (cache.bits, cache.group_size) != (quantization.bits, quantization.group_size):
            raise ValueError("a cached prefix of another KV format cannot join this batch")
        return tree_map(lambda x: x[..., :n, :], (cache.keys, cache.values))  # type: ignore[no-any-return]
    return _quantize(cache.keys[..., :n, :], quantization), _quantize(cache.values[..., :n, :], quantization)


class RowKVCache(KVCache):
    """mlx-lm's `KVCache` of a row entering a quantized batch: it merges into one."""

    quantization: KVQuantization
    merge = classmethod(lambda cls, caches: BatchQuantizedKVCache.merge(caches))


class RowQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's `QuantizedKVCache` of a row entering a quantized batch: it merges into one."""

    quantization: KVQuantization
    merge = classmethod(lambda cls, caches: BatchQuantizedKVCache.merge(caches))


def batch_rows(layers: list[Any], quantization: KVQuantization) -> list[Any]:
    """A row's sequence caches, ready to merge into a quantized batch (module docstring): the same
    objects, their class set to the mergeable subclass (which adds no state)."""
    for layer in layers:
        if type(layer) is KVCache:
            layer.__class__ = RowKVCache
        elif type(layer) is QuantizedKVCache:
            layer.__class__ = RowQuantizedKVCache
        elif not isinstance(layer, (RowKVCache, RowQuantizedKVCache)):
            raise ValueError(f"{type(layer).__name__} cannot join a quantized batch")
        layer.quantization = quantization
    return layers
