"""Grammar budget: a decode step with and without a JSON schema, through the real engine (in-process)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from _common import (
    DEFAULT_MODELS_ROOT,
    MODELS,
    ROOT,
    append_results,
    ensure_model,
    loadavg,
    machine_line,
    median,
    percentile,
    state_env,
)
from mlx_lm.utils import load_tokenizer

from mlxhost.engine import (
    Done,
    Engine,
    EngineConfig,
    GenerationRequest,
    LaneSettings,
    Message,
    ModelSpec,
    SamplingParams,
)
from mlxhost.engine.backends.mlx import backend, grammar
from mlxhost.engine.backends.mlx.batch import MlxBatch
from mlxhost.engine.worker import CallJob

# Valid outputs are far longer than max_tokens (40 strings of 3+ characters), so the grammar
# never ends a sequence early: both sides decode exactly max_tokens at full batch.
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "words": {
                "type": "array",
                "items": {"type": "string", "minLength": 3, "maxLength": 12},
                "minItems": 40,
                "maxItems": 40,
            }
        },
        "required": ["words"],
        "additionalProperties": False,
    }
)
TOPICS = ("rivers", "bakeries", "trains", "gardens", "storms", "castles", "markets", "islands")


@dataclass
class GrammarClock:
    """Time inside `GrammarProcessor.__call__`: waiting for the last sampled token, then the rest."""

    calls: int = 0
    wait_s: float = 0.0
    work_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> None:
        original = grammar.GrammarProcessor.__call__
        mx = grammar.mx

        def timed(processor, tokens, logits):
            start = time.perf_counter()
            mx.eval(tokens)  # what the processor's `.item()` waits for: the previous step
            ready = time.perf_counter()
            out = original(processor, tokens, logits)
            done = time.perf_counter()
            with self.lock:
                self.calls += 1
                self.wait_s += ready - start
                self.work_s += done - ready
            return out

        grammar.GrammarProcessor.__call__ = timed  # type: ignore[method-assign]

    def take(self) -> tuple[int, float, float]:
        with self.lock:
            taken = (self.calls, self.wait_s, self.work_s)
            self.calls, self.wait_s, self.work_s = 0, 0.0, 0.0
        return taken


@dataclass
class StepClock:
    """When the worker got each decode step's tokens: `MlxBatch.step` returns (batched) and
    `stream_generate` yields (exclusive), with how many tokens came out."""

    marks: list[tuple[float, float, int]] = field(default_factory=list)  # wall, process CPU, tokens

    def install(self) -> None:
        step, generate, marks = MlxBatch.step, backend.stream_generate, self.marks

        def timed_step(batch):
            out = step(batch)
            marks.append((time.perf_counter(), time.process_time(), sum(s.token_id is not None for s in out)))
            return out

        def timed_generate(*args, **kwargs):
            for response in generate(*args, **kwargs):
                marks.append((time.perf_counter(), time.process_time(), 1))
                yield response

        MlxBatch.step = timed_step  # type: ignore[method-assign]
        backend.stream_generate = timed_generate

    def take(self, width: int) -> tuple[list[float], float]:
        """Wall seconds between two steps that each gave `width` tokens, and the process's CPU
        seconds per such step (all threads: MLX's and ours); then starts afresh."""
        marks, self.marks[:] = list(self.marks), []
        pairs = [(a, b) for a, b in itertools.pairwise(marks) if a[2] == b[2] == width]
        cpu = sum(b[1] - a[1] for a, b in pairs) / len(pairs) if pairs else float("nan")
        return [b[0] - a[0] for a, b in pairs], cpu


@dataclass
class Run:
    kind: str  # "plain" or "json"
    capacity: int
    step_ms: float  # worker-side decode time per token (first token to the last), median over requests
    gaps_ms: list[float]  # the wall time between two full decode steps on the worker
    cpu_ms: float  # the process's CPU time per full decode step
    tokens: list[int]
    finishes: list[str]
    grammar_ms: float = 0.0  # grammar work per decode step (all rows)
    wait_ms: float = 0.0  # time the processor spent waiting for the previous step's token


def requests(spec: ModelSpec, kind: str, count: int, max_tokens: int, eos_bias) -> list[GenerationRequest]:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=eos_bias)
    made = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        request = GenerationRequest(
            request_id=f"{kind}-{i}-{time.monotonic_ns()}",
            binding=f"instance:{spec.instance_id}",
            sampling=sampling,
            messages=(Message("user", f"List forty words about {topic}, as JSON."),),
        )
        made.append(replace(request, json_format=SCHEMA) if kind == "json" else request)
    return made


