"""Quantized KV (issue 28 §3) through Django on /v1/chat/completions: a model saved with `kv_bits`
serves from a new instance whose spec names the format, batches concurrent rows with quantized KV
(each row's answer is its answer alone), keeps quantized KV in the prefix cache (turn two is a
hit), never reuses KV across a change of format, and refuses a group size its heads cannot take."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import ValidationError

from mlxhost.engine import KVQuantization
from mlxhost.engine.backends.mlx.batch import MlxBatch
from mlxhost.engine.backends.mlx.quantized_kv import BatchQuantizedKVCache
from mlxhost.engine.backends.mlx.tiny import build_random_llama
from mlxhost.engine.worker import CallJob
from models_app.catalogue import reconcile as engine_control
from models_app.catalogue import services
from models_app.catalogue.specs import model_spec_for
from tests.api.support import bearer, post_json
from tests.engine.conftest import lane_of
from tests.support import eventually, register_alias

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

URL = "/v1/chat/completions"
PROMPTS = ("hi", "The baker opened his shop.", "Where does the river go?", "snow covered the roofs")
FOLDER = "llama-hd32"


@pytest.fixture
def head_dim_32() -> Path:
    """A tiny random llama whose head dimension (32) takes mlx's KV group sizes (the tiny model's 16
    takes none)."""
    return build_random_llama(
        Path(settings.MODELS_ROOT) / FOLDER,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        seed=3,
    )


@pytest.fixture
def kv_alias(head_dim_32):
    return register_alias(
        name="qkv", folder=FOLDER, temperature=0.0, concurrency=4, kv_bits=8, kv_group_size=32
    )


@pytest.fixture
def batch_caches(monkeypatch) -> list[set[type]]:
    """The cache classes of every decoding step's batch."""
    seen: list[set[type]] = []
    real_step = MlxBatch.step

    def step(self):
        steps = real_step(self)
        seen.append({type(c) for c in self._generator._generation_batch.prompt_cache})
        return steps

    monkeypatch.setattr(MlxBatch, "step", step)
    return seen


async def chat(api_key: str, content: str, **fields):
    body = {"model": "qkv", "messages": [{"role": "user", "content": content}], "max_tokens": 10, **fields}
    response = await post_json(URL, body, bearer(api_key))
    assert response.status_code == 200, response.content
    return response


def text(response) -> str:
    return response.json()["choices"][0]["message"]["content"]


async def test_a_kv_quantized_model_batches_caches_and_swaps_instance_on_a_change(
    kv_alias, api_key, mlx_engine, batch_caches
):
    model = kv_alias.model
    assert model.instance.kv_format == "kv8g32s0"
    assert model_spec_for(model=model).kv_quantization == KVQuantization(8, 32, 0)
    alone = [text(await chat(api_key, p)) for p in PROMPTS]
    instance = mlx_engine.get(model.instance_id)
    hold = threading.Event()
    instance._worker.submit(CallJob(lambda: hold.wait(30), lambda _r, _e: None))
    try:
        tasks = [asyncio.create_task(chat(api_key, p)) for p in PROMPTS]
        await eventually(lambda: lane_of(mlx_engine, model.instance_id)["active"] == len(PROMPTS), timeout=30)
    finally:
        hold.set()
    assert [text(r) for r in await asyncio.gather(*tasks)] == alone
    assert any(BatchQuantizedKVCache in kinds for kinds in batch_caches)

    # Turn two is a prefix-cache hit on the quantized KV its first turn left.
    first = await chat(api_key, "hello there")
    turn2 = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": text(first)},
        {"role": "user", "content": "and then?"},
    ]
    warm = await chat(api_key, "", messages=turn2)
    assert warm["X-Session-Cache"] == "hit"
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    kept = [entry.kv for entry in instance.sessions._entries.values()]
    assert kept and all(type(layer).__name__ == "QuantizedKVCache" for kv in kept for layer in kv)

    # Another format is another instance: the same conversation finds no KV of the old one.
    model.kv_bits = 4
    await sync_to_async(services.model_save)(model=model)
    assert model.instance.kv_format == "kv4g32s0" and model.instance_id != instance.instance_id
    await engine_control.reconcile(mlx_engine, load_pinned=False)  # what the listener does on commit
    again = await chat(api_key, "", messages=turn2)
    assert again["X-Session-Cache"] != "hit"
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_group_size_the_heads_cannot_take_is_a_form_error(tiny_model_dir):
    """The tiny model's head dimension is 16: no KV group size of mlx divides it."""
    with pytest.raises(ValidationError) as refused:
        register_alias(name="tiny-kv", folder=tiny_model_dir.name, kv_bits=8, kv_group_size=32)
    assert "head dimension is 16" in str(refused.value.message_dict["kv_group_size"])


def test_the_admin_form_says_which_group_sizes_the_heads_take(admin_client, tiny_model_dir):
    from tests.models_app.test_admin import MODEL_FORM, MODELS_URL

    form = {**MODEL_FORM, "kv_bits": "8", "kv_group_size": "32"}
    page = admin_client.post(f"{MODELS_URL}add/", form).content.decode()
    assert "head dimension is 16" in page
    assert not services.Model.objects.filter(name=MODEL_FORM["name"]).exists()


def test_the_model_page_says_what_it_costs_at_its_kv_setting(admin_client, kv_alias):
    """Issue 28 §5: weights bytes, KV bytes per 1k tokens at the current kv_bits, the cached tokens
    the prefix-cache budget holds; the KV figure follows the setting (8-bit groups of 32 of float32:
    1 + 2 * 4 / 32 = 1.25 bytes a number instead of 4)."""
    from models_app.console.model_costs import model_costs

    model = kv_alias.model
    quantized = model_costs(model)
    assert quantized is not None
    # The tiny llama of head dimension 32: 2 layers, 2 KV heads; keys and values.
    assert quantized.kv_bytes_per_1k == round(2 * 2 * 2 * 32 * 1.25 * 1000)
    assert quantized.budget_tokens == quantized.budget_bytes * 1000 // quantized.kv_bytes_per_1k
    model.kv_bits = None
    full = model_costs(model)
    assert full is not None and full.kv_bytes_per_1k == 2 * 2 * 2 * 32 * 4 * 1000
    assert full.weights_bytes == quantized.weights_bytes > 0
    page = admin_client.get(f"/admin/models_app/model/{model.pk}/change/").content.decode()
    assert "KV cache per 1,000 tokens" in page and "8-bit, groups of 32" in page
