"""Quantized KV inside the MLX batch (issue 28 §3): `BatchQuantizedKVCache` and `MlxBatch` with a
`KVQuantization`, on a tiny random llama whose head dimension (32) takes mlx's group sizes.

The cache operations are checked against mlx-lm's own `BatchKVCache` on the same numbers:
quantization runs per token and head, so quantizing after an operation (grow, roll, filter,
extend, extract) must equal the operation on the quantized cache, exactly. The batch is then
checked for what a server needs: rows of different lengths give the same tokens batched as
alone, the decoding batch holds quantized KV and its rows end with mlx-lm's `QuantizedKVCache`
(fewer bytes, counted as they are), and a quantized prefix is reused, saved and loaded. Alone,
the model is mlx-lm's `generate_step` with `kv_bits` and its start offset.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from mlxhost.engine import KVQuantization, ModelSpec, SamplingParams
from mlxhost.engine.backends.mlx.backend import MlxBackend, MlxModel
from mlxhost.engine.backends.mlx.batch import MlxBatch
from mlxhost.engine.backends.mlx.quantized_kv import BatchQuantizedKVCache, batch_rows
from mlxhost.engine.backends.mlx.tiny import build_random_llama

pytestmark = pytest.mark.timeout(300)

Q8 = KVQuantization(bits=8, group_size=32)
Q4 = KVQuantization(bits=4, group_size=32)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> MlxModel:
    folder = build_random_llama(
        tmp_path_factory.mktemp("qkv") / "llama-hd32",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        seed=3,
    )
    return MlxBackend().load(ModelSpec(1, str(folder), "f" * 64), lambda *_: None)


def batch_of(rows: list[int], seed: int = 0) -> BatchKVCache:
    """A full-precision batch cache of rows of these lengths (left-padded, as mlx-lm merges)."""
    mx.random.seed(seed)
    caches = []
    for n in rows:
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 32)), mx.random.normal((1, 2, n, 32)))
        caches.append(c)
    return BatchKVCache.merge(caches)


def dq(parts: Any, q: KVQuantization) -> mx.array:
    return mx.dequantize(*parts, group_size=q.group_size, bits=q.bits)


def same_numbers(quantized: BatchQuantizedKVCache, reference: BatchKVCache, q: KVQuantization) -> None:
    """`quantized` holds exactly `reference` quantized: the same rows, padding and values."""
    assert quantized._idx == reference._idx
    assert quantized.offset.tolist() == reference.offset.tolist()
    assert quantized.left_padding.tolist() == reference.left_padding.tolist()
    keys, values = quantized.keys_and_values()
    ref_keys, ref_values = reference.keys_and_values()
    for got, ref in ((keys, ref_keys), (values, ref_values)):
        assert mx.array_equal(dq(got, q), dq(mx.quantize(ref, group_size=q.group_size, bits=q.bits), q))


@pytest.mark.parametrize("q", [Q8, Q4], ids=["8-bit", "4-bit"])
def test_every_cache_operation_equals_the_full_precision_one_quantized(q):
    reference = batch_of([5, 9, 2])
    quantized = BatchQuantizedKVCache.from_batch(reference, q)
    same_numbers(quantized, reference, q)
    step = (mx.random.normal((3, 2, 1, 32)), mx.random.normal((3, 2, 1, 32)))
    reference.update_and_fetch(*step)
    quantized.update_and_fetch(*step)
    same_numbers(quantized, reference, q)
    # Past the first 256-token block: both grow.
    wide = (mx.random.normal((3, 2, 300, 32)), mx.random.normal((3, 2, 300, 32)))
    reference.update_and_fetch(*wide)
    quantized.update_and_fetch(*wide)
    same_numbers(quantized, reference, q)
    # Speculation's rollback: trim, then roll each row's rejected positions into left padding.
    for cache in (reference, quantized):
        cache.trim(3)
        cache._right_padding = mx.array([0, 2, 1])
        cache.finalize()
    same_numbers(quantized, reference, q)
    for cache in (reference, quantized):
        cache.filter([0, 2])
    same_numbers(quantized, reference, q)
    joining = batch_of([7, 400], seed=1)
    reference.extend(joining)
    quantized.extend(joining)  # full-precision rows quantized on the way in
    same_numbers(quantized, reference, q)
    for row in range(4):
        one, ref = quantized.extract(row), reference.extract(row)
        assert type(one) is QuantizedKVCache and one.offset == ref.offset
        keys, _ = one.keys_and_values()
        assert mx.array_equal(dq(keys, q), dq(mx.quantize(ref.keys[..., : ref.offset, :], 32, q.bits), q))
    assert quantized.nbytes < reference.nbytes * (q.bits / 8 + 2 * 4 / 32) / 4 * 1.1


def test_rows_merge_into_one_quantized_batch_and_a_quantized_prefix_is_copied_as_it_is():
    """A fresh row, a full-precision prefix and a quantized one merge (whichever comes first); the
    quantized prefix's packed numbers are the batch's, bit for bit: never dequantized and
    quantized again (which may move a value a whole step, turn after turn)."""
    quantized_row = BatchQuantizedKVCache.from_batch(batch_of([6]), Q4).extract(0)
    full_row = batch_of([4], seed=2).extract(0)
    for order in ([KVCache(), full_row, quantized_row], [quantized_row, KVCache(), full_row]):
        rows = [batch_rows([c], Q4)[0] for c in order]
        merged = type(rows[0]).merge(rows)
        assert type(merged) is BatchQuantizedKVCache
        assert merged.left_padding.tolist() == [6 - int(c.offset) for c in order]
        back = merged.extract(order.index(quantized_row))
        for got, kept in zip(back.keys, quantized_row.keys, strict=True):
            assert mx.array_equal(got, kept[..., :6, :])
        again = merged.extract(order.index(full_row))
        expected = mx.quantize(full_row.keys[..., :4, :], group_size=32, bits=4)
        assert all(mx.array_equal(a, b) for a, b in zip(again.keys, expected, strict=True))


def test_a_cache_of_another_format_or_kind_cannot_join():
    other = BatchQuantizedKVCache.from_batch(batch_of([3]), Q8).extract(0)
    with pytest.raises(ValueError, match="another KV format"):
        BatchQuantizedKVCache.merge(batch_rows([KVCache(), other], Q4))
    with pytest.raises(ValueError, match="cannot join"):
        batch_rows([object()], Q4)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=((0, -100.0),))


def drive(batch: MlxBatch, requests: list[tuple[list[int], Any, int]], max_tokens: int = 16):
    handles = [batch.insert(prompt, greedy(max_tokens), kv, cached) for prompt, kv, cached in requests]
    ids: dict[int, list[int]] = {h: [] for h in handles}
    caches: dict[int, Any] = {}
    kinds: set[type] = set()
    while len(caches) < len(handles):
        for step in batch.step():
            if step.token_id is not None:
                ids[step.handle].append(step.token_id)
            if step.finish_reason is not None:
                caches[step.handle] = step.cache
        kinds |= {type(c) for c in batch._generator._generation_batch.prompt_cache}
    batch.close()
    return [ids[h] for h in handles], [caches[h] for h in handles], kinds


def open_batch(model: MlxModel, capacity: int, q: KVQuantization | None) -> MlxBatch:
    return MlxBatch(model._model, model._tokenizer, capacity, vocabulary=model.vocabulary, kv_quantization=q)


PROMPTS = [list(range(3, 40)), list(range(50, 61)), [7, 8, 9, 10, 11, 12] * 9]


def test_rows_give_the_same_tokens_batched_as_alone_and_end_with_quantized_kv(model):
    together, caches, kinds = drive(open_batch(model, 4, Q8), [(p, None, 0) for p in PROMPTS])
    assert BatchQuantizedKVCache in kinds  # the decoding batch held quantized KV
    alone = [drive(open_batch(model, 1, Q8), [(p, None, 0)])[0][0] for p in PROMPTS]
    assert together == alone
    full, full_caches, full_kinds = drive(open_batch(model, 4, None), [(p, None, 0) for p in PROMPTS])
    assert full_kinds == {BatchKVCache}
    for cache, full_cache in zip(caches, full_caches, strict=True):
        assert all(type(layer) is QuantizedKVCache for layer in cache.kv)
        assert model.cache_length(cache.kv) == len(cache.tokens)  # holds exactly its tokens
        assert model.cache_nbytes(cache.kv) < 0.4 * model.cache_nbytes(full_cache.kv)  # 8-bit of float32
    assert len(full) == len(together)


def test_a_quantized_prefix_is_reused_saved_and_loaded(model, tmp_path):
    _, (cache,), _ = drive(open_batch(model, 2, Q4), [(PROMPTS[0], None, 0)])
    history = list(cache.tokens)
    follow_up = [*history, 5, 6, 7]
    path = tmp_path / "kv.safetensors"
    model.save_cache(cache.kv, path)
    loaded = model.load_cache(path)
    assert all(type(layer) is QuantizedKVCache for layer in loaded)
    assert model.cache_length(loaded) == len(history)
    warm, _, _ = drive(
        open_batch(model, 2, Q4), [(follow_up, model.copy_cache(cache.kv, len(history)), len(history))]
    )
    from_disk, _, _ = drive(open_batch(model, 2, Q4), [(follow_up, loaded, len(history))])
    assert warm == from_disk and len(warm[0]) == 16


def test_alone_the_model_quantizes_from_the_start_offset_as_mlx_lm_does(model):
    """The single-stream path is mlx-lm's `generate_step` with `kv_bits`: a sequence stays in full
    precision until it holds `start` tokens, then its cache is quantized."""
    for start, kind in ((0, QuantizedKVCache), (10_000, KVCache)):
        quantized = MlxModel(model._model, model._tokenizer, model.path, KVQuantization(8, 32, start))
        cache = quantized.new_cache()
        steps = list(quantized.generate(PROMPTS[0], greedy(6), cache))
        assert len(steps) >= 6
        assert {type(layer) for layer in cache} == {kind}
