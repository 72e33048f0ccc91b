"""The chat benchmark's figures: per-session stats, medians over runs, ratios to mlx_lm.server, targets, Markdown, chart."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from _common import append_results, machine, machine_line, median, percentile, pyplot, save_chart

if TYPE_CHECKING:
    from datetime import datetime
    from pathlib import Path

BASELINE = "mlx_lm.server"
# system -> the API it is driven through; mlx_lm.server has no Responses API.
SYSTEMS = {BASELINE: "chat", "mlxhost": "chat", "mlxhost responses": "responses"}
# Issue 12's targets, as mlxhost ÷ mlx_lm.server: (measure key, label, comparison, goal).
TARGETS = (
    ("turns_per_min", "turns per minute", ">=", 1.2),
    ("ttft_later_p95", "first-token p95 of turns 2+", "<=", 0.5),
)
# Ratio rows: (key, label); a higher value is better only for the two throughputs.
RATIOS = (
    ("turns_per_min", "turns per minute"),
    ("tokens_per_s", "tokens/s"),
    ("ttft_first_p50", "first-token p50, turn 1"),
    ("ttft_first_p95", "first-token p95, turn 1"),
    ("ttft_later_p50", "first-token p50, turns 2+"),
    ("ttft_later_p95", "first-token p95, turns 2+"),
    ("e2e_p50", "end-to-end p50 per turn"),
)


@dataclass
class Turn:
    """One turn of one user: when it was sent, its first content and its end, what the server reported."""

    user: int
    index: int  # 1-based turn number in the user's conversation
    sent: float
    first: float = float("nan")
    ended: float = float("nan")
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish: str | None = None
    session_cache: str = ""  # mlxhost's X-Session-Cache header
    error: str = ""


@dataclass
class Session:
    """One system, one ending, one run: every user's turns, from the first request sent to the last turn's end."""

    turns: list[Turn]
    started: float
    ended: float

    @property
    def ok(self) -> list[Turn]:
        return [t for t in self.turns if not t.error]

    @property
    def failures(self) -> int:
        return len(self.turns) - len(self.ok)

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    @property
    def turns_per_min(self) -> float:
        return len(self.ok) / self.wall_s * 60 if self.wall_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return sum(t.tokens for t in self.ok) / self.wall_s if self.wall_s > 0 else float("nan")


@dataclass
class ChatReport:
    command: str
    settings: str  # the workload in words, for the section's header
    runs: int
    sessions: dict[tuple[str, str, str], list[Session]] = field(default_factory=dict)
    when: datetime | None = None
    load: list[float] = field(default_factory=list)

    def started(self, when: datetime, load: float) -> None:
        self.when, self.load = when, [load]

    def finished(self, load: float) -> None:
        self.load.append(load)

    def add(self, model: str, ending: str, system: str, session: Session) -> None:
        self.sessions.setdefault((model, ending, system), []).append(session)

    def failures(self) -> int:
        return sum(s.failures for sessions in self.sessions.values() for s in sessions)

    def line(self, model: str, ending: str, system: str) -> str:
        """One finished session, for the progress log."""
        session = self.sessions[(model, ending, system)][-1]
        ok = session.ok
        later = [t.first - t.sent for t in ok if t.index > 1]
        errors = "; ".join(sorted({t.error for t in session.turns if t.error}))[:200]
        return (
            f"{system:<18} {ending:<6} {session.turns_per_min:6.1f} turns/min {session.tokens_per_s:6.1f} tok/s"
            f"  TTFT turns 2+ p95 {percentile(later, 95) * 1000:6.0f} ms"
            f"  cached {_per_turn(ok)}  finish {dict(Counter(t.finish for t in ok))}"
            + (
                f"  X-Session-Cache {dict(Counter(t.session_cache for t in ok))}"
                if system != BASELINE
                else ""
            )
            + (f"  FAILED {session.failures}: {errors}" if session.failures else "")
        )

    # Figures over runs

    def keys(self) -> list[tuple[str, str]]:
        return list(dict.fromkeys((model, ending) for model, ending, _ in self.sessions))

    def systems(self, model: str, ending: str) -> list[str]:
        return [s for s in SYSTEMS if (model, ending, s) in self.sessions]

    def figures(self, model: str, ending: str, system: str) -> dict[str, float]:
        """Medians over runs of the session rates; latency percentiles over every turn of every run."""
        sessions = self.sessions.get((model, ending, system), [])
        ok = [t for s in sessions for t in s.ok]
        first = [t.first - t.sent for t in ok if t.index == 1]
        later = [t.first - t.sent for t in ok if t.index > 1]
        e2e = [t.ended - t.sent for t in ok]
        return {
            "turns_per_min": median([s.turns_per_min for s in sessions]),
            "tokens_per_s": median([s.tokens_per_s for s in sessions]),
            "ttft_first_p50": percentile(first, 50),
            "ttft_first_p95": percentile(first, 95),
            "ttft_later_p50": percentile(later, 50),
            "ttft_later_p95": percentile(later, 95),
            "e2e_p50": percentile(e2e, 50),
            "e2e_p95": percentile(e2e, 95),
        }

    def ratio(self, model: str, ending: str, system: str, key: str) -> float:
        ours = self.figures(model, ending, system)[key]
        theirs = self.figures(model, ending, BASELINE)[key]
        return ours / theirs if theirs and not math.isnan(theirs) else float("nan")

    def targets(self, model: str, ending: str) -> list[tuple[str, float, bool, float]]:
        """Issue 12's targets for every mlxhost mode: (what, measured ratio, met, goal)."""
        out = []
        for system in self.systems(model, ending):
            if system == BASELINE or BASELINE not in self.systems(model, ending):
                continue
            for key, label, op, goal in TARGETS:
                value = self.ratio(model, ending, system, key)
                met = value >= goal if op == ">=" else value <= goal  # False for nan
                out.append((f"{system} ÷ {BASELINE} ({ending}), {label} {op} {goal}", value, met, goal))
        return out

    # Output

    def markdown(self) -> str:
        when = self.when.strftime("%Y-%m-%d %H:%M UTC") if self.when else "?"
        lines = [
            f"## {when} — multi-user chat: mlxhost vs mlx_lm.server, shared system prompt (issue 12)",
            "",
            f"Command: `{self.command}` ({self.settings}; {self.runs} run(s), systems interleaved within each"
            " run, order rotated each run).",
            "",
            machine_line(self.load),
            "",
            "Turns/min and tokens/s: the median over runs of (turns, or completion tokens) / (first request"
            " sent → last turn's stream end) per session. First-token times are request sent → first content"
            " chunk, end-to-end is request sent → end of the stream; percentiles over every turn of every run."
            " Cached: the median `cached_tokens` / `prompt_tokens` per turn number (chat:"
            " `usage.prompt_tokens_details`, Responses: `usage.input_tokens_details`)."
            f" **{BASELINE} has no Responses API**: the `mlxhost responses` rows (`/v1/responses` chained with"
            f" `previous_response_id`) are compared with {BASELINE}'s chat numbers.",
        ]
        for model, ending in self.keys():
            lines += ["", f"### {model}, turns ended by {ending}", "", *self._table(model, ending)]
            if BASELINE in self.systems(model, ending):
                lines += ["", *self._ratio_table(model, ending), ""]
                lines += [_target_line(*target) for target in self.targets(model, ending)]
        return "\n".join(lines) + "\n"

    def _table(self, model: str, ending: str) -> list[str]:
        rows = [
            "| system | API | turns/min, median [per run] | tokens/s | first token, turn 1 p50 / p95 (ms) |"
            " first token, turns 2+ p50 / p95 (ms) | end-to-end p50 / p95 (s) | cached / prompt tokens,"
            " turn 1 · 2 · … | X-Session-Cache | ended by stop | failures |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for system in self.systems(model, ending):
            sessions = self.sessions[(model, ending, system)]
            ok = [t for s in sessions for t in s.ok]
            f = self.figures(model, ending, system)
            per_run = ", ".join(f"{s.turns_per_min:.1f}" for s in sessions)
            headers = Counter(t.session_cache for t in ok if t.session_cache)
            stopped = sum(t.finish == "stop" for t in ok)
            rows.append(
                f"| {system} | {SYSTEMS[system]} | {f['turns_per_min']:.1f} [{per_run}] | {f['tokens_per_s']:.1f} |"
                f" {_ms(f['ttft_first_p50'])} / {_ms(f['ttft_first_p95'])} |"
                f" {_ms(f['ttft_later_p50'])} / {_ms(f['ttft_later_p95'])} |"
                f" {f['e2e_p50']:.2f} / {f['e2e_p95']:.2f} | {_per_turn(ok)} |"
                f" {', '.join(f'{k} {v}' for k, v in sorted(headers.items())) or '-'} |"
                f" {stopped}/{len(ok)} | {sum(s.failures for s in sessions)} |"
            )
        return rows

    def _ratio_table(self, model: str, ending: str) -> list[str]:
        ours = [s for s in self.systems(model, ending) if s != BASELINE]
        rows = [
            "| ratio | " + " | ".join(f"{s} ÷ {BASELINE}" for s in ours) + " | target |",
            "|---" * (len(ours) + 2) + "|",
        ]
        goals = {key: f"{op} {goal}" for key, _, op, goal in TARGETS}
        for key, label in RATIOS:
            cells = [f"{self.ratio(model, ending, s, key):.2f}" for s in ours]
            rows.append(f"| {label} | " + " | ".join(cells) + f" | {goals.get(key, '')} |")
        return rows

    def append_to(self, path: Path, text: str) -> None:
        append_results(path, text)

    def chart(self, path: Path) -> None:
        """Turns per minute and first-token p95 of turns 2+, per ending and system, one row per model."""
        plt = pyplot()
        models = list(dict.fromkeys(model for model, _ in self.keys()))
        panels = (
            ("turns_per_min", "turns per minute (median)", 1.0),
            ("ttft_later_p95", "first-token p95, turns 2+ (ms)", 1000.0),
        )
        fig, axes = plt.subplots(len(models), 2, figsize=(11, 4.2 * len(models)), squeeze=False)
        for row, model in zip(axes, models, strict=True):
            endings = [e for m, e in self.keys() if m == model]
            for ax, (key, label, scale) in zip(row, panels, strict=True):
                width = 0.8 / len(SYSTEMS)
                for i, system in enumerate(SYSTEMS):
                    xs = [x + (i - (len(SYSTEMS) - 1) / 2) * width for x in range(len(endings))]
                    ys = [self.figures(model, e, system)[key] * scale for e in endings]
                    ax.bar(xs, ys, width, label=system)
                ax.set_xticks(range(len(endings)), [f"ended by {e}" for e in endings])
                ax.set_ylabel(label)
                ax.set_title(f"{model}: {label}")
                ax.grid(alpha=0.3, axis="y")
                ax.margins(y=0.2)  # room for the legend above the bars
            row[0].legend(loc="upper center", ncol=len(SYSTEMS), fontsize=8)
        when = self.when.strftime("%Y-%m-%d") if self.when else ""
        workload = self.settings.split(",")[0]  # users and turns: the rest is too long for a title
        fig.suptitle(f"Multi-user chat, {workload}, {machine()['nproc']} CPU cores, {when}")
        save_chart(fig, path)


def _per_turn(turns: list[Turn]) -> str:
    """Median cached / prompt tokens for each turn number, e.g. `343/351 · 375/391`."""
    indices = sorted({t.index for t in turns})
    cells = []
    for index in indices:
        at = [t for t in turns if t.index == index]
        cells.append(
            f"{median([t.cached_tokens for t in at]):.0f}/{median([t.prompt_tokens for t in at]):.0f}"
        )
    return " · ".join(cells) or "-"


def _target_line(label: str, value: float, met: bool, goal: float) -> str:
    if met:
        return f"- met: {label}: {value:.2f}"
    return (
        f"- **missed**: {label}: {value:.2f}, off by {abs(value - goal):.2f} ({value / goal:.2f}× the target)"
    )


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"
