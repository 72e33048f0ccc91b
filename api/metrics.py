"""GET /metrics: the engine's and persistence's counters in Prometheus' text format (OPS-1).

The engine only counts (`mlxhost.engine.stats`, its snapshots) and never imports an exporter;
this module renders those numbers with a collector built per scrape, so nothing is registered
globally and a scrape never builds the engine or the persistence layer.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from api.auth import api_endpoint, may_see_internals
from api.errors import INVALID_KEY_MESSAGE, ApiError
from mlxhost.runtime import PROCESS, engine_if_started
from models_app.persistence.persistence import PERSISTENCE

if TYPE_CHECKING:
    from collections.abc import Iterator

    from mlxhost.engine import Engine, Histogram, RequestStats
    from models_app.persistence.persistence import Persistence

REQUEST_LABELS = ["model", "instance"]
INSTANCE_STATES = ("unloaded", "loading", "ready", "error")
# Per-instance gauges: (metric name, help, how to read it from an engine snapshot).
INSTANCE_GAUGES: tuple[tuple[str, str, Any], ...] = (
    ("mlxhost_queue_depth", "Requests waiting in the instance's lane.", lambda s: s["lane"]["queued"]),
    ("mlxhost_active_requests", "Requests running on the instance.", lambda s: s["lane"]["active"]),
    (
        "mlxhost_queue_permits",
        "Requests admitted but still preparing (loading, templating) before the lane.",
        lambda s: s["lane"]["permits"],
    ),
    ("mlxhost_lane_capacity", "Requests the instance runs at once.", lambda s: s["lane"]["capacity"]),
    (
        "mlxhost_warm_sessions",
        "Prefix-cache entries (turns' KV caches) kept in memory.",
        lambda s: s["prefix_cache"]["memory"]["entries"],
    ),
    (
        "mlxhost_warm_session_bytes",
        "Bytes held by the prefix cache in memory.",
        lambda s: s["prefix_cache"]["memory"]["bytes"],
    ),
    ("mlxhost_resident_memory_bytes", "Bytes of resident model weights.", lambda s: s["memory_bytes"]),
    ("mlxhost_instance_idle_seconds", "Seconds since the last request left.", lambda s: s["idle_s"]),
)

# Speculative decoding per instance (docs/speculation.md), over finished requests that could draft:
# acceptance is accepted / drafted, tokens per pass emitted / passes.
SPECULATION_COUNTERS = (
    ("drafted_tokens", "drafted", "Tokens drafted (prompt lookup or a prediction) for verify passes."),
    ("accepted_tokens", "accepted", "Drafted tokens the model accepted."),
    ("passes", "passes", "Decode passes of requests that could draft."),
    ("emitted_tokens", "emitted", "Tokens those passes produced (accepted drafts plus the model's own)."),
)


@api_endpoint(dialect="openai", methods=("GET", "HEAD"), public=True)
async def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus exposition; needs an API key or a staff login unless MLXHOST_METRICS_PUBLIC (API-5)."""
    if not settings.MLXHOST_METRICS_PUBLIC and not await may_see_internals(request):
        raise ApiError(401, INVALID_KEY_MESSAGE, "authentication_error", "invalid_api_key")
    return HttpResponse(
        render(engine_if_started(), PROCESS.peek(PERSISTENCE)), content_type=CONTENT_TYPE_LATEST
    )


