"""The concurrency benchmark's figures: per-wave stats, medians over runs, ratios, targets, Markdown and the chart."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from _common import append_results, machine, machine_line, median, percentile, pyplot, save_chart

if TYPE_CHECKING:
    from datetime import datetime
    from pathlib import Path

SYSTEMS = ("raw stream_generate", "raw BatchGenerator", "mlx_lm.server", "mlxhost")


@dataclass
class Wave:
    """One system at one concurrency in one run: every request's outcome."""

    outcomes: list  # bench_concurrency.Outcome

    @property
    def ok(self) -> list:
        return [o for o in self.outcomes if not o.error]

    @property
    def failures(self) -> int:
        return len(self.outcomes) - len(self.ok)

    @property
    def decode_tps(self) -> float:
        """Tokens after each request's first, over the span from the first first-token to the last token."""
        ok = self.ok
        span = max((o.last for o in ok), default=0.0) - min((o.first for o in ok), default=0.0)
        return sum(o.tokens - 1 for o in ok) / span if ok and span > 0 else float("nan")

    @property
    def wall_tps(self) -> float:
        """All tokens over the wave's wall time, first request sent to last token (prefill included)."""
        ok = self.ok
        span = max((o.last for o in ok), default=0.0) - min((o.sent for o in self.outcomes), default=0.0)
        return sum(o.tokens for o in ok) / span if ok and span > 0 else float("nan")


