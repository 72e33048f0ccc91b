"""LoRA adapters batched together (issue 28), exact against mlx-lm with each adapter loaded alone.

Two random adapters of the tiny model (built by mlx-lm's tuner, saved in mlx_lm.lora's layout, of
different ranks and layers) and the base serve in one `MlxBatch`: each row's greedy tokens equal
`mlx_lm.stream_generate` on `mlx_lm.load(base, adapter_path=...)` (or the base alone), token for
token, through the generator's prefill, a row fed alone while others decode, and speculation's
verify pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx_lm
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlxhost.engine import ModelSpec, SamplingParams
from mlxhost.engine.adapter_files import adapter_fingerprint, check_against_base, read_adapter
from mlxhost.engine.backends.mlx.backend import MlxBackend, MlxModel
from mlxhost.engine.backends.mlx.batch import MlxBatch
from mlxhost.engine.backends.mlx.drafting import PassCost, SpeculationConfig
from mlxhost.engine.backends.mlx.tiny import build_tiny_adapter
from mlxhost.engine.errors import InvalidAdapterError
from mlxhost.engine.types import AdapterRef

if TYPE_CHECKING:
    from mlxhost.engine.backends.mlx.adapters import AdapterBank

pytestmark = pytest.mark.timeout(300)

FLAT = SpeculationConfig(cost=PassCost({1: {1: 1.0, 64: 1.0}}), measure=False)  # drafting always pays
PROMPTS = (
    "the baker opened the shop and the baker opened the shop and the baker",
    "Where does the river go? How far is the sea?",
    "a map of the valley",
    "snow covered the roofs and the river froze",
)
TOKENS = 20


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[AdapterRef, AdapterRef]:
    root = tmp_path_factory.mktemp("adapters")
    one = build_tiny_adapter(tiny_model_dir, root / "one", seed=1, rank=4)
    two = build_tiny_adapter(
        tiny_model_dir,
        root / "two",
        seed=2,
        rank=8,
        keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"),
    )
    return (
        AdapterRef(adapter_fingerprint(one), "one", str(one)),
        AdapterRef(adapter_fingerprint(two), "two", str(two)),
    )


@pytest.fixture(scope="module")
def backend(tiny_model_dir) -> MlxModel:
    return MlxBackend().load(ModelSpec(1, str(tiny_model_dir), "f" * 64), lambda *_: None)


def sampling(eos: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=TOKENS, logit_bias=((eos, -100.0),))


def reference(base: Path, adapter: AdapterRef | None, prompt: list[int], eos: int) -> list[int]:
    """mlx-lm alone: the base, or the base with this one adapter (`load(adapter_path=...)`)."""
    model, tokenizer = mlx_lm.load(str(base), adapter_path=adapter.path if adapter else None)[:2]
    responses = mlx_lm.stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=TOKENS,
        sampler=make_sampler(temp=0.0),
        logits_processors=make_logits_processors(logit_bias={eos: -100.0}),
    )
    return [int(r.token) for r in responses]


@pytest.fixture(scope="module")
def expected(tiny_model_dir, backend, adapters, tiny_eos_id) -> dict[tuple[str, int], list[int]]:
    table = {}
    for ref in (None, *adapters):
        for i, text in enumerate(PROMPTS):
            table[(ref.name if ref else "", i)] = reference(
                tiny_model_dir, ref, backend.encode(text), tiny_eos_id
            )
    return table


def open_batch(backend: MlxModel, speculation: SpeculationConfig | None = None) -> MlxBatch:
    return MlxBatch(
        backend._model,
        backend._tokenizer,
        4,
        vocabulary=backend.vocabulary,
        speculation=speculation,
        adapters=backend.adapters,
    )


def drive(batch: MlxBatch, handles: dict[int, Any], runs: dict[Any, list[int]]) -> None:
    while handles:
        for step in batch.step():
            if step.token_id is not None:
                runs[handles[step.handle]].append(step.token_id)
            if step.finish_reason is not None:
                del handles[step.handle]


def test_each_adapter_alone_changes_the_output(expected):
    """The adapters are not no-ops: otherwise every comparison below would pass for a batch that ignored them."""
    for i in range(len(PROMPTS)):
        assert len({tuple(expected[(name, i)]) for name in ("", "one", "two")}) == 3


@pytest.mark.parametrize("speculation", [None, FLAT], ids=["plain", "speculation"])
def test_mixed_batch_equals_each_adapter_alone(backend, adapters, expected, tiny_eos_id, speculation):
    """Base rows and rows of two adapters in one batch: every row's greedy tokens are mlx-lm's alone."""
    one, two = adapters
    batch = open_batch(backend, speculation)
    rows = [(None, 0), (one, 1), (two, 2), (one, 0)]
    handles = {}
    for ref, i in rows:
        handle = batch.insert(backend.encode(PROMPTS[i]), sampling(tiny_eos_id), None, 0, adapter=ref)
        handles[handle] = (ref.name if ref else "", i)
    runs: dict[Any, list[int]] = {key: [] for key in handles.values()}
    drive(batch, handles, runs)
    batch.close()
    for key, tokens in runs.items():
        assert tokens == expected[key], key


def test_a_row_joining_a_decoding_batch_keeps_its_adapter(backend, adapters, expected, tiny_eos_id):
    """A short prompt fed alone while the batch decodes (`_insert_started`) runs under its own adapter."""
    one, two = adapters
    batch = open_batch(backend)
    first = batch.insert(backend.encode(PROMPTS[0]), sampling(tiny_eos_id), None, 0, adapter=one)
    handles: dict[int, Any] = {first: ("one", 0)}
    runs: dict[Any, list[int]] = {("one", 0): [], ("two", 2): [], ("", 3): []}
    while not batch._decoding:  # prefill until the first row decodes
        for step in batch.step():
            runs[handles[step.handle]].append(step.token_id)
    # the next arrivals are fed alone, one with an adapter, one without
    handles[batch.insert(backend.encode(PROMPTS[2]), sampling(tiny_eos_id), None, 0, adapter=two)] = (
        "two",
        2,
    )
    handles[batch.insert(backend.encode(PROMPTS[3]), sampling(tiny_eos_id), None, 0)] = ("", 3)
    assert min(handles) < 0 or batch._first  # at least one took the fed-alone path
    drive(batch, handles, runs)
    batch.close()
    for key, tokens in runs.items():
        assert tokens == expected[key], key


def test_one_stream_under_an_adapter(backend, adapters, expected, tiny_eos_id):
    """The exclusive scheduler's path (`MlxModel.generate`) applies the adapter too, and the base after it."""
    for ref, name in ((adapters[1], "two"), (None, "")):
        steps = backend.generate(
            backend.encode(PROMPTS[1]), sampling(tiny_eos_id), backend.new_cache(), adapter=ref
        )
        assert [s.token_id for s in steps if getattr(s, "token_id", None) is not None] == expected[(name, 1)]