def render(engine: Engine | None, store: Persistence | None) -> bytes:
    """The exposition text for `engine` and `store` (either may be None: not started)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(engine, store))
    return generate_latest(registry)


class _Collector:
    """Reads the counters at scrape time; registered on a registry of its own per scrape."""

    def __init__(self, engine: Engine | None, store: Persistence | None) -> None:
        self._engine = engine
        self._store = store

    def collect(self) -> Iterator[Metric]:
        for metric in self._families():
            # Every sample names its host, so a fleet's scrapes add up and split by host (issue 15).
            metric.samples = [s._replace(labels={**s.labels, "host": host_label()}) for s in metric.samples]
            yield metric

    def _families(self) -> Iterator[Metric]:
        if self._engine is not None:
            yield from _request_metrics(self._engine)
            yield from _embedding_metrics(self._engine)
            yield from _instance_metrics(self._engine)
            yield from _memory_metrics(self._engine)
        if self._store is not None:
            yield from _persist_metrics(self._store)


# Process-wide memory (issue 25): (metric name, help, key in `Engine.memory()`).
MEMORY_GAUGES = (
    ("mlxhost_process_resident_bytes", "Resident set size of this process.", "rss_bytes"),
    (
        "mlxhost_mlx_active_bytes",
        "Bytes of live MLX arrays (weights, KV caches, activations).",
        "backend_active_bytes",
    ),
    ("mlxhost_mlx_cache_bytes", "Bytes MLX keeps in its cache of freed buffers.", "backend_cache_bytes"),
)


def _memory_metrics(engine: Engine) -> Iterator[Metric]:
    held = engine.memory()
    for name, help_text, field in MEMORY_GAUGES:
        yield GaugeMetricFamily(name, help_text, value=held[field])
    yield CounterMetricFamily(
        "mlxhost_memory_trims", "Times the idle engine gave freed memory back to the OS.", value=held["trims"]
    )


def host_label() -> str:
    """This process's `host` label: `h01`.. on a fleet host (MLXHOST_HOST_ID), else the hostname."""
    host: int | None = settings.MLXHOST_HOST_ID
    return f"h{host:02d}" if host is not None else socket.gethostname()


def _request_metrics(engine: Engine) -> Iterator[Metric]:
    requests = CounterMetricFamily(
        "mlxhost_requests",
        "Requests that entered a lane, by how they ended (completed, incomplete = max_tokens, "
        "cancelled, failed).",
        labels=[*REQUEST_LABELS, "outcome"],
    )
    rejected = CounterMetricFamily(
        "mlxhost_requests_rejected",
        "Requests refused at admission: queue_full (429, Anthropic 529), draining and queue_timeout (503).",
        labels=[*REQUEST_LABELS, "reason"],
    )
    tokens = {
        kind: CounterMetricFamily(f"mlxhost_{kind}_tokens", text, labels=REQUEST_LABELS)
        for kind, text in (
            ("prompt", "Prompt tokens of finished requests."),
            ("cached_prompt", "Prompt tokens served from a cached prefix (warm session)."),
            ("completion", "Generated tokens of finished requests."),
        )
    }
    ratio = GaugeMetricFamily(
        "mlxhost_cached_token_ratio",
        "Cached prompt tokens / prompt tokens, over the process's lifetime.",
        labels=REQUEST_LABELS,
    )
    ttft = HistogramMetricFamily(
        "mlxhost_time_to_first_token_seconds",
        "From entering the lane to the first generated token.",
        labels=REQUEST_LABELS,
    )
    decode = HistogramMetricFamily(
        "mlxhost_decode_tokens_per_second", "Decode rate of one request.", labels=REQUEST_LABELS
    )
    for name, instance_id, stats in sorted(engine.stats.requests(), key=lambda item: item[:2]):
        labels = [name, str(instance_id)]
        for outcome, count in stats.outcomes.items():
            requests.add_metric([*labels, outcome], count)
        for reason, count in stats.rejected.items():
            rejected.add_metric([*labels, reason], count)
        _add_tokens(tokens, labels, stats)
        ratio.add_metric(labels, stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0)
        _add_histogram(ttft, labels, stats.ttft_s)
        _add_histogram(decode, labels, stats.decode_tps)
    yield from (requests, rejected, *tokens.values(), ratio, ttft, decode)
    yield from _adapter_metrics(engine)


