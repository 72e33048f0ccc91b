"""Concurrency benchmark: raw mlx-lm, mlx_lm.server and mlxhost (HTTP SSE) at 1, 2, 4 and 8 streams, in one run."""

from __future__ import annotations

import argparse
import asyncio
import math
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
from _common import (
    ALIAS,
    DEFAULT_MODELS_ROOT,
    MODELS,
    ROOT,
    Servers,
    SseStream,
    chat_body,
    ensure_model,
    loadavg,
    register_alias,
    render,
    state_env,
    text_bias,
)
from _concurrency_report import SYSTEMS, Report
from mlx_lm import load, stream_generate
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_logits_processors, make_sampler

RANDOM_WEIGHTS = {"mid", "tiny"}  # gibberish models: see text_bias()
SYSTEM = "You are a helpful assistant. Answer in a few sentences."
QUESTIONS = [  # one per stream; every request also gets a unique tag, so no system reuses a prefix
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Describe a busy market in a small mountain town on a Saturday morning.",
    "What should I pack for a week of hiking in the rain?",
    "Tell me about the history of bread and how people first baked it.",
    "How does a bicycle stay upright while it is moving?",
    "Write a letter from a cat to the dog that lives next door.",
    "Why do rivers bend and curve instead of running straight?",
]


@dataclass
class Outcome:
    """One request: when it was sent, its first and last text chunk, how many tokens, or its error.

    Every system is timed the same way, by the text it streams: servers send a chunk only when the
    detokenizer has text, so the raw side runs the same streaming detokenizer and times that.
    """

    sent: float
    first: float = float("nan")
    last: float = float("nan")
    tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def messages_for(tag: str, index: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"[{tag}-{index}] {SYSTEM}"},
        {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]},
    ]


class RawSide:
    """mlx-lm in this process: `stream_generate` (one stream) and a fresh `BatchGenerator` per wave."""

    def __init__(self, folder: Path, max_tokens: int, *, random_weights: bool) -> None:
        self.model, self.tokenizer = load(str(folder))
        self.eos = sorted(int(i) for i in self.tokenizer.eos_token_ids)
        self.bias = text_bias(self.tokenizer, random_weights=random_weights)
        self.max_tokens = max_tokens

    def stream_generate(self, tag: str, concurrency: int) -> list[Outcome]:
        assert concurrency == 1
        prompt = render(self.tokenizer, messages_for(tag, 0))
        out = Outcome(sent=time.perf_counter(), prompt_tokens=len(prompt))
        for response in stream_generate(
            self.model,
            self.tokenizer,
            prompt,
            max_tokens=self.max_tokens,
            sampler=make_sampler(temp=0.0),
            logits_processors=make_logits_processors(logit_bias=self.bias),
        ):
            out.tokens += 1
            if response.text:
                out.last = time.perf_counter()
                out.first = out.last if math.isnan(out.first) else out.first
        return [out]

    def batch_generator(self, tag: str, concurrency: int) -> list[Outcome]:
        prompts = [render(self.tokenizer, messages_for(tag, i)) for i in range(concurrency)]
        generator = BatchGenerator(self.model, stop_tokens=[[i] for i in self.eos])
        sent = time.perf_counter()
        uids = generator.insert(
            prompts,
            max_tokens=[self.max_tokens] * concurrency,
            logits_processors=[make_logits_processors(logit_bias=self.bias) for _ in prompts],
        )
        outcomes = {
            uid: Outcome(sent=sent, prompt_tokens=len(p)) for uid, p in zip(uids, prompts, strict=True)
        }
        detokenizers = {uid: self.tokenizer.detokenizer for uid in uids}
        while detokenizers:
            responses = generator.next_generated()
            now = time.perf_counter()
            for response in responses:
                out, detokenizer = outcomes[response.uid], detokenizers[response.uid]
                out.tokens += 1
                detokenizer.add_token(response.token)
                if response.finish_reason is not None:
                    detokenizer.finalize()
                    del detokenizers[response.uid]
                if detokenizer.last_segment:
                    out.last = now
                    out.first = now if math.isnan(out.first) else out.first
        generator.close()
        return list(outcomes.values())


class HttpSide:
    """An OpenAI-compatible server reached over HTTP; each wave sends its requests at once (SSE)."""

    def __init__(self, url: str, headers: dict[str, str], body_extra: dict, bias: dict, max_tokens: int):
        self.url, self.headers, self.body_extra = url, headers, body_extra
        self.bias, self.max_tokens = bias, max_tokens

    def wave(self, tag: str, concurrency: int) -> list[Outcome]:
        return asyncio.run(self._wave(tag, concurrency))

    async def _wave(self, tag: str, concurrency: int) -> list[Outcome]:
        limits = httpx.Limits(max_connections=concurrency + 2)
        async with httpx.AsyncClient(
            base_url=self.url, headers=self.headers, timeout=900, limits=limits
        ) as c:
            return list(await asyncio.gather(*(self._one(c, tag, i) for i in range(concurrency))))

    async def _one(self, client: httpx.AsyncClient, tag: str, index: int) -> Outcome:
        body = chat_body(messages_for(tag, index), self.max_tokens, self.bias, **self.body_extra)
        stream = SseStream(started=time.perf_counter())
        out = Outcome(sent=stream.started)
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
                async for line in resp.aiter_lines():
                    stream.feed(line, time.perf_counter())
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
            return out
        out.tokens, out.prompt_tokens = stream.tokens, int(stream.usage.get("prompt_tokens", 0))
        if stream.times:
            out.first, out.last = stream.times[0], stream.times[-1]
        else:
            out.error = "no content"
        return out