def test_adapters_unload_while_the_base_serves(tiny_model_dir, adapters, expected, tiny_eos_id):
    """Unloading an adapter keeps the base and the other adapter exact; a busy one is not unloaded."""
    model = MlxBackend().load(ModelSpec(2, str(tiny_model_dir), "f" * 64), lambda *_: None)
    one, two = adapters
    bank: AdapterBank = model.adapters
    bank.slot(one), bank.slot(two)
    batch = open_batch(model)
    handle = batch.insert(model.encode(PROMPTS[1]), sampling(tiny_eos_id), None, 0, adapter=two)
    assert not bank.unload(two.key)  # a row uses it
    assert bank.unload(one.key)
    assert [r.name for r in bank.loaded] == ["two"]
    runs: dict[Any, list[int]] = {("two", 1): []}
    drive(batch, {handle: ("two", 1)}, runs)
    assert runs[("two", 1)] == expected[("two", 1)]
    assert bank.unload(two.key) and bank.loaded == []
    handle = batch.insert(model.encode(PROMPTS[1]), sampling(tiny_eos_id), None, 0)
    runs = {("", 1): []}
    drive(batch, {handle: ("", 1)}, runs)
    batch.close()
    assert runs[("", 1)] == expected[("", 1)]


def test_an_adapter_of_other_shapes_is_refused_at_load(backend, tmp_path):
    (tmp_path / "adapter_config.json").write_text(
        '{"fine_tune_type": "dora", "lora_parameters": {"rank": 4, "scale": 1}}'
    )
    (tmp_path / "adapters.safetensors").write_bytes(b"")
    with pytest.raises(InvalidAdapterError, match="dora"):
        backend.adapters.slot(AdapterRef("x" * 64, "bad", str(tmp_path)))


def test_an_adapter_on_quantized_weights(tiny_model_dir, tiny_quantized_dir, adapters, tiny_eos_id):
    """A quantized base (mlx-lm's affine 4 and 8 bits): the check reads its packed widths, and the
    adapter trained on the float base serves exactly as mlx-lm applies it there, beside base rows."""
    one = adapters[0]
    check_against_base(read_adapter(Path(one.path)), tiny_quantized_dir)  # fits: same layers, widths
    model = MlxBackend().load(ModelSpec(3, str(tiny_quantized_dir), "q" * 64), lambda *_: None)
    batch = open_batch(model)
    handles = {}
    for ref, i in ((one, 0), (None, 1), (one, 3)):
        handle = batch.insert(model.encode(PROMPTS[i]), sampling(tiny_eos_id), None, 0, adapter=ref)
        handles[handle] = (ref, i)
    runs: dict[Any, list[int]] = {key: [] for key in handles.values()}
    drive(batch, handles, runs)
    batch.close()
    for (ref, i), tokens in runs.items():
        assert tokens == reference(tiny_quantized_dir, ref, model.encode(PROMPTS[i]), tiny_eos_id), (ref, i)