async def run_batch(engine: Engine, batch: list[GenerationRequest]) -> list[Done]:
    """Submit `batch` while the worker is held, so every request joins the same first step."""
    hold = threading.Event()
    engine.get(1)._worker.submit(CallJob(lambda: hold.wait(30), lambda _r, _e: None))
    try:
        generations = [await engine.submit(r) for r in batch]
    finally:
        hold.set()

    async def last(generation) -> Done:
        events = [event async for event in generation.stream()]
        if not isinstance(events[-1], Done):
            raise RuntimeError(f"generation failed: {events[-1]}")
        return events[-1]

    return await asyncio.gather(*(last(g) for g in generations))


async def measure(engine, spec, kind, args, eos_bias, clock: GrammarClock, steps: StepClock) -> Run:
    clock.take()
    steps.take(0)
    dones = await run_batch(engine, requests(spec, kind, spec.lane.capacity, args.max_tokens, eos_bias))
    calls, wait_s, work_s = clock.take()
    count = max(calls / spec.lane.capacity, 1)  # one call per row per sampled token
    gaps, cpu = steps.take(spec.lane.capacity)
    return Run(
        kind,
        spec.lane.capacity,
        median([1000 / d.timings.decode_tps for d in dones]),
        [1000 * g for g in gaps],
        1000 * cpu,
        [d.usage.completion_tokens for d in dones],
        [d.finish_reason for d in dones],
        grammar_ms=1000 * work_s / count,
        wait_ms=1000 * wait_s / count,
    )


async def bench_capacity(folder: Path, capacity: int, args, eos_bias, clock, steps) -> list[Run]:
    engine = Engine(EngineConfig(backend="mlx"))
    spec = ModelSpec(
        instance_id=1, source=str(folder), fingerprint="f" * 64, lane=LaneSettings(capacity=capacity)
    )
    await engine.load(spec)
    runs = []
    try:
        for kind in ("plain", "json"):  # warm-up: compile the schema, fill the prefix cache
            await measure(engine, spec, kind, args, eos_bias, clock, steps)
        for _ in range(args.repeats):
            for kind in ("plain", "json"):
                run = await measure(engine, spec, kind, args, eos_bias, clock, steps)
                print(
                    f"  capacity {capacity} {kind:5}: {run.step_ms:7.1f} ms/step (median {median(run.gaps_ms):.1f},"
                    f" fastest tenth {percentile(run.gaps_ms, 10):.1f}, CPU {run.cpu_ms:.1f}),"
                    f" grammar"
                    f" {run.grammar_ms:5.2f} ms/step (+{run.wait_ms:.1f} ms waiting for the token),"
                    f" tokens {sorted(set(run.tokens))} {sorted(set(run.finishes))} load {loadavg()}",
                    flush=True,
                )
                runs.append(run)
    finally:
        await engine.shutdown()
    return runs


def summary(runs: list[Run], capacity: int) -> dict[str, float]:
    """Medians over runs of each kind at `capacity`, and the JSON / plain ratios."""
    row: dict[str, float] = {}
    for kind in ("plain", "json"):
        mine = [r for r in runs if r.capacity == capacity and r.kind == kind]
        row[f"{kind}_mean"] = median([r.step_ms for r in mine])
        row[f"{kind}_median"] = median([median(r.gaps_ms) for r in mine])
        row[f"{kind}_p10"] = percentile([g for r in mine for g in r.gaps_ms], 10)
        row[f"{kind}_cpu"] = median([r.cpu_ms for r in mine])
    for measure in ("mean", "median", "p10", "cpu"):
        row[f"{measure}_ratio"] = row[f"json_{measure}"] / row[f"plain_{measure}"]
    constrained = [r for r in runs if r.capacity == capacity and r.kind == "json"]
    plain = [r for r in runs if r.capacity == capacity and r.kind == "plain"]
    # Each JSON run against the plain run just before it: load that drifts over minutes cancels.
    row["paired_ratio"] = median(
        [median(j.gaps_ms) / median(p.gaps_ms) for p, j in zip(plain, constrained, strict=True)]
    )
    row["grammar_ms"] = median([r.grammar_ms for r in constrained])
    row["wait_ms"] = median([r.wait_ms for r in constrained])
    row["share"] = row["grammar_ms"] / row["json_median"]
    return row