@dataclass
class Report:
    command: str
    tokens: int
    runs: int
    waves: dict[tuple[str, str, int], list[Wave]] = field(default_factory=dict)
    when: datetime | None = None
    load: list[float] = field(default_factory=list)

    def started(self, when: datetime, load: float) -> None:
        self.when, self.load = when, [load]

    def finished(self, load: float) -> None:
        self.load.append(load)

    def add(self, model: str, system: str, concurrency: int, run: int, outcomes: list) -> None:
        self.waves.setdefault((model, system, concurrency), []).append(Wave(outcomes))

    def failures(self) -> int:
        return sum(w.failures for waves in self.waves.values() for w in waves)

    def line(self, model: str, system: str, concurrency: int, run: int) -> str:
        wave = self.waves[(model, system, concurrency)][run]
        ttft = [(o.first - o.sent) * 1000 for o in wave.ok]
        errors = "; ".join(sorted({o.error for o in wave.outcomes if o.error}))[:200]
        return (
            f"{system:<20} decode {wave.decode_tps:7.1f} tok/s  wall {wave.wall_tps:7.1f} tok/s  "
            f"TTFT max {max(ttft, default=float('nan')):7.0f} ms  tokens {sorted({o.tokens for o in wave.ok})}"
            + (f"  FAILED {wave.failures}: {errors}" if wave.failures else "")
        )

    # Figures over runs

    def models(self) -> list[str]:
        return list(dict.fromkeys(model for model, _, _ in self.waves))

    def concurrencies(self, model: str) -> list[int]:
        return sorted({c for m, _, c in self.waves if m == model})

    def decode(self, model: str, system: str, concurrency: int) -> float:
        waves = self.waves.get((model, system, concurrency), [])
        return median([w.decode_tps for w in waves if not math.isnan(w.decode_tps)])

    def latencies(self, model: str, system: str, concurrency: int) -> tuple[list[float], list[float]]:
        """TTFT and end-to-end seconds of every successful request of every run (pooled)."""
        ok = [o for w in self.waves.get((model, system, concurrency), []) for o in w.ok]
        return [o.first - o.sent for o in ok], [o.last - o.sent for o in ok]

    def ratios(self, model: str) -> list[tuple[str, list[float]]]:
        cs = self.concurrencies(model)
        lo, hi = cs[0], cs[-1]

        def ratio(a: float, b: float) -> float:
            return a / b if b and not math.isnan(b) else float("nan")

        host = {c: self.decode(model, "mlxhost", c) for c in cs}
        return [
            ("mlxhost ÷ mlx_lm.server", [ratio(host[c], self.decode(model, "mlx_lm.server", c)) for c in cs]),
            (
                "mlxhost ÷ raw BatchGenerator",
                [ratio(host[c], self.decode(model, "raw BatchGenerator", c)) for c in cs],
            ),
            (
                f"mlxhost c={lo} ÷ raw stream_generate",
                [ratio(host[lo], self.decode(model, "raw stream_generate", lo))],
            ),
            (f"mlxhost c={hi} ÷ mlxhost c={lo}", [ratio(host[hi], host[lo])]),
            (
                f"raw BatchGenerator c={hi} ÷ c={lo}",
                [
                    ratio(
                        self.decode(model, "raw BatchGenerator", hi),
                        self.decode(model, "raw BatchGenerator", lo),
                    )
                ],
            ),
        ]

    def targets(self, model: str) -> list[tuple[str, float, bool]]:
        """Issue 6's acceptance targets: (what, measured, met)."""
        cs = self.concurrencies(model)
        lo, hi = cs[0], cs[-1]
        host_hi, host_lo = self.decode(model, "mlxhost", hi), self.decode(model, "mlxhost", lo)
        server_hi = self.decode(model, "mlx_lm.server", hi)
        raw_lo = self.decode(model, "raw stream_generate", lo)
        host_p95 = percentile(self.latencies(model, "mlxhost", hi)[0], 95)
        server_p95 = percentile(self.latencies(model, "mlx_lm.server", hi)[0], 95)
        rows = [
            (f"mlxhost c={hi} ≥ 1.2 × mlx_lm.server c={hi}", host_hi / server_hi, 1.2),
            (f"mlxhost c={hi} ≥ 4 × mlxhost c={lo}", host_hi / host_lo, 4.0),
            (f"mlxhost c={lo} ≥ 0.9 × raw stream_generate", host_lo / raw_lo, 0.9),
        ]
        out = [(label, value, value >= goal) for label, value, goal in rows]
        out.append(
            (
                f"mlxhost TTFT p95 c={hi} ≤ mlx_lm.server's (ratio)",
                host_p95 / server_p95,
                host_p95 <= server_p95,
            )
        )
        return out

    # Output

    def markdown(self) -> str:
        when = self.when.strftime("%Y-%m-%d %H:%M UTC") if self.when else "?"
        lines = [
            f"## {when} — concurrency: raw mlx-lm vs mlx_lm.server vs mlxhost over HTTP (issue 6)",
            "",
            f"Command: `{self.command}` (max_tokens {self.tokens}, EOS suppressed with logit_bias −100,"
            f" greedy; {self.runs} run(s), systems interleaved within each run).",
            "",
            machine_line(self.load),
            "",
            "Decode tok/s is the median over runs of Σ(tokens − 1) / (last content chunk − first content chunk)"
            " per wave; wall tok/s is Σ tokens / (last content chunk − first request sent). TTFT and end-to-end"
            " are request sent → its first / last content chunk, percentiles over every request of every run."
            " The raw side is timed by the same streaming detokenizer's non-empty segments.",
        ]
        for model in self.models():
            lines += ["", f"### {model}", "", *self._table(model), "", *self._ratio_table(model)]
            lines += [
                "",
                *(
                    f"- {'met' if ok else '**missed**'}: {label}: {value:.2f}"
                    for label, value, ok in self.targets(model)
                ),
            ]
        return "\n".join(lines) + "\n"

    def _table(self, model: str) -> list[str]:
        rows = [
            "| system | streams | decode tok/s, median [per run] | wall tok/s | TTFT p50 / p95 (ms) |"
            " end-to-end p50 / p95 (s) | prompt tokens | tokens per request | failures |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in self.concurrencies(model):
            for system in SYSTEMS:
                waves = self.waves.get((model, system, c))
                if not waves:
                    continue
                ttft, e2e = self.latencies(model, system, c)
                ok = [o for w in waves for o in w.ok]
                per_run = ", ".join(f"{w.decode_tps:.1f}" for w in waves)
                rows.append(
                    f"| {system} | {c} | {self.decode(model, system, c):.1f} [{per_run}] |"
                    f" {median([w.wall_tps for w in waves]):.1f} |"
                    f" {percentile(ttft, 50) * 1000:.0f} / {percentile(ttft, 95) * 1000:.0f} |"
                    f" {percentile(e2e, 50):.2f} / {percentile(e2e, 95):.2f} |"
                    f" {_span(o.prompt_tokens for o in ok)} | {_span(o.tokens for o in ok)} |"
                    f" {sum(w.failures for w in waves)} |"
                )
        return rows

    def _ratio_table(self, model: str) -> list[str]:
        cs = self.concurrencies(model)
        rows = [
            "| ratio (decode tok/s) | " + " | ".join(f"c={c}" for c in cs) + " |",
            "|---" * (len(cs) + 1) + "|",
        ]
        for label, values in self.ratios(model):
            cells = [f"{v:.2f}" for v in values] + [""] * (len(cs) - len(values))
            rows.append(f"| {label} | " + " | ".join(cells) + " |")
        return rows

    def append_to(self, path: Path, text: str) -> None:
        append_results(path, text)

    def chart(self, path: Path) -> None:
        plt = pyplot()
        models = self.models()
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
        for ax, model in zip(axes[0], models, strict=True):
            for system in SYSTEMS:
                cs = [c for c in self.concurrencies(model) if (model, system, c) in self.waves]
                ax.plot(cs, [self.decode(model, system, c) for c in cs], marker="o", label=system)
            ax.set_xscale("log", base=2)
            ax.set_xticks(self.concurrencies(model), [str(c) for c in self.concurrencies(model)])
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel("aggregate decode tokens/s (median)")
            ax.set_title(f"{model}, {self.tokens} tokens/request")
            ax.grid(alpha=0.3)
            ax.legend()
        when = self.when.strftime("%Y-%m-%d") if self.when else ""
        fig.suptitle(f"Throughput vs concurrency, {machine()['nproc']} CPU cores, {when}")
        save_chart(fig, path)


def _span(values) -> str:
    values = list(values)
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}–{hi}"
