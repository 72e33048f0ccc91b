"""Prefill fairness: how long running streams stall while a long prompt joins the batch (MlxBatch, in-process)."""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

from _common import DEFAULT_MODELS_ROOT, MODELS, ensure_model, loadavg, machine, median, render, state_env
from mlx_lm import load

from mlxhost.engine.backends.mlx.batch import PREFILL_STEP, PREFILL_STEP_ALONE, MlxBatch
from mlxhost.engine.types import SamplingParams

FILLER = (
    "The river ran past the town, through the valley and all the way to the sea, and the baker "
    "kept the traveller's map on the wall of his shop for many years. "
)


def long_prompt(tokenizer, n: int) -> list[int]:
    """A chat-templated prompt of exactly `n` tokens (filler text cut to length)."""
    head = render(tokenizer, [{"role": "user", "content": "Summarize this text:"}])
    filler = tokenizer.encode(FILLER, add_special_tokens=False)
    return (head + filler * (n // len(filler) + 1))[:n]


def measure(model, tokenizer, args, prefill_step: int, prefill_step_alone: int) -> dict:
    """Two streams decode; a long prompt arrives; time the streams' tokens until its first token."""
    eos_bias = tuple((int(i), -100.0) for i in tokenizer.eos_token_ids)
    running = SamplingParams(temperature=0.0, max_tokens=100_000, logit_bias=eos_bias)
    batch = MlxBatch(
        model, tokenizer, capacity=4, prefill_step=prefill_step, prefill_step_alone=prefill_step_alone
    )
    short = [
        render(tokenizer, [{"role": "user", "content": text}])
        for text in ("Tell me about the river.", "Describe the bakery.")
    ]
    streams = {batch.insert(ids, running, None, 0): [] for ids in short}
    while min(len(t) for t in streams.values()) < args.warmup_tokens:
        now_steps = batch.step()
        now = time.perf_counter()
        for step in now_steps:
            streams[step.handle].append(now)
    before = [b - a for t in streams.values() for a, b in zip(t[-5:], t[-4:], strict=False)]
    arrived = time.perf_counter()
    long_ids = long_prompt(tokenizer, args.prompt_tokens)
    newcomer = batch.insert(long_ids, SamplingParams(temperature=0.0, max_tokens=4), None, 0)
    steps, during = 0, {h: [arrived] for h in streams}
    first_token = None
    while first_token is None:
        responses = batch.step()
        now = time.perf_counter()
        steps += 1
        for step in responses:
            if step.handle == newcomer:
                first_token = now
            else:
                during[step.handle].append(now)
    batch.close()
    gaps = [b - a for t in during.values() for a, b in itertools.pairwise(t)]
    return {
        "prefill_step": prefill_step,
        "prefill_step_alone": prefill_step_alone,
        "prompt_tokens": len(long_ids),
        "gap_before_ms": median(before) * 1000,
        "max_gap_ms": max(gaps) * 1000 if gaps else float("nan"),
        "stream_tokens_during": min(len(t) - 1 for t in during.values()),
        "steps_to_first_token": steps,
        "newcomer_ttft_s": first_token - arrived,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="demo")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--warmup-tokens", type=int, default=8, help="tokens each stream makes first")
    parser.add_argument(
        "--steps",
        default=f"2048:2048,{PREFILL_STEP}:{PREFILL_STEP_ALONE}",
        help="comma-separated prefill_step:prefill_step_alone pairs (2048:2048 = mlx-lm's default,"
        " the behaviour before chunking)",
    )
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-") as tmp:
        env = state_env(Path(args.models_root).resolve(), Path(tmp))
        folder = ensure_model(env, args.model)
    model, tokenizer = load(str(folder))
    print(f"model={args.model} {machine()} load={loadavg()}")
    for pair in args.steps.split(","):
        step, alone = (int(x) for x in pair.split(":"))
        row = measure(model, tokenizer, args, step, alone)
        print(
            f"  prefill_step={step:<5} alone={alone:<5} prompt={row['prompt_tokens']} tokens:"
            f" stream gap before {row['gap_before_ms']:.0f} ms, max gap while it prefilled"
            f" {row['max_gap_ms']:.0f} ms, stream tokens meanwhile {row['stream_tokens_during']},"
            f" steps {row['steps_to_first_token']}, newcomer TTFT {row['newcomer_ttft_s']:.2f} s"
            f" (load {loadavg()})",
            flush=True,
        )


if __name__ == "__main__":
    main()