def _adapter_metrics(engine: Engine) -> Iterator[Metric]:
    """Finished requests and their tokens per LoRA adapter and instance (issue 28)."""
    labels = ["adapter", "instance"]
    families = [
        CounterMetricFamily(
            "mlxhost_adapter_requests", "Finished requests served under an adapter.", labels=labels
        ),
        CounterMetricFamily(
            "mlxhost_adapter_prompt_tokens", "Prompt tokens of those requests.", labels=labels
        ),
        CounterMetricFamily(
            "mlxhost_adapter_completion_tokens", "Generated tokens under an adapter.", labels=labels
        ),
    ]
    for name, instance_id, counts in sorted(engine.stats.adapters(), key=lambda item: item[:2]):
        for family, count in zip(families, counts, strict=True):
            family.add_metric([name, str(instance_id)], count)
    yield from families


def _embedding_metrics(engine: Engine) -> Iterator[Metric]:
    """Embedding requests per alias and instance (API-14): outcomes, inputs, tokens, latency.
    Their refusals (429, 503) count in `mlxhost_requests_rejected` with every surface's."""
    requests = CounterMetricFamily(
        "mlxhost_embedding_requests",
        "Embedding requests that entered a lane, by how they ended (completed, cancelled, failed).",
        labels=[*REQUEST_LABELS, "outcome"],
    )
    inputs = CounterMetricFamily(
        "mlxhost_embedding_inputs", "Inputs of completed embedding requests.", labels=REQUEST_LABELS
    )
    tokens = CounterMetricFamily(
        "mlxhost_embedding_tokens", "Input tokens of completed embedding requests.", labels=REQUEST_LABELS
    )
    latency = HistogramMetricFamily(
        "mlxhost_embedding_latency_seconds",
        "From the lane permit to the vectors (tokenizing, queueing, the forward pass), per completed embedding request.",
        labels=REQUEST_LABELS,
    )
    for name, instance_id, stats in sorted(engine.stats.embeddings(), key=lambda item: item[:2]):
        labels = [name, str(instance_id)]
        for outcome, count in stats.outcomes.items():
            requests.add_metric([*labels, outcome], count)
        inputs.add_metric(labels, stats.inputs)
        tokens.add_metric(labels, stats.tokens)
        _add_histogram(latency, labels, stats.latency_s)
    yield from (requests, inputs, tokens, latency)


def _add_tokens(tokens: dict[str, CounterMetricFamily], labels: list[str], stats: RequestStats) -> None:
    tokens["prompt"].add_metric(labels, stats.prompt_tokens)
    tokens["cached_prompt"].add_metric(labels, stats.cached_tokens)
    tokens["completion"].add_metric(labels, stats.completion_tokens)


