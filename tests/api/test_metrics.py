"""GET /metrics after real requests with the tiny MLX model: exact counters from the exposition text."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient
from prometheus_client.parser import text_string_to_metric_families

from tests.api.support import bearer as auth
from tests.api.support import post_chat, set_lane
from tests.support import eventually

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


class Samples:
    """The samples of one exposition, looked up by name and labels."""

    def __init__(self, text: str) -> None:
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def get(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items()]
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
        return found[0]


async def scrape(**headers: str) -> Samples:
    response = await AsyncClient().get("/metrics", headers=headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=")
    return Samples(response.content.decode())


async def open_stream(api_key: str, **fields):
    """A streaming request read in a task, as the ASGI server would; returns (task, frames seen)."""
    response = await post_chat(api_key, stream=True, **fields)
    assert response.status_code == 200
    frames: list[bytes] = []

    async def read() -> None:
        async for chunk in response.streaming_content:
            frames.append(chunk)

    return asyncio.create_task(read()), frames


async def test_metrics_count_outcomes_rejections_tokens_and_lane_state(
    tiny_alias, api_key, mlx_engine, tiny_eos_id
):
    """OPS-1: requests by outcome, rejected by reason, tokens and the cached ratio, TTFT and decode
    histograms, queue depth, active, warm sessions and memory, all exact after real requests."""
    await set_lane(tiny_alias, concurrency=1, queue_depth=0)
    no_eos = {str(tiny_eos_id): -100}
    # 1: cut by max_tokens ("incomplete"), in a cache domain of its own so 2 starts fresh.
    probe = (await post_chat(api_key, max_tokens=8, logit_bias=no_eos, cache_salt="probe")).json()
    text = probe["choices"][0]["message"]["content"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    # 2 and 3: clean finishes ("completed"); 3 resends 2's conversation and reuses its cache.
    fresh = (await post_chat(api_key, max_tokens=8, logit_bias=no_eos, stop=[stop])).json()
    warm = await post_chat(api_key, max_tokens=8, logit_bias=no_eos, stop=[stop])
    assert warm["X-Session-Cache"] == "hit"
    warm = warm.json()
    assert [fresh["choices"][0]["finish_reason"], warm["choices"][0]["finish_reason"]] == ["stop", "stop"]
    # 4: a stream in another cache domain holds the only slot; 5 is refused; then 4 hangs up.
    reader, frames = await open_stream(api_key, max_tokens=100_000, logit_bias=no_eos, cache_salt="x")
    await eventually(lambda: len(frames) >= 10, timeout=30, what="ten frames of the stream")
    refused = await post_chat(api_key, max_tokens=2)
    assert refused.status_code == 429
    reader.cancel()  # what a client disconnect does (LANE-6)
    with contextlib.suppress(asyncio.CancelledError):
        await reader
    await eventually(lambda: mlx_engine.snapshot()[0]["lane"]["active"] == 0, what="the slot to be freed")

    metrics = await scrape(**auth(api_key))
    snap = mlx_engine.snapshot()[0]
    labels = {"model": "tiny", "instance": str(snap["instance_id"])}
    outcomes = {
        outcome: metrics.get("mlxhost_requests_total", outcome=outcome, **labels)
        for outcome in ("completed", "incomplete", "cancelled", "failed")
    }
    assert outcomes == {"completed": 2, "incomplete": 1, "cancelled": 1, "failed": 0}
    rejected = {
        reason: metrics.get("mlxhost_requests_rejected_total", reason=reason, **labels)
        for reason in ("queue_full", "draining", "queue_timeout")
    }
    assert rejected == {"queue_full": 1, "draining": 0, "queue_timeout": 0}

    prompt = probe["usage"]["prompt_tokens"]
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Every request had the same conversation, so the same prompt length (4 included).
    assert metrics.get("mlxhost_prompt_tokens_total", **labels) == 4 * prompt
    assert metrics.get("mlxhost_cached_prompt_tokens_total", **labels) == cached
    assert metrics.get("mlxhost_cached_token_ratio", **labels) == pytest.approx(cached / (4 * prompt))
    finished = 8 + fresh["usage"]["completion_tokens"] + warm["usage"]["completion_tokens"]
    assert metrics.get("mlxhost_completion_tokens_total", **labels) > finished  # plus the stream's

    # Every one of the four produced tokens (the stream at least ten), so each has a TTFT and a rate.
    assert metrics.get("mlxhost_time_to_first_token_seconds_count", **labels) == 4
    assert metrics.get("mlxhost_time_to_first_token_seconds_bucket", le="+Inf", **labels) == 4
    assert metrics.get("mlxhost_decode_tokens_per_second_count", **labels) == 4
    assert metrics.get("mlxhost_time_to_first_token_seconds_sum", **labels) > 0

    instance = {"instance": labels["instance"]}
    assert metrics.get("mlxhost_queue_depth", **instance) == 0
    assert metrics.get("mlxhost_active_requests", **instance) == 0
    assert metrics.get("mlxhost_lane_capacity", **instance) == 1
    # 1 (cut by length), 3 and 4 (cancelled) are kept (SES-1); 3 holds 2's tokens, so it replaced 2.
    assert metrics.get("mlxhost_warm_sessions", **instance) == 3
    memory = {"tier": "memory", **instance}
    assert metrics.get("mlxhost_prefix_cache_hits_total", **memory) == 1  # 3
    assert metrics.get("mlxhost_prefix_cache_misses_total", **memory) == 3  # 1, 2 and 4
    assert metrics.get("mlxhost_prefix_cache_tokens_saved_total", **memory) == cached
    assert metrics.get("mlxhost_prefix_cache_entries", **memory) == 3
    assert metrics.get("mlxhost_prefix_cache_bytes", **memory) == snap["prefix_cache"]["memory"]["bytes"]
    assert (
        metrics.get("mlxhost_warm_session_bytes", **instance) == snap["prefix_cache"]["memory"]["bytes"] > 0
    )
    assert metrics.get("mlxhost_resident_memory_bytes", **instance) == snap["memory_bytes"] > 0
    assert metrics.get("mlxhost_instance_state", state="ready", **instance) == 1
    assert metrics.get("mlxhost_instance_state", state="unloaded", **instance) == 0
    assert metrics.get("mlxhost_model_instance", **labels) == 1


async def test_metrics_report_persistence_of_stored_responses(tiny_alias, api_key, mlx_engine):
    """OPS-1: stored responses show as recorded, written and landed, with the persist lag."""
    from models_app.persistence.persistence import persistence

    response = await AsyncClient().post(
        "/v1/responses",
        data=json.dumps({"model": "tiny", "input": "hi", "max_output_tokens": 3}),
        content_type="application/json",
        headers=auth(api_key),
    )
    assert response.status_code == 200
    assert await persistence().wait_idle(timeout_s=15)

    metrics = await scrape(**auth(api_key))
    assert metrics.get("mlxhost_persist_recorded_total") == 1
    assert metrics.get("mlxhost_persist_writes_total", path="eager") == 1  # tests run Celery eagerly
    assert metrics.get("mlxhost_persist_writes_total", path="published") == 0
    assert metrics.get("mlxhost_persist_landed_total") == 1
    assert metrics.get("mlxhost_persist_lag_seconds_count") == 1
    assert metrics.get("mlxhost_persist_lag_seconds_sum") >= 0
    for kind in ("publish", "write", "breaker"):
        assert metrics.get("mlxhost_persist_failures_total", kind=kind) == 0
    assert metrics.get("mlxhost_persist_pending") == 0
    assert metrics.get("mlxhost_persist_oldest_pending_seconds") == 0


async def test_metrics_need_an_api_key_or_a_staff_login(api_key, django_user_model):
    """OPS-1, API-5: /metrics is not on the public allowlist: 401 without credentials."""
    anonymous = await AsyncClient().get("/metrics")
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    assert (await AsyncClient().get("/metrics", headers={"Authorization": "Bearer nope"})).status_code == 401
    await scrape(**auth(api_key))
    staff = await sync_to_async(django_user_model.objects.create_user)(
        username="ops", password="pw-ops-123", is_staff=True
    )
    client = AsyncClient()
    await client.aforce_login(staff)
    assert (await client.get("/metrics")).status_code == 200


async def test_metrics_can_be_made_public(settings):
    """OPS-1: MLXHOST_METRICS_PUBLIC=true lets a scraper without credentials in."""
    settings.MLXHOST_METRICS_PUBLIC = True
    await scrape()  # a 200 in the exposition format, without any credentials


async def test_every_sample_names_its_fleet_host(tiny_alias, api_key, mlx_engine, settings):
    """OPS-10: on fleet host 3 every sample carries host="h03", so scrapes of a fleet add up."""
    settings.MLXHOST_HOST_ID = 3
    assert (await post_chat(api_key, max_tokens=2)).status_code == 200
    samples = (await scrape(**auth(api_key))).samples
    assert samples and {s.labels.get("host") for s in samples} == {"h03"}
