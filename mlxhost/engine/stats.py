"""Request counters and histograms the engine keeps for `/metrics` (OPS-1): plain numbers, no exporter.

The engine counts; `api/metrics.py` renders. Counters are keyed by (binding name, instance id),
so two aliases of one instance (REG-2) keep their own counts.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxhost.engine.errors import REJECTION_CODES

if TYPE_CHECKING:
    from mlxhost.engine.backends.base import DraftCounts
    from mlxhost.engine.types import Done

# Seconds from entering the lane to the first token.
TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Seconds an embedding request takes, from its lane permit to its vectors (API-14).
EMBED_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# How an admitted embedding request ended.
EMBED_OUTCOMES = ("completed", "cancelled", "failed")
# Decode tokens per second of one request (after its first token).
DECODE_BUCKETS_TPS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)

# How a request that entered its lane ended; the names match the stored response statuses.
OUTCOMES = ("completed", "incomplete", "cancelled", "failed")
# Why a request was refused at admission (the codes live on the error classes).
REJECTIONS = REJECTION_CODES
# Why an instance's weights were freed without an admin asking (OPS-3).
UNLOAD_REASONS = ("keep_alive", "memory_budget")

# A server abort (drain timeout, shutdown) counts with the cancels: stopped before its end.
_OUTCOME_OF_FINISH = {
    "stop": "completed",
    "length": "incomplete",
    "cancelled": "cancelled",
    "aborted": "cancelled",
}

Key = tuple[str, int]  # (binding name, instance id)


@dataclass(slots=True)
class Histogram:
    """A fixed-bucket histogram: `counts[i]` observations <= `bounds[i]`, the last slot above all."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) per bucket, ending with (+inf, count)."""
        running, out = 0, []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass(slots=True)
class RequestStats:
    """One binding's requests on one instance."""

    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTIONS, 0))
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    decode_tps: Histogram = field(default_factory=lambda: Histogram(DECODE_BUCKETS_TPS))


@dataclass(slots=True)
class EmbeddingStats:
    """One binding's embedding requests on one instance (API-14): how they ended, the inputs
    and tokens of the completed ones, and their latency (lane permit to vectors)."""

    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EMBED_OUTCOMES, 0))
    inputs: int = 0
    tokens: int = 0
    latency_s: Histogram = field(default_factory=lambda: Histogram(EMBED_LATENCY_BUCKETS_S))


class EngineStats:
    """Every binding's `RequestStats` and `EmbeddingStats`, and why instances were unloaded;
    touched on the loop only. Refusals at admission (429, 503) count in `RequestStats` for both
    kinds, as every surface refuses alike (LANE-2)."""

    def __init__(self) -> None:
        self._requests: dict[Key, RequestStats] = {}
        self._embeddings: dict[Key, EmbeddingStats] = {}
        self.unloads: dict[int, dict[str, int]] = {}  # instance id -> reason -> count
        # (adapter name, instance id) -> [requests, prompt tokens, completion tokens] (issue 28)
        self._adapters: dict[Key, list[int]] = {}

    def adapters(self) -> list[tuple[str, int, list[int]]]:
        return [(name, instance_id, counts) for (name, instance_id), counts in self._adapters.items()]

    def adapter_finished(self, key: Key, done: Done) -> None:
        """Count a finished request of a LoRA adapter (its alias's counts hold it too)."""
        counts = self._adapters.setdefault(key, [0, 0, 0])
        counts[0] += 1
        counts[1] += done.usage.prompt_tokens
        counts[2] += done.usage.completion_tokens

    def requests(self) -> list[tuple[str, int, RequestStats]]:
        return [(name, instance_id, stats) for (name, instance_id), stats in self._requests.items()]

    def embeddings(self) -> list[tuple[str, int, EmbeddingStats]]:
        return [(name, instance_id, stats) for (name, instance_id), stats in self._embeddings.items()]

    def embedded(
        self, key: Key, outcome: str, *, inputs: int = 0, tokens: int = 0, latency_s: float = 0.0
    ) -> None:
        """Count an admitted embedding request's end; a completed one adds its inputs, tokens and latency."""
        stats = self._embeddings.get(key)
        if stats is None:
            stats = self._embeddings[key] = EmbeddingStats()
        stats.outcomes[outcome] += 1
        if outcome == "completed":
            stats.inputs += inputs
            stats.tokens += tokens
            stats.latency_s.observe(max(0.0, latency_s))

    def reject(self, key: Key, reason: str) -> None:
        self._of(key).rejected[reason if reason in REJECTIONS else "draining"] += 1

    def outcome(self, key: Key, outcome: str) -> None:
        self._of(key).outcomes[outcome] += 1

    def finished(self, key: Key, done: Done) -> None:
        """Count a request's terminal `Done`: outcome, tokens, time to first token, decode rate."""
        stats = self._of(key)
        stats.outcomes[_OUTCOME_OF_FINISH.get(done.finish_reason, "failed")] += 1
        usage = done.usage
        stats.prompt_tokens += usage.prompt_tokens
        stats.cached_tokens += usage.cached_tokens
        stats.completion_tokens += usage.completion_tokens
        if usage.completion_tokens > 0:
            stats.ttft_s.observe(max(0.0, done.timings.ttft_ms) / 1000)
        if usage.completion_tokens > 1 and done.timings.decode_tps > 0:
            stats.decode_tps.observe(done.timings.decode_tps)

    def unloaded(self, instance_id: int, reason: str) -> None:
        reasons = self.unloads.setdefault(instance_id, dict.fromkeys(UNLOAD_REASONS, 0))
        reasons[reason] += 1

    def _of(self, key: Key) -> RequestStats:
        stats = self._requests.get(key)
        if stats is None:
            stats = self._requests[key] = RequestStats()
        return stats


def speculation_figures(counts: DraftCounts) -> dict[str, float | int | None]:
    """Speculation counts as the snapshot shows them (docs/speculation.md), with the acceptance
    rate (accepted / drafted) and tokens per decode pass (emitted / passes); None before any."""
    return {
        "drafted": counts.drafted,
        "accepted": counts.accepted,
        "passes": counts.passes,
        "emitted": counts.emitted,
        "acceptance": round(counts.acceptance, 4) if counts.drafted else None,
        "tokens_per_pass": round(counts.tokens_per_pass, 3) if counts.passes else None,
    }
