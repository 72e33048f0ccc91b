"""bench_edit.py's figures and its RESULTS.md section: per-wave tokens/s, text identity, Predicted Outputs, targets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from _common import SseStream, append_results, machine_line, median

if TYPE_CHECKING:
    import argparse
    from datetime import datetime
    from pathlib import Path

BASELINE, OURS, NO_SPEC = "mlx_lm.server", "mlxhost", "mlxhost speculation off"
# (workload, system ÷ BASELINE, goal): issue 27's targets, decode tokens/s
TARGETS = [("edit-1", 1.3), ("edit-4", 1.15), ("stories", 0.95)]
PREDICTED_GOAL = 3.0


@dataclass
class Wave:
    """Requests sent at once to one system: their streams and errors, and the /metrics deltas."""

    started: float
    streams: list[SseStream]
    errors: list[str]
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> list[SseStream]:
        return [s for s, e in zip(self.streams, self.errors, strict=True) if not e]

    @property
    def failures(self) -> int:
        return sum(bool(e) for e in self.errors)

    @property
    def decode_tps(self) -> float:
        """Σ (completion tokens − 1) / (last content chunk of any request − first of any)."""
        ok = [s for s in self.ok if s.times]
        if not ok:
            return float("nan")
        span = max(s.times[-1] for s in ok) - min(s.times[0] for s in ok)
        return sum(s.tokens - 1 for s in ok) / span if span > 0 else float("nan")

    @property
    def wall_tps(self) -> float:
        """Σ completion tokens / (first request sent → last content chunk), prefill included."""
        ok = [s for s in self.ok if s.times]
        return (
            sum(s.tokens for s in ok) / (max(s.times[-1] for s in ok) - self.started) if ok else float("nan")
        )

    @property
    def texts(self) -> list[str]:
        return ["".join(s.parts) for s in self.streams]

    def details(self, name: str) -> list[int]:
        """`usage.completion_tokens_details[name]` of every request that reported it."""
        values = [(s.usage.get("completion_tokens_details") or {}).get(name) for s in self.ok]
        return [int(v) for v in values if v is not None]


class EditReport:
    def __init__(self, *, command: str, args: argparse.Namespace) -> None:
        self.command, self.args = command, args
        self.waves: dict[tuple[str, str], dict[int, Wave]] = {}
        self.load: list[float] = []
        self.when: datetime | None = None
        self.speculation_setting: dict = {}
        self.prompt_tokens: list[int] = []

    def started(self, when: datetime, load: float) -> None:
        self.when, self.load = when, [load]

    def finished(self, load: float) -> None:
        self.load.append(load)

    def add(self, workload: str, system: str, run: int, wave: Wave) -> None:
        self.waves.setdefault((workload, system), {})[run] = wave

    def failures(self) -> int:
        """Failed requests; a refused `prediction` is reported in the tables, not counted."""
        return sum(
            w.failures for (load, _), runs in self.waves.items() if load != "predicted" for w in runs.values()
        )

    def systems(self, workload: str) -> list[str]:
        return [s for s in (BASELINE, OURS, NO_SPEC) if (workload, s) in self.waves]

    def workloads(self) -> list[str]:
        return [w for w in dict.fromkeys(w for w, _ in self.waves) if not w.startswith("predicted")]

    def figure(self, workload: str, system: str, key: str = "decode_tps") -> float:
        runs = self.waves.get((workload, system), {})
        return median([v for w in runs.values() if not math.isnan(v := getattr(w, key))])

    def ratio(self, workload: str, system: str) -> float:
        ours, theirs = self.figure(workload, system), self.figure(workload, BASELINE)
        return ours / theirs if theirs and not math.isnan(theirs) else float("nan")

    # Console lines

    def line(self, workload: str, system: str, run: int) -> str:
        wave = self.waves[(workload, system)][run]
        counters = f" counters {_short(wave.counters)}" if wave.counters else ""
        errors = f" FAILED {sorted(set(e for e in wave.errors if e))}" if wave.failures else ""
        return (
            f"{workload:8} {system:24} decode {wave.decode_tps:6.1f} tok/s, wall {wave.wall_tps:6.1f} tok/s,"
            f" tokens {[s.tokens for s in wave.streams]}{counters}{errors}"
        )

    def predicted_line(self, run: int) -> str:
        plain, pred = self.waves[("predicted-plain", OURS)][run], self.waves[("predicted", OURS)][run]
        if pred.failures:
            return f"predicted: the request with `prediction` failed: {pred.errors}"
        same = pred.texts == plain.texts
        return (
            f"predicted: plain {plain.decode_tps:.1f} tok/s, with prediction {pred.decode_tps:.1f} tok/s"
            f" (×{pred.decode_tps / plain.decode_tps:.2f}), accepted {pred.details('accepted_prediction_tokens')}"
            f" rejected {pred.details('rejected_prediction_tokens')}, same text {same}"
            + (f", counters {_short(pred.counters)}" if pred.counters else "")
        )

    # Text identity

    def mismatches(self, workload: str, system: str, against: str = BASELINE) -> tuple[int, int, list[str]]:
        """(identical answers, compared answers, a note on each difference) over every run."""
        same = total = 0
        notes = []
        mine, theirs = self.waves.get((workload, system), {}), self.waves.get((workload, against), {})
        for run in sorted(set(mine) & set(theirs)):
            for index, (a, b) in enumerate(zip(mine[run].texts, theirs[run].texts, strict=True)):
                if mine[run].errors[index] or theirs[run].errors[index]:
                    continue
                total += 1
                if a == b:
                    same += 1
                else:
                    notes.append(f"run {run + 1}, request {index}: {_first_difference(a, b)}")
        return same, total, notes

    # Output

    def markdown(self) -> str:
        when = self.when.strftime("%Y-%m-%d %H:%M UTC") if self.when else "?"
        a = self.args
        lines = [
            f"## {when} — edit workload, Predicted Outputs, 8 stories: mlxhost vs mlx_lm.server (issue 27)",
            "",
            f"Command: `{self.command}` (model {a.model}; edit: users {', '.join(map(str, a.users))} at once, each a"
            f" Python file of {'/'.join(map(str, self.prompt_tokens))} prompt tokens (chat-templated) back with one"
            f" function renamed, max_tokens {a.edit_tokens}, EOS allowed; stories: {a.stories} at once,"
            f" {a.story_tokens} tokens, EOS suppressed with logit_bias −100; greedy, no penalties, the same"
            f" sampling sent to every system; {a.runs} run(s), systems interleaved within each run, order rotated"
            " each run; a new tag per run in the system prompt, and a `cache_salt` per mlxhost system and run).",
            "",
            machine_line(self.load),
            "",
            f"Speculation setting on the alias: {self._setting_words()}",
            "",
            "decode tok/s: per wave, Σ (`usage.completion_tokens` − 1) / (last content chunk of any request −"
            " first content chunk of any request), median over runs [each run]; for one user, that request's"
            " decode tokens/s. wall tok/s: Σ completion tokens / (first request sent → last content chunk).",
            "",
            "| workload | system | decode tok/s, median [per run] | wall tok/s | tokens per request |"
            " tokens per content chunk | same text as mlx_lm.server | failures |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for workload in self.workloads():
            lines += [self._row(workload, system) for system in self.systems(workload)]
        lines += ["", *self._ratio_lines(), "", *self._predicted_lines(), "", *self._counter_lines()]
        notes = [
            f"- {workload}, {system}{'' if against == BASELINE else f' vs {against}'}: {note}"
            for workload in self.workloads()
            for system, against in ((OURS, BASELINE), (NO_SPEC, BASELINE), (OURS, NO_SPEC))
            for note in self.mismatches(workload, system, against)[2][:3]
        ]
        if notes:
            lines += ["", "Text differences (first differing character; at most three per pair):", "", *notes]
        return "\n".join(lines) + "\n"

    def _setting_words(self) -> str:
        spec = self.speculation_setting
        if not spec.get("field"):
            related = f" (fields named speculation…: {spec['fields']})" if spec.get("fields") else ""
            return (
                f"ModelAlias has no `speculation` field{related}: mlxhost ran with the engine's default, no third"
                " system."
            )
        if spec.get("off") is None:
            return f"`speculation` = {spec.get('on')!r} (no value found that turns it off: no third system)."
        return (
            f"`{OURS}` has `speculation` = {spec.get('on')!r} (the default); `{NO_SPEC}` is a second alias on the"
            f" same model with `speculation` = {spec.get('off')!r}, served by the same process."
        )

    def _row(self, workload: str, system: str) -> str:
        runs = self.waves[(workload, system)]
        per_run = ", ".join(f"{w.decode_tps:.1f}" for _, w in sorted(runs.items()))
        streams = [s for w in runs.values() for s in w.ok]
        tokens = median([s.tokens for s in streams])
        chunks = sum(s.tokens for s in streams) / max(1, sum(len(s.times) for s in streams))
        if system == BASELINE:
            identical = "-"
        else:
            same, total, _ = self.mismatches(workload, system)
            identical = f"{same}/{total}" if total else "-"
        return (
            f"| {workload} | {system} | {self.figure(workload, system):.1f} [{per_run}] |"
            f" {self.figure(workload, system, 'wall_tps'):.1f} | {tokens:.0f} | {chunks:.2f} | {identical} |"
            f" {sum(w.failures for w in runs.values())} |"
        )

    def _ratio_lines(self) -> list[str]:
        lines = []
        for system in (OURS, NO_SPEC):
            cells = [
                f"{w} {self.ratio(w, system):.2f}"
                for w in self.workloads()
                if (w, system) in self.waves and (w, BASELINE) in self.waves
            ]
            if cells:
                lines.append(f"- {system} ÷ {BASELINE}, decode tok/s: {'; '.join(cells)}")
        if any((w, NO_SPEC) in self.waves for w in self.workloads()):
            gains = [
                f"{w} {self.figure(w, OURS) / self.figure(w, NO_SPEC):.2f}"
                for w in self.workloads()
                if (w, OURS) in self.waves and (w, NO_SPEC) in self.waves
            ]
            lines.append(f"- {OURS} ÷ {NO_SPEC} (what speculation gives), decode tok/s: {'; '.join(gains)}")
        lines += ["", "Targets (issue 27):", ""]
        for workload, goal in TARGETS:
            if (workload, OURS) in self.waves and (workload, BASELINE) in self.waves:
                label = f"{workload}: {OURS} ÷ {BASELINE}, decode tok/s ≥ {goal}"
                lines.append(_target_line(label, self.ratio(workload, OURS), goal))
        edits = [w for w in self.workloads() if w.startswith("edit-")]
        counts = [self.mismatches(w, OURS) for w in edits if (w, BASELINE) in self.waves]
        same, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
        if total:
            met = "met" if same == total else "**missed**"
            lines.append(f"- {met}: edit texts identical to {BASELINE}'s greedy answers: {same}/{total}")
        lines.append(self._predicted_target())
        return lines

    def _predicted_ratio(self) -> tuple[float, list[float]]:
        plain, pred = self.waves.get(("predicted-plain", OURS), {}), self.waves.get(("predicted", OURS), {})
        runs = [r for r in sorted(pred) if not pred[r].failures and r in plain]
        ratios = [pred[r].decode_tps / plain[r].decode_tps for r in runs]
        a = median([plain[r].decode_tps for r in runs])
        b = median([pred[r].decode_tps for r in runs])
        return (b / a if runs else float("nan")), ratios

    def _predicted_target(self) -> str:
        if ("predicted", OURS) not in self.waves:
            return "- not run: Predicted Outputs (`--no-predicted`, or no mlxhost)"
        ratio, _ = self._predicted_ratio()
        return _target_line(
            f"Predicted Outputs: with ÷ without `prediction`, decode tok/s ≥ {PREDICTED_GOAL}", ratio, 3.0
        )

    def _predicted_lines(self) -> list[str]:
        pred = self.waves.get(("predicted", OURS), {})
        if not pred:
            return []
        plain = self.waves[("predicted-plain", OURS)]
        ratio, ratios = self._predicted_ratio()
        failed = sorted({e for w in pred.values() for e in w.errors if e})
        accepted = [v for w in pred.values() for v in w.details("accepted_prediction_tokens")]
        rejected = [v for w in pred.values() for v in w.details("rejected_prediction_tokens")]
        same = sum(pred[r].texts == plain[r].texts for r in pred if r in plain and not pred[r].failures)
        return [
            f"Predicted Outputs ({OURS}, user 0's edit): (a) without `prediction`, then (b) with"
            ' `prediction={"type": "content", "content": <(a)\'s answer>}`, each in a cache domain of its own.',
            "",
            f"- decode tok/s: (a) {self.figure('predicted-plain', OURS):.1f}, (b) {self.figure('predicted', OURS):.1f};"
            f" (b) ÷ (a) {ratio:.2f} [per run: {', '.join(f'{r:.2f}' for r in ratios)}]",
            f"- `usage.completion_tokens_details`: accepted_prediction_tokens {accepted or 'not reported'},"
            f" rejected_prediction_tokens {rejected or 'not reported'}"
            + ("" if accepted or rejected else " (the server may ignore `prediction`)")
            + f"; (b)'s text equals (a)'s in {same}/{len(pred)}"
            + (f"; **failed**: {failed}" if failed else ""),
        ]

    def _counter_lines(self) -> list[str]:
        rows = []
        for (workload, system), runs in self.waves.items():
            total: dict[str, float] = {}
            for wave in runs.values():
                for name, value in wave.counters.items():
                    total[name] = total.get(name, 0.0) + value
            if total:
                derived = _derived(total, sum(s.tokens for w in runs.values() for s in w.ok))
                rows.append(f"- {workload}, {system}: {_short(total)}{derived}")
        if not rows:
            return ["`/metrics` shows no `mlxhost_speculation_*` counters (or none moved): tokens per pass and"
                    " acceptance are not reported by this server."]  # fmt: skip
        return [
            "`mlxhost_speculation_*` counters in `/metrics`, the change over each system's runs:",
            "",
            *rows,
        ]

    def append_to(self, path: Path, text: str) -> None:
        append_results(path, text)


def _derived(total: dict[str, float], tokens: int) -> str:
    """Acceptance and tokens per pass, when the counters' names say which is which."""

    def pick(word: str) -> float | None:
        values = [v for name, v in total.items() if word in name.split("{")[0] and "rate" not in name]
        return sum(values) if values else None

    drafted, accepted, passes, emitted = pick("drafted"), pick("accepted"), pick("passes"), pick("emitted")
    out = []
    if drafted and accepted is not None:
        out.append(f"acceptance {accepted / drafted:.2f}")
    if passes and emitted is not None:
        out.append(f"{emitted / passes:.2f} tokens per pass")
    elif passes:
        out.append(f"{tokens / passes:.2f} completion tokens per pass")
    return f" → {', '.join(out)}" if out else ""


def _short(counters: dict[str, float]) -> str:
    """`drafted_tokens +68, accepted_tokens +22, …`: each counter summed over its labels (one model here)."""
    summed: dict[str, float] = {}
    for name, value in counters.items():
        short = name.split("{")[0].removeprefix("mlxhost_speculation_").removesuffix("_total")
        summed[short] = summed.get(short, 0.0) + value
    return ", ".join(f"{name} {value:+g}" for name, value in summed.items())


def _first_difference(a: str, b: str) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"character {at}: {a[max(0, at - 20) : at + 20]!r} vs {b[max(0, at - 20) : at + 20]!r}"


def _target_line(label: str, value: float, goal: float) -> str:
    if not math.isnan(value) and value >= goal:
        return f"- met: {label}: {value:.2f}"
    return (
        f"- **missed**: {label}: {value:.2f}, off by {abs(value - goal):.2f} ({value / goal:.2f}× the target)"
    )
