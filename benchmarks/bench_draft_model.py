"""Draft-model speculation in the batch, alone (no server): acceptance, tokens per pass, rates.

bench_speculation_core.py's edit prompts (a ~250-token file back with one function renamed) and
story prompts, greedy, through `MlxBatch` four ways, interleaved: off; prompt lookup; the draft
model as the planner sees it (measured costs, draft forwards priced); and the draft model with
every pass drafting (flat costs, draft forwards free: the acceptance ceiling). Decode tokens/s
counts from the step after every row's first token; CPU time moves less with the machine's load.

    .venv/bin/python benchmarks/bench_draft_model.py \\
        --model /work/main/var/models/smollm2-135m-instruct-float32 --draft DRAFT_FOLDER
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_speculation_core import prompts, story_prompts
from mlxhost.engine.backends.mlx.batch import MlxBatch
from mlxhost.engine.backends.mlx.draft_model import DraftCost, DraftModelRows, check_draft, weight_bytes
from mlxhost.engine.backends.mlx.drafting import PassCost, SpeculationConfig
from mlxhost.engine.types import SamplingParams

FLAT = SpeculationConfig(cost=PassCost({1: {1: 1.0, 64: 1.0}}), measure=False)


def run(
    model: Any,
    tokenizer: Any,
    draft: Any,
    ids: list[list[int]],
    max_tokens: int,
    mode: str,
    no_eos: bool = False,
) -> tuple[list[list[int]], dict[str, float]]:
    speculation, rows = None, None
    if mode == "lookup":
        speculation = SpeculationConfig()
    elif mode == "draft":
        share = weight_bytes(draft) / weight_bytes(model)
        speculation, rows = SpeculationConfig(), DraftModelRows(draft, DraftCost(share))
    elif mode == "draft-always":
        speculation, rows = FLAT, DraftModelRows(draft, DraftCost(0.0, measured=False))
    batch = MlxBatch(model, tokenizer, len(ids), speculation=speculation, draft=rows)
    eos = tuple((int(t), -100.0) for t in tokenizer.eos_token_ids) if no_eos else ()
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=eos)
    handles = [batch.insert(p, sampling, None, 0) for p in ids]
    tokens: dict[int, list[int]] = {h: [] for h in handles}
    done: set[int] = set()
    start, cpu_start, counted = None, 0.0, 0
    while len(done) < len(handles):
        for step in batch.step():
            if step.token_id is not None:
                tokens[step.handle].append(step.token_id)
                counted += start is not None
            if step.finish_reason is not None:
                done.add(step.handle)
        if start is None and all(tokens[h] for h in handles):
            start, cpu_start = time.perf_counter(), time.process_time()
    wall, cpu = time.perf_counter() - (start or 0.0), time.process_time() - cpu_start
    batch.close()
    totals = batch.speculation_totals
    return [tokens[h] for h in handles], {
        "tok_s": round(counted / wall, 2) if wall else 0.0,
        "cpu_tok_s": round(counted / cpu, 2) if cpu else 0.0,
        "tokens_per_pass": round(totals.tokens_per_pass, 2),
        "acceptance": round(totals.acceptance, 3),
        "drafted": totals.drafted,
        "draft_forwards": rows.forwards if rows is not None else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--stories", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["off", "lookup", "draft", "draft-always"])
    args = parser.parse_args()

    from mlx_lm import load

    model, tokenizer = load(args.model)[:2]
    draft, draft_tokenizer = load(args.draft)[:2]
    check_draft(tokenizer, draft, draft_tokenizer)
    modes = args.modes
    workloads = [(f"edit x{u}", prompts(tokenizer, u), False) for u in args.users]
    if args.stories:
        workloads.append((f"stories x{args.stories}", story_prompts(tokenizer, args.stories), True))
    report: dict[str, object] = {"model": args.model, "draft": args.draft, "max_tokens": args.max_tokens}
    for name, ids, no_eos in workloads:
        results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        texts: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for mode in modes:
                texts[mode], figures = run(model, tokenizer, draft, ids, args.max_tokens, mode, no_eos)
                results[mode].append(figures)
                print(name, mode, figures, file=sys.stderr, flush=True)
        report[name] = {
            mode: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
            for mode, rounds in results.items()
        } | {"same_tokens": all(texts[m] == texts[modes[0]] for m in modes)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
