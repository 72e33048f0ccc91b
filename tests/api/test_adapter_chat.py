"""LoRA adapters (issue 28, item 4) through Django on /v1/chat/completions: aliases of one base with two
adapters and with none answer as mlx-lm does with each adapter alone, in one batch; KV cached under
one adapter is never reused under another or the base; /metrics and the Models page name each one."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import AsyncClient
from prometheus_client.parser import text_string_to_metric_families

from mlxhost.engine.backends.mlx.tiny import build_tiny_adapter
from mlxhost.engine.worker import CallJob
from models_app.catalogue import adapters as adapter_services
from models_app.models import Adapter
from tests.api.support import bearer, post_json
from tests.engine.conftest import lane_of
from tests.engine.mlx.support import greedy_alone
from tests.support import eventually, register_alias

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

URL = "/v1/chat/completions"
PROMPTS = ("The baker opened his shop.", "Where does the river go?", "snow covered the roofs")
TOKENS = 10


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir) -> dict[str, Path]:
    root = Path(settings.MODELS_ROOT) / "adapters"
    return {
        "one": build_tiny_adapter(tiny_model_dir, root / "tiny-one", seed=1, rank=4),
        "two": build_tiny_adapter(
            tiny_model_dir, root / "tiny-two", seed=2, rank=8, keys=("self_attn.v_proj",)
        ),
    }


@pytest.fixture
def aliases(tiny_model_dir, adapter_dirs):
    """`tiny-base` (no adapter), `tiny-one` and `tiny-two` (an adapter each), all on one Model."""
    base = register_alias(name="tiny-base", folder=tiny_model_dir.name, temperature=0.0, concurrency=4)
    root = Path(settings.MODELS_ROOT)
    for name, folder in adapter_dirs.items():
        adapter = adapter_services.adapter_save(
            adapter=Adapter(name=f"lora-{name}", base=base.model, local_path=str(folder.relative_to(root)))
        )
        register_alias(name=f"tiny-{name}", folder=tiny_model_dir.name, temperature=0.0, adapter=adapter)
    return base


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapter_dirs) -> dict[tuple[str, str], list[list[int]]]:
    """mlx-lm alone: each prompt's greedy tokens from the base and from the base with each adapter."""
    folders = {"base": None, **{name: str(folder) for name, folder in adapter_dirs.items()}}
    return {
        (name, prompt): greedy_alone(str(tiny_model_dir), folder, prompt, TOKENS)
        for name, folder in folders.items()
        for prompt in PROMPTS
    }


async def chat(api_key: str, model: str, prompt: str, **fields):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS, **fields}
    return await post_json(URL, body, bearer(api_key))


def answer(response) -> str:
    assert response.status_code == 200, response.content
    return response.json()["choices"][0]["message"]["content"]


def served(response) -> list[list[int]]:
    """The answer's tokens, as their bytes."""
    assert response.status_code == 200, response.content
    return [entry["bytes"] for entry in response.json()["choices"][0]["logprobs"]["content"]]


async def test_each_alias_answers_as_mlx_lm_with_its_adapter_alone(aliases, api_key, mlx_engine, expected):
    for name in ("base", "one", "two"):
        for prompt in PROMPTS:
            tokens = served(await chat(api_key, f"tiny-{name}", prompt, logprobs=True))
            assert tokens == expected[(name, prompt)], (name, prompt)
    assert (
        len({str(expected[(name, PROMPTS[0])]) for name in ("base", "one", "two")}) == 3
    )  # the adapters matter


async def test_two_adapters_and_the_base_share_one_batch(aliases, api_key, mlx_engine, expected, batch_sizes):
    """Requests of three aliases held until all are admitted run as one batch, each with its own answer."""
    sizes = batch_sizes
    await chat(api_key, "tiny-base", "warm up")  # loaded, so the held job below finds the worker
    instance_id = aliases.model.instance_id
    hold = threading.Event()
    mlx_engine.get(instance_id)._worker.submit(CallJob(lambda: hold.wait(30), lambda _r, _e: None))
    wanted = [("base", PROMPTS[0]), ("one", PROMPTS[0]), ("two", PROMPTS[1]), ("one", PROMPTS[2])]
    try:
        tasks = [
            asyncio.create_task(chat(api_key, f"tiny-{name}", prompt, logprobs=True))
            for name, prompt in wanted
        ]
        await eventually(lambda: lane_of(mlx_engine, instance_id)["active"] == len(wanted), timeout=30)
    finally:
        hold.set()
    together = [served(r) for r in await asyncio.gather(*tasks)]
    assert together == [expected[key] for key in wanted]
    assert max(sizes) == 4  # the lane's capacity: rows of every adapter and of none in one step


async def test_kv_never_crosses_adapters(aliases, api_key, mlx_engine):
    """A conversation's second turn hits the prefix cache on its own alias only: the same tenant, salt and
    tokens under another adapter, or the base, start cold."""
    first = answer(await chat(api_key, "tiny-one", PROMPTS[0]))
    turn2 = [
        {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and then?"},
    ]
    for model in ("tiny-two", "tiny-base"):
        cold = await post_json(URL, {"model": model, "messages": turn2, "max_tokens": 4}, bearer(api_key))
        assert cold.status_code == 200, cold.content
        assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, model
    warm = await post_json(URL, {"model": "tiny-one", "messages": turn2, "max_tokens": 4}, bearer(api_key))
    assert warm["X-Session-Cache"] == "hit"
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_metrics_and_the_models_page_name_each_adapter(aliases, api_key, mlx_engine, admin_client):
    await chat(api_key, "tiny-one", PROMPTS[1])
    await chat(api_key, "tiny-two", PROMPTS[1])
    metrics = (await AsyncClient().get("/metrics", headers=bearer(api_key))).content.decode()
    instance = aliases.model.instance_id
    samples = [s for family in text_string_to_metric_families(metrics) for s in family.samples]
    served_by = {
        (s.labels["adapter"], s.labels["instance"]): s.value
        for s in samples
        if s.name == "mlxhost_adapter_requests_total"
    }
    assert served_by == {("lora-one", str(instance)): 1.0, ("lora-two", str(instance)): 1.0}
    page = (await sync_to_async(admin_client.get)("/dashboard/models/")).content.decode()
    assert "+ adapter" in page
    assert "lora-one" in page and "lora-two" in page


async def test_several_choices_share_a_prompt_prefilled_under_their_adapter(
    aliases, api_key, mlx_engine, expected
):
    """`n` = 2: the first choice's prompt, prefilled once for both, is the adapter's (greedy: both equal)."""
    response = await chat(api_key, "tiny-two", PROMPTS[2], n=2, logprobs=True)
    assert response.status_code == 200, response.content
    for choice in response.json()["choices"]:
        assert [e["bytes"] for e in choice["logprobs"]["content"]] == expected[("two", PROMPTS[2])]
