"""Single-stream benchmark: raw mlx_lm.stream_generate vs mlxhost over HTTP (SSE), and turn-5 TTFT warm vs cold."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

import httpx

# _common preloads OpenBLAS, so it comes before mlx-lm.
from _common import (
    ALIAS,
    DEFAULT_MODELS_ROOT,
    MODELS,
    SseStream,
    chat_body,
    ensure_model,
    loadavg,
    machine,
    median,
    register_alias,
    render,
    start_daphne,
    state_env,
    stop_process,
    wait_ready,
)
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

SYSTEM = "You are a helpful assistant. Answer in one or two short sentences."
SHORT = [
    {"role": "system", "content": SYSTEM},
    {
        "role": "user",
        "content": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    },
]
USER_TURNS = [
    "What is the difference between a lake and a pond?",
    "Why do some lakes freeze from the top down?",
    "How do fish survive under the ice in winter?",
    "What happens to a lake when the ice melts in spring?",
    "Summarize everything we talked about in three sentences.",
]
CANNED = [  # fixed assistant replies of roughly 60 tokens each, for the "first time sent" cold turn 5
    "A lake is usually larger and deeper than a pond. In a pond, sunlight reaches the bottom almost "
    "everywhere, so plants can grow across it, while a lake has deep zones where light never reaches. "
    "Lakes often have waves and layered temperatures; ponds are shallow and warm up evenly in summer.",
    "Water is densest at about four degrees Celsius, so the coldest water floats on top. When the air "
    "cools the surface below that point, the top layer stays there and freezes first. The ice then "
    "insulates the water underneath, which is why most lakes never freeze solid to the bottom.",
    "Under the ice the water stays near four degrees, so fish slow down their bodies and need much less "
    "food and oxygen. Many rest near the bottom where it is warmest. Oxygen dissolved before the freeze, "
    "plus some from plants that still get light, is usually enough to last the winter.",
    "When the ice melts, the surface water warms to four degrees and sinks, mixing the whole lake. This "
    "spring turnover carries oxygen down to the bottom and brings nutrients up to the surface. Algae and "
    "plankton bloom, fish become active again, and the lake slowly builds layers for summer.",
]


def raw_run(model, tokenizer, prompt: list[int], n: int, eos_bias: dict[int, float]) -> dict:
    """One greedy generation of exactly n tokens (EOS banned), timed per yielded token."""
    processors = make_logits_processors(logit_bias=eos_bias)
    sampler = make_sampler(temp=0.0)
    started, times, last = time.perf_counter(), [], None
    for response in stream_generate(
        model, tokenizer, prompt, max_tokens=n, sampler=sampler, logits_processors=processors
    ):
        times.append(time.perf_counter())
        last = response
    span = times[-1] - times[0]
    return {
        "ttft_s": times[0] - started,
        "tokens": last.generation_tokens,
        "decode_tps": (len(times) - 1) / span if span > 0 else float("nan"),
        "generation_tps": last.generation_tps,
        "prompt_tokens": last.prompt_tokens,
    }


def http_chat(
    client: httpx.Client, messages: list[dict], max_tokens: int, eos_bias: dict | None, salt=None
) -> dict:
    """One streamed chat completion; times content chunks and reads usage and X-Session-Cache."""
    body = chat_body(messages, max_tokens, eos_bias, model=ALIAS, **({"cache_salt": salt} if salt else {}))
    stream = SseStream(started=time.perf_counter())
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text}")
        header = resp.headers.get("x-session-cache", "-")
        for line in resp.iter_lines():
            stream.feed(line, time.perf_counter())
    return {
        "ttft_s": stream.ttft_s,
        "chunks": len(stream.times),
        "tokens": stream.tokens,
        "decode_tps": stream.decode_tps,
        "prompt_tokens": stream.usage.get("prompt_tokens", 0),
        "cached_tokens": (stream.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "session_cache": header,
        "text": "".join(stream.parts),
        "finish": stream.finish,
    }


def conversation(nonce: str, replies: list[str]) -> list[dict[str, str]]:
    """System + user/assistant pairs for the given replies, then the next user turn."""
    messages = [{"role": "system", "content": f"[conversation {nonce}] {SYSTEM}"}]
    for user, reply in zip(USER_TURNS, replies, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return [*messages, {"role": "user", "content": USER_TURNS[len(replies)]}]


def http_turn5(client: httpx.Client, reply_tokens: int, eos_bias: dict) -> dict[str, dict]:
    """Cold (first send, canned replies), warm (turns 1-4 as a real chat, then 5) and cold (same prompt, new salt)."""
    out = {"cold_first": http_chat(client, conversation(secrets.token_hex(4), CANNED), 16, eos_bias)}
    nonce, replies = secrets.token_hex(4), []
    finishes = []
    for _ in range(4):  # replies end naturally (EOS allowed), capped at reply_tokens
        reply = http_chat(client, conversation(nonce, replies), reply_tokens, None)
        replies.append(reply["text"])
        finishes.append(reply["finish"])
    final = conversation(nonce, replies)
    out["warm"] = {**http_chat(client, final, 16, eos_bias), "turn_finishes": finishes}
    out["cold_salt"] = http_chat(client, final, 16, eos_bias, salt=secrets.token_hex(16))
    return out


def report(args, raw: list[dict], http: list[dict], turns: list[dict[str, dict]], load: list[float]) -> None:
    def med(rows: list[dict], key: str) -> float:
        return median([r[key] for r in rows])

    def runs(rows: list[dict], key: str, scale: float = 1.0, fmt: str = ".1f") -> str:
        return "[" + ", ".join(f"{r[key] * scale:{fmt}}" for r in rows) + "]"

    def line(label: str, value: str) -> None:
        print(f"  {label:<42} {value}")

    raw_tps, http_tps = med(raw, "decode_tps"), med(http, "decode_tps")
    info = {**machine(), "loadavg_1m_start_end": load}
    print(f"\nmodel={args.model} tokens={args.tokens} runs={args.runs} (medians; per-run in [])")
    print("  " + json.dumps(info))
    line("raw decode tok/s (own clock)", f"{raw_tps:.1f}  {runs(raw, 'decode_tps')}")
    line("raw decode tok/s (mlx_lm generation_tps)", f"{med(raw, 'generation_tps'):.1f}")
    line("mlxhost decode tok/s (SSE chunk clock)", f"{http_tps:.1f}  {runs(http, 'decode_tps')}")
    line("ratio mlxhost/raw", f"{http_tps / raw_tps:.3f}")
    line("tokens raw / mlxhost (chunks)", f"{raw[0]['tokens']} / {http[0]['tokens']} ({http[0]['chunks']})")
    line("prompt tokens raw / mlxhost", f"{raw[0]['prompt_tokens']} / {http[0]['prompt_tokens']}")
    line("raw TTFT short prompt (ms)", f"{med(raw, 'ttft_s') * 1000:.0f}  {runs(raw, 'ttft_s', 1000, '.0f')}")
    line(
        "mlxhost TTFT short prompt (ms)",
        f"{med(http, 'ttft_s') * 1000:.0f}  {runs(http, 'ttft_s', 1000, '.0f')}",
    )
    for name, label in (
        ("cold_first", "cold, first send"),
        ("cold_salt", "cold, new cache_salt"),
        ("warm", "warm"),
    ):
        rows = [t[name] for t in turns]
        line(
            f"turn-5 TTFT {label} (ms)",
            f"{med(rows, 'ttft_s') * 1000:.0f}  {runs(rows, 'ttft_s', 1000, '.0f')}",
        )
        line(
            "  prompt / cached tokens",
            f"{[r['prompt_tokens'] for r in rows]} / {[r['cached_tokens'] for r in rows]}",
        )
        line("  X-Session-Cache", str([r["session_cache"] for r in rows]))
    line("warm chat turns 1-4 finish_reason", str([t["warm"]["turn_finishes"] for t in turns]))
    cold, warm = med([t["cold_salt"] for t in turns], "ttft_s"), med([t["warm"] for t in turns], "ttft_s")
    line("turn-5 TTFT ratio warm/cold (same prompt)", f"{warm / cold:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per decode run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--reply-tokens", type=int, default=128, help="cap on each warm-chat reply (turns 1-4)"
    )
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    args = parser.parse_args()
    load_start = loadavg()
    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-") as tmp:
        state = Path(tmp)
        env = state_env(Path(args.models_root).resolve(), state)
        folder = ensure_model(env, args.model)
        key = register_alias(env, folder)
        model, tokenizer = load(str(folder))
        eos_bias = {int(i): -100.0 for i in tokenizer.eos_token_ids}
        prompt = render(tokenizer, SHORT)
        log = state / "daphne.log"
        proc, url = start_daphne(env, log)
        try:
            wait_ready(proc, url, key, log)
            headers = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
                raw_run(model, tokenizer, prompt, 8, eos_bias)  # warm-ups
                http_chat(client, SHORT, 8, eos_bias)
                raw, http = [], []
                for _ in range(args.runs):  # interleaved, so a load change on the machine hits both sides
                    raw.append(raw_run(model, tokenizer, prompt, args.tokens, eos_bias))
                    # A fresh salt per run keeps the short prompt cold now that prefix reuse exists.
                    http.append(http_chat(client, SHORT, args.tokens, eos_bias, secrets.token_hex(16)))
                turns = [http_turn5(client, args.reply_tokens, eos_bias) for _ in range(args.runs)]
        except BaseException:
            print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            stop_process(proc)
    report(args, raw, http, turns, [load_start, loadavg()])


if __name__ == "__main__":
    main()