def report(runs: list[Run], args, folder: Path, command: str, load: list[float]) -> str:
    lines = [
        f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC — Grammar budget at batch 8 (issue 13)",
        "",
        f"Command: `{command}`",
        "",
        f"{machine_line(load)}",
        "",
        f'Model `{folder.name}`, in-process `Engine(EngineConfig(backend="mlx"))`, greedy,'
        f" {args.max_tokens} tokens per request (logit_bias −100 on EOS on both sides; the schema's"
        " shortest valid output is longer than that, so every request ends on `length`), `capacity`"
        " requests submitted while the worker is held so they join one step (capacity 1: the exclusive"
        " path, `stream_generate`; 8: `MlxBatch`). Plain and JSON-schema runs alternate,"
        f" {args.repeats} of each per capacity after one warm-up of each. Per step, plain → JSON (ratio):"
        " *mean*: worker-side decode time per token (first token to the last), median over the"
        " requests of a run, then over runs; *median*: the median wall time between two full decode"
        " steps on the worker (`MlxBatch.step` returns, `stream_generate` yields), median over runs;"
        " *fastest tenth*: the 10th percentile of those gaps over all runs, the least disturbed by"
        " other load; *paired*: the median over runs of each JSON run's median step over the plain run"
        " just before it; *CPU*: the process's CPU time (all threads) per step. *Grammar*: time inside"
        " `GrammarProcessor.__call__` per step, all rows summed, after its `.item()` wait for the"
        " previous step's token, shown apart (*wait*); its share is of the JSON median step.",
        "",
        "| capacity | mean step ms | median step ms | fastest tenth ms | paired | CPU ms/step"
        " | grammar ms/step | grammar share | wait ms/step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for capacity in args.capacities:
        s = summary(runs, capacity)
        cells = [
            f"{s[f'plain_{m}']:.1f} → {s[f'json_{m}']:.1f} ({s[f'{m}_ratio']:.3f})"
            for m in ("mean", "median", "p10", "cpu")
        ]
        cells.insert(3, f"{s['paired_ratio']:.3f}")
        lines.append(
            f"| {capacity} | {' | '.join(cells)} | {s['grammar_ms']:.2f} | {100 * s['share']:.1f} % |"
            f" {s['wait_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="demo")
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    parser.add_argument("--folder", help="a model folder to use instead of --model under --models-root")
    parser.add_argument("--capacities", type=lambda s: [int(x) for x in s.split(",")], default=[8, 1])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind per capacity")
    parser.add_argument("--results", type=Path, default=None, help="append the table to this file")
    args = parser.parse_args()
    if args.folder:
        folder = Path(args.folder).resolve()
    else:
        with tempfile.TemporaryDirectory(prefix="mlxhost-bench-") as tmp:
            folder = ensure_model(state_env(Path(args.models_root).resolve(), Path(tmp)), args.model)
    eos_bias = tuple((int(i), -100.0) for i in sorted(load_tokenizer(folder).eos_token_ids))
    clock, steps = GrammarClock(), StepClock()
    clock.install()
    steps.install()
    load = [loadavg()]
    print(f"model={folder.name} capacities={args.capacities} load={load[0]}", flush=True)
    runs: list[Run] = []
    for capacity in args.capacities:
        runs += asyncio.run(bench_capacity(folder, capacity, args, eos_bias, clock, steps))
    load.append(loadavg())
    command = "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]])
    text = report(runs, args, folder, command, load)
    print(text)
    if args.results:
        append_results(args.results if args.results.is_absolute() else ROOT / args.results, text)


if __name__ == "__main__":
    main()