def _add_histogram(family: HistogramMetricFamily, labels: list[str], histogram: Histogram) -> None:
    buckets = [(_le(bound), count) for bound, count in histogram.cumulative()]
    family.add_metric(labels, buckets, histogram.total)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _instance_metrics(engine: Engine) -> Iterator[Metric]:
    bound = GaugeMetricFamily(
        "mlxhost_model_instance",
        "1 for each alias bound to an instance (join on `instance`).",
        labels=REQUEST_LABELS,
    )
    state = GaugeMetricFamily(
        "mlxhost_instance_state", "1 for the instance's current state.", labels=["instance", "state"]
    )
    gauges = [
        (GaugeMetricFamily(name, text, labels=["instance"]), read) for name, text, read in INSTANCE_GAUGES
    ]
    generated = CounterMetricFamily("mlxhost_tokens_generated", "Tokens generated.", labels=["instance"])
    speculation = [
        (CounterMetricFamily(f"mlxhost_speculation_{name}", text, labels=["instance"]), key)
        for name, key, text in SPECULATION_COUNTERS
    ]
    cache_counters = [
        (CounterMetricFamily(f"mlxhost_prefix_cache_{key}", text, labels=["instance", "tier"]), key)
        for key, text in (
            ("hits", "Requests whose cached prefix held the parent turn's whole input (SES-7 hit)."),
            ("partials", "Requests that started from a shorter cached prefix (SES-7 partial)."),
            ("misses", "Requests that found no cached prefix to start from."),
            ("tokens_saved", "Prompt tokens that cached prefixes spared from computing."),
        )
    ]
    cache_gauges = [
        (GaugeMetricFamily(f"mlxhost_prefix_cache_{key}", text, labels=["instance", "tier"]), key)
        for key, text in (
            ("entries", "Prefix-cache entries kept (memory: turns' KV caches; disk: saved responses)."),
            ("bytes", "Bytes the prefix cache holds in each tier."),
        )
    ]
    unloads = CounterMetricFamily(
        "mlxhost_instance_unloads",
        "Weights freed without an admin action: keep_alive (idle) or memory_budget (evicted).",
        labels=["instance", "reason"],
    )
    for snap in sorted(engine.snapshot(), key=lambda s: s["instance_id"]):
        instance = str(snap["instance_id"])
        for name in snap["aliases"]:
            bound.add_metric([name, instance], 1)
        for name in INSTANCE_STATES:
            state.add_metric([instance, name], 1 if snap["state"] == name else 0)
        for family, read in gauges:
            family.add_metric([instance], read(snap))
        generated.add_metric([instance], snap["tokens_generated"])
        for counter, key in speculation:
            counter.add_metric([instance], snap["speculation"][key])
        for tier, cache in snap["prefix_cache"].items():
            for counter, key in cache_counters:
                counter.add_metric([instance, tier], cache[key])
            for gauge, key in cache_gauges:
                gauge.add_metric([instance, tier], cache[key])
    for instance_id, reasons in sorted(engine.stats.unloads.items()):
        for reason, count in reasons.items():
            unloads.add_metric([str(instance_id), reason], count)
    yield from (bound, state, *(family for family, _ in gauges), generated, unloads)
    yield from (counter for counter, _ in speculation)
    yield from (counter for counter, _ in cache_counters)
    yield from (gauge for gauge, _ in cache_gauges)
    budget = engine.config.memory_budget_bytes
    if budget is not None:
        yield GaugeMetricFamily("mlxhost_memory_budget_bytes", "The memory budget (OPS-3).", value=budget)
    yield GaugeMetricFamily(
        "mlxhost_resident_bytes",
        "Weights and warm sessions of every instance.",
        value=engine.resident_bytes(),
    )


def _persist_metrics(store: Persistence) -> Iterator[Metric]:
    stats = store.stats()
    writes = CounterMetricFamily(
        "mlxhost_persist_writes",
        "Stored-response writes started, by path: published to Celery, inline (broker down), eager.",
        labels=["path"],
    )
    for path, key in (("published", "published"), ("inline", "inline_writes"), ("eager", "eager_writes")):
        writes.add_metric([path], stats[key])
    failures = CounterMetricFamily(
        "mlxhost_persist_failures",
        "Persist failures: publish (fell back inline), write (the row was not written), breaker "
        "(given up after the hard timeout, PER-4).",
        labels=["kind"],
    )
    for kind, key in (
        ("publish", "publish_failures"),
        ("write", "write_failures"),
        ("breaker", "breaker_trips"),
    ):
        failures.add_metric([kind], stats[key])
    yield CounterMetricFamily(
        "mlxhost_persist_recorded", "Responses handed to persistence.", value=stats["recorded"]
    )
    yield writes
    yield failures
    yield CounterMetricFamily("mlxhost_persist_landed", "Rows seen landed in time.", value=stats["landed"])
    yield CounterMetricFamily(
        "mlxhost_persist_late_landed",
        "Rows that landed after the breaker gave up.",
        value=stats["late_landed"],
    )
    yield SummaryMetricFamily(
        "mlxhost_persist_lag_seconds",
        "From the client's answer to the row seen landed.",
        count_value=int(stats["landed"]),
        sum_value=stats["lag_s_sum"],
    )
    yield GaugeMetricFamily(
        "mlxhost_persist_lag_max_seconds", "The longest lag seen.", value=stats["lag_s_max"]
    )
    yield GaugeMetricFamily("mlxhost_persist_pending", "Writes not landed yet.", value=stats["pending"])
    yield GaugeMetricFamily(
        "mlxhost_persist_oldest_pending_seconds",
        "How long the oldest pending write has waited (0 when none).",
        value=store.oldest_pending_s(),
    )
