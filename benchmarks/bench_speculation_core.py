"""Speculation core benchmark (issue 27): an edit-like copy prompt through `MlxBatch`, speculation on vs off.

No server, no engine: the batch itself, so the ratio is the decode step's alone. Each user sends
bench_edit.py's edit request (`benchmarks/_edit_workload.py`: a ~250-token Python file, one function
renamed; greedy, no penalties, as a side-by-side run would send). Measured per mode and batch size: decode tokens/s (from the
step after every row's first token to the last token), and with speculation the tokens per
pass and the acceptance rate, plus a run whose prediction is the right answer (Predicted
Outputs). The same text with speculation on and off is checked, not assumed.

    .venv/bin/python benchmarks/bench_speculation_core.py \\
        --model /work/main/var/models/smollm2-135m-instruct-float32 --rounds 3

The machine is shared: compare ratios within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._edit_workload import edit_messages, story_messages
from mlxhost.engine.backends.base import DraftCounts
from mlxhost.engine.backends.mlx.batch import MlxBatch
from mlxhost.engine.backends.mlx.drafting import SpeculationConfig
from mlxhost.engine.types import SamplingParams


def prompts(tokenizer: object, users: int) -> list[list[int]]:
    """bench_edit.py's edit requests (one file each, a function renamed), chat-templated."""
    return [
        list(tokenizer.apply_chat_template(edit_messages(i, "core"), add_generation_prompt=True))  # type: ignore[attr-defined]
        for i in range(users)
    ]


def story_prompts(tokenizer: object, users: int) -> list[list[int]]:
    """bench_edit.py's stories: independent prose that hardly repeats (speculation must not cost)."""
    return [
        list(tokenizer.apply_chat_template(story_messages(i, "core"), add_generation_prompt=True))  # type: ignore[attr-defined]
        for i in range(users)
    ]


def run(
    model: object,
    tokenizer: object,
    ids: list[list[int]],
    max_tokens: int,
    speculation: SpeculationConfig | None,
    predictions: list[list[int]] | None = None,
    no_eos: bool = False,
) -> tuple[list[list[int]], float, float, DraftCounts]:
    """Every prompt at once; (each row's tokens, decode tokens/s by the wall clock and by this
    process's CPU time, summed speculation counts). On a shared machine the CPU-time rate
    moves less with the neighbours' load than the wall-clock one."""
    batch = MlxBatch(model, tokenizer, len(ids), speculation=speculation)
    eos = tuple((int(t), -100.0) for t in getattr(tokenizer, "eos_token_ids", ())) if no_eos else ()
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=eos)
    handles = [
        batch.insert(p, sampling, None, 0, prediction_ids=predictions[i] if predictions else None)
        for i, p in enumerate(ids)
    ]
    tokens: dict[int, list[int]] = {h: [] for h in handles}
    done: set[int] = set()
    start = None
    cpu_start = 0.0
    counted = 0
    while len(done) < len(handles):
        steps = batch.step()
        for step in steps:
            if step.token_id is not None:
                tokens[step.handle].append(step.token_id)
                if start is not None:
                    counted += 1
            if step.finish_reason is not None:
                done.add(step.handle)
        if start is None and all(tokens[h] for h in handles):
            start = time.perf_counter()  # every row has its first token: decoding from here
            cpu_start = time.process_time()
    elapsed = time.perf_counter() - (start or time.perf_counter())
    cpu = time.process_time() - cpu_start
    batch.close()
    rate = counted / elapsed if elapsed else 0.0
    return [tokens[h] for h in handles], rate, counted / cpu if cpu else 0.0, batch.speculation_totals


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="an mlx-lm model folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-draft", type=int, default=8)
    parser.add_argument(
        "--stories",
        type=int,
        default=0,
        help="also N stories at once (128 tokens, EOS suppressed), on vs off",
    )
    args = parser.parse_args()

    from mlx_lm import load

    model, tokenizer = load(args.model)
    config = SpeculationConfig(max_draft=args.max_draft)
    report: dict[str, object] = {"model": args.model, "max_tokens": args.max_tokens, "rounds": args.rounds}
    if args.stories:
        ids = story_prompts(tokenizer, args.stories)
        story_rates: dict[str, list[float]] = {"off": [], "on": []}
        story_cpu: dict[str, list[float]] = {"off": [], "on": []}
        story_texts: dict[str, list[list[int]]] = {}
        story_stats = DraftCounts()
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                story_texts[mode], rate, cpu_rate, counts = run(
                    model, tokenizer, ids, 128, None if mode == "off" else config, no_eos=True
                )
                story_rates[mode].append(rate)
                story_cpu[mode].append(cpu_rate)
                if mode == "on":
                    story_stats = counts
        report["stories"] = {
            "decode_tok_s": story_rates,
            "cpu_decode_tok_s": story_cpu,
            "on_vs_off": statistics.median(story_rates["on"]) / statistics.median(story_rates["off"]),
            "cpu_on_vs_off": statistics.median(story_cpu["on"]) / statistics.median(story_cpu["off"]),
            "round_cpu_ratios": [a / b for a, b in zip(story_cpu["on"], story_cpu["off"], strict=True)],
            "same_tokens": story_texts["on"] == story_texts["off"],
            "on_counts_drafted_accepted_passes_emitted": [
                story_stats.drafted,
                story_stats.accepted,
                story_stats.passes,
                story_stats.emitted,
            ],
        }
        print(json.dumps({"stories": report["stories"]}, indent=1), flush=True)
    for users in args.users:
        ids = prompts(tokenizer, users)
        modes = ("off", "on", "predicted")
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        cpu_rates: dict[str, list[float]] = {mode: [] for mode in modes}
        stats: dict[str, DraftCounts] = {}
        texts: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):  # interleaved: off, on, predicted, off, on, ...
            for mode in modes:
                speculation = None if mode == "off" else config
                predictions = texts["off"] if mode == "predicted" else None
                texts[mode], rate, cpu_rate, stats[mode] = run(
                    model, tokenizer, ids, args.max_tokens, speculation, predictions
                )
                rates[mode].append(rate)
                cpu_rates[mode].append(cpu_rate)
        medians = {mode: statistics.median(values) for mode, values in rates.items()}
        cpu_medians = {mode: statistics.median(values) for mode, values in cpu_rates.items()}
        report[f"users_{users}"] = {
            "decode_tok_s": medians,
            "all_tok_s": rates,
            "cpu_decode_tok_s": cpu_medians,
            "on_vs_off": medians["on"] / medians["off"],
            "predicted_vs_off": medians["predicted"] / medians["off"],
            "cpu_on_vs_off": cpu_medians["on"] / cpu_medians["off"],
            "cpu_predicted_vs_off": cpu_medians["predicted"] / cpu_medians["off"],
            "round_ratios_on_vs_off": [on / off for on, off in zip(rates["on"], rates["off"], strict=True)],
            "same_tokens": {mode: texts[mode] == texts["off"] for mode in ("on", "predicted")},
            **{
                f"{mode}_tokens_per_pass": round(s.tokens_per_pass, 3)
                for mode, s in stats.items()
                if s.passes
            },
            **{f"{mode}_acceptance": round(s.acceptance, 3) for mode, s in stats.items() if s.passes},
            **{
                f"{mode}_counts_drafted_accepted_passes_emitted": [s.drafted, s.accepted, s.passes, s.emitted]
                for mode, s in stats.items()
                if mode != "off"
            },
        }
        print(json.dumps({f"users_{users}": report[f"users_{users}"]}, indent=1), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