def run_model(model: str, args: argparse.Namespace, report: Report) -> None:
    """Start everything on `model`, warm each system up, then measure every system at every concurrency."""
    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-") as tmp:
        state = Path(tmp)
        env = state_env(Path(args.models_root).resolve(), state)
        folder = ensure_model(env, model)
        # Lane capacity = batch size must cover the widest wave; the queue never refuses one.
        # --kv-bits: both servers quantize the KV cache the same way (groups of 64, from token 0).
        kv = {"kv_bits": args.kv_bits} if args.kv_bits else {}
        server_args: tuple[str, ...] = (
            ("--kv-bits", str(args.kv_bits), "--quantized-kv-start", "0") if args.kv_bits else ()
        )
        # --draft: the tiny model's seed-1 twin (same tokenizer) drafts, as the model's draft model
        # in mlxhost and `--draft-model` in mlx_lm.server (which then serves one request at a time).
        draft = None
        if args.draft:
            from mlxhost.engine.backends.mlx.tiny import build_tiny_model

            draft = build_tiny_model(Path(env["MODELS_ROOT"]) / "tiny-llama-b", seed=1)
            server_args += ("--draft-model", str(draft))
        key = register_alias(env, folder, draft, concurrency=max(8, *args.concurrency), queue_depth=64, **kv)
        raw = RawSide(folder, args.tokens, random_weights=model in RANDOM_WEIGHTS)
        with Servers(folder, state, env, server_args) as servers:
            try:
                systems = build_systems(raw, servers, key, args.systems, args.tokens)
                measure(model, systems, args, report)
            except BaseException:
                print(servers.logs_tail(), file=sys.stderr)
                raise


def build_systems(raw: RawSide, servers: Servers, key: str, names: list[str], tokens: int) -> dict:
    """System name -> callable(tag, concurrency) -> outcomes; None where a system skips a concurrency."""
    systems = {
        "raw stream_generate": lambda tag, c: raw.stream_generate(tag, c) if c == 1 else None,
        "raw BatchGenerator": raw.batch_generator,
    }
    if "mlx_lm.server" in names:
        systems["mlx_lm.server"] = HttpSide(servers.mlx_lm_server(), {}, {}, raw.bias, tokens).wave
    if "mlxhost" in names:
        headers = {"Authorization": f"Bearer {key}"}
        systems["mlxhost"] = HttpSide(servers.mlxhost(key), headers, {"model": ALIAS}, raw.bias, tokens).wave
    return {name: run for name, run in systems.items() if name in names}


def measure(model: str, systems: dict, args: argparse.Namespace, report: Report) -> None:
    nonce = secrets.token_hex(3)
    for name, run in systems.items():  # warm-up: first requests pay one-off costs
        for c in sorted({1, max(args.concurrency)}):
            run(f"warm-{nonce}-{c}", c)
        print(f"  [{model}] {name} warmed up", flush=True)
    names = list(systems)
    for r in range(args.runs):
        # Interleaved: every system at one concurrency, then the next, so a change in machine
        # load hits all systems alike; the order rotates each run. Unique tags keep prompts cold.
        order = names[r % len(names) :] + names[: r % len(names)]
        for c in args.concurrency:
            for name in order:
                run = systems[name]
                outcomes = run(f"{nonce}-r{r}-c{c}", c)
                if outcomes is not None:
                    report.add(model, name, c, r, outcomes)
                    print(
                        f"  [{model}] run {r + 1}/{args.runs} c={c} {report.line(model, name, c, r)}",
                        flush=True,
                    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", help="comma-separated: demo, mid (52M random), tiny (default demo,mid)")
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated stream counts")
    parser.add_argument("--tokens", type=int, help="max_tokens per request, EOS suppressed (default 48)")
    parser.add_argument("--runs", type=int, help="repeats; medians are reported (default 3)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset to run")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: defaults become mid, 16 tokens, 1 run, no files"
    )
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        help="append to RESULTS.md and write the chart (default: yes, except with --quick)",
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8),
        help="quantized KV on both servers (mlxhost's alias, --kv-bits)",
    )
    parser.add_argument(
        "--draft",
        action="store_true",
        help="the tiny model's seed-1 twin drafts on both servers (--models tiny)",
    )
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    parser.add_argument("--chart", default=str(ROOT / "docs" / "bench-throughput.png"))
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    args = parser.parse_args(argv)
    quick = {"models": "mid", "tokens": 16, "runs": 1, "write": False}
    full = {"models": "demo,mid", "tokens": 48, "runs": 3, "write": True}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:  # explicit options win over the mode's defaults
            setattr(args, name, value)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.concurrency = sorted(int(c) for c in args.concurrency.split(","))
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS) | set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown: {sorted(unknown)}")
    return args


def main() -> int:
    args = parse_args()
    command = "python benchmarks/bench_concurrency.py " + " ".join(sys.argv[1:])
    report = Report(command=command.strip(), tokens=args.tokens, runs=args.runs)
    report.started(datetime.now(UTC), loadavg())
    for model in args.models:
        print(f"model {model}: starting mlx_lm.server and mlxhost ...", flush=True)
        run_model(model, args, report)
    report.finished(loadavg())
    text = report.markdown()
    print("\n" + text)
    if args.write:
        report.append_to(Path(args.results), text)
        report.chart(Path(args.chart))
        print(f"appended to {args.results}; chart in {args.chart}")
    failures = report.failures()
    if failures:
        print(f"FAILED: {failures} request(s) failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
