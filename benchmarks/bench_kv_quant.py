"""Quantized KV cache (issue 28 §3): how far 8- and 4-bit KV move the demo model, and what it saves.

No server: the model alone, so the figures are the cache format's. Each prompt is a 1k+ token
chat-templated request to summarise a source file of this repository (real code and prose). For
each one the full-precision KV gives a greedy continuation of `--tokens` tokens; the same prompt
and continuation are then fed with quantized KV (the prompt prefilled in chunks into
`QuantizedKVCache`, as mlx-lm's `kv_bits` does, then the continuation in one pass), and at every
continuation position the quantized run's argmax is compared with the full-precision token
(greedy agreement, teacher-forced: one disagreement does not spoil the positions after it) and its
log-probability of that token with the full-precision one (mean absolute difference, nats).

Cached tokens per GB: 1e9 / the bytes one token's KV takes across the layers, measured on the
caches themselves (`nbytes` / tokens), beside the estimate the engine budgets with.

    .venv/bin/python benchmarks/bench_kv_quant.py \\
        --model var/models/smollm2-135m-instruct-float32 [--prompts 20] [--tokens 32] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxhost.engine.backends.mlx.blas import preload_openblas

preload_openblas()

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache  # noqa: E402

from benchmarks._common import loadavg, machine_line  # noqa: E402
from mlxhost.engine import KVQuantization  # noqa: E402
from mlxhost.engine.backends.mlx.backend import _kv_bytes_per_token  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 256
FORMATS = {"8-bit, groups of 64": KVQuantization(8, 64), "4-bit, groups of 64": KVQuantization(4, 64)}


def prompts(tokenizer, count: int, least: int = 1000) -> list[list[int]]:
    """Chat-templated "summarise this file" requests over the repository's larger source files."""
    files = sorted(
        (p for p in (ROOT / "mlxhost").rglob("*.py") if p.stat().st_size > 6000), key=lambda p: str(p)
    )
    out = []
    for path in files:
        text = path.read_text()
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Summarise what this file does.\n\n{text[:9000]}"}],
            add_generation_prompt=True,
        )
        if len(ids) >= least:
            out.append(list(ids)[:2000])
        if len(out) == count:
            break
    return out


def prefill(model, prompt: list[int], cache: list) -> mx.array:
    """Feed the prompt in chunks; the logits of its last position."""
    logits = None
    for start in range(0, len(prompt), CHUNK):
        logits = model(mx.array([prompt[start : start + CHUNK]]), cache=cache)
        mx.eval([c.state for c in cache])
    assert logits is not None
    return logits[:, -1, :]


def greedy(model, prompt: list[int], tokens: int) -> tuple[list[int], list[KVCache]]:
    cache = make_prompt_cache(model)
    logits = prefill(model, prompt, cache)
    out = []
    for _ in range(tokens):
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return out, cache


def forced(model, prompt: list[int], continuation: list[int], cache: list) -> mx.array:
    """Log-probabilities at each continuation position, the continuation fed in one pass."""
    last = prefill(model, prompt, cache)
    rest = model(mx.array([continuation[:-1]]), cache=cache)[0]
    logits = mx.concatenate([last, rest], axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def quantized_cache(model, q: KVQuantization) -> list[QuantizedKVCache]:
    return [QuantizedKVCache(group_size=q.group_size, bits=q.bits) for _ in make_prompt_cache(model)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT / "var/models/smollm2-135m-instruct-float32"))
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    load_start = loadavg()
    model, tokenizer = load(args.model)
    batch = prompts(tokenizer, args.prompts)
    started = time.perf_counter()
    rows: dict[str, dict[str, list[float]]] = {name: {"agree": [], "diff": []} for name in FORMATS}
    sizes: dict[str, float] = {}
    for prompt in batch:
        continuation, full_cache = greedy(model, prompt, args.tokens)
        reference = forced(model, prompt, continuation, make_prompt_cache(model))
        picked = mx.array(continuation)
        ref_lp = mx.take_along_axis(reference, picked[:, None], axis=-1)[:, 0]
        sizes["full precision"] = sum(c.nbytes for c in full_cache) / full_cache[0].offset
        for name, q in FORMATS.items():
            cache = quantized_cache(model, q)
            got = forced(model, prompt, continuation, cache)
            agree = (mx.argmax(got, axis=-1) == picked).astype(mx.float32).mean().item()
            lp = mx.take_along_axis(got, picked[:, None], axis=-1)[:, 0]
            rows[name]["agree"].append(agree)
            rows[name]["diff"].append(mx.abs(lp - ref_lp).mean().item())
            sizes[name] = sum(c.nbytes for c in cache) / cache[0].offset
    elapsed = time.perf_counter() - started
    lengths = [len(p) for p in batch]
    command = "python benchmarks/bench_kv_quant.py " + " ".join(a for a in sys.argv[1:] if a != "--write")
    lines = [
        f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC — quantized KV cache: exactness and capacity (issue 28)",
        "",
        f"Command: `{command or 'python benchmarks/bench_kv_quant.py'}` ({len(batch)} prompts of "
        f"{min(lengths)}–{max(lengths)} tokens, each a chat-templated request to summarise one of this "
        f"repository's source files; {args.tokens} greedy tokens each; demo model "
        f"`{Path(args.model).name}`; {elapsed:.0f} s).",
        "",
        machine_line((load_start, loadavg())),
        "",
        "Greedy agreement: the share of continuation positions where the quantized-KV run's argmax is the "
        "full-precision greedy token, teacher-forced on that continuation. Log-prob difference: mean "
        "|log p_quantized − log p_full| of that token, nats. Bytes per token: measured on the caches "
        "(keys + values, every layer); the engine's estimate beside it.",
        "",
        "| KV format | greedy agreement, mean [min] | log-prob difference, mean [max] | bytes per token, measured / estimated | cached tokens per GB |",
        "|---|---|---|---|---|",
    ]
    full = sizes["full precision"]
    lines.append(
        f"| full precision (float32) | 1.000 | 0 | {full:.0f} / {_kv_bytes_per_token(model)} | {1e9 / full:,.0f} |"
    )
    for name, q in FORMATS.items():
        agree, diff = rows[name]["agree"], rows[name]["diff"]
        lines.append(
            f"| {name} | {statistics.mean(agree):.3f} [{min(agree):.3f}] | {statistics.mean(diff):.4f} "
            f"[{max(diff):.4f}] | {sizes[name]:.0f} / {_kv_bytes_per_token(model, q)} | {1e9 / sizes[name]:,.0f} "
            f"({full / sizes[name]:.2f}x) |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        results = ROOT / "benchmarks" / "RESULTS.md"
        results.write_text(results.read_text().rstrip("\n") + "\n\n" + text)


if __name__ == "__main__":
    main()
