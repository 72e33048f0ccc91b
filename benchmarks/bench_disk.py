"""Disk-tier benchmark (issue 12): continue stored 5-turn chains after a restart, loading the
parent's KV from disk, against the same continuation replayed cold (disk tier off).

Process 1 builds C chains of T stored turns through `/v1/responses` on a shared system prompt and
waits until the idle worker has saved them. Then processes alternate: disk tier on (each chain's
next turn loads its parent's KV: `X-Session-Cache: disk`), disk tier off (the same turn replays
the stored conversation: `cold_replay`), R rounds each; every process is new, so nothing is in
memory. Greedy, so both must give the same text. First-token time is request sent -> first text
delta of the streamed turn.

    .venv/bin/python benchmarks/bench_disk.py [--chains 3] [--turns 5] [--rounds 2] [--write]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from _common import (
    ALIAS,
    DEFAULT_MODELS_ROOT,
    ROOT,
    append_results,
    ensure_model,
    loadavg,
    machine_line,
    median,
    register_alias,
    start_daphne,
    state_env,
    stop_process,
    wait_ready,
)
from bench_chat import QUESTIONS, SYSTEM_PROMPT

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
TARGET = 0.3  # first-token time from disk / cold replay, at most


def serve(env: dict[str, str], state: Path, key: str, tag: str, **extra: str):
    log = state / f"daphne-{tag}.log"
    proc, url = start_daphne({**env, **extra}, log)
    wait_ready(proc, url, key, log)
    return proc, url


def create(client: httpx.Client, body: dict) -> dict:
    response = client.post("/v1/responses", json={"model": ALIAS, **body})
    response.raise_for_status()
    return response.json()


def streamed_turn(client: httpx.Client, body: dict) -> tuple[float, str, str, int]:
    """(first-token seconds, text, X-Session-Cache, cached tokens) of one streamed turn."""
    started = time.perf_counter()
    first, parts, cached = None, [], 0
    with client.stream("POST", "/v1/responses", json={"model": ALIAS, "stream": True, **body}) as response:
        response.raise_for_status()
        outcome = response.headers.get("X-Session-Cache", "")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("type") == "response.output_text.delta" and event.get("delta"):
                first = first or time.perf_counter()
                parts.append(event["delta"])
            elif event.get("type") in ("response.completed", "response.incomplete"):
                usage = event["response"].get("usage") or {}
                cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    return (first or time.perf_counter()) - started, "".join(parts), outcome, cached


def saved_turns(url: str, key: str) -> int:
    body = httpx.get(f"{url}/readyz", headers={"Authorization": f"Bearer {key}"}, timeout=5).json()
    return sum(i["prefix_cache"].get("disk", {}).get("written", 0) for i in body.get("instances", []))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="disk-on / disk-off process pairs")
    parser.add_argument("--tokens", type=int, default=48, help="max_output_tokens per turn")
    parser.add_argument("--write", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    args = parser.parse_args()
    load = [loadavg()]
    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-disk-") as tmp:
        state = Path(tmp)
        env = state_env(Path(args.models_root), state)
        folder = ensure_model(env, "demo")
        key = register_alias(env, folder, concurrency=1)
        headers = {"Authorization": f"Bearer {key}"}

        proc, url = serve(env, state, key, "build")
        parents = []
        try:
            with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
                for chain in range(args.chains):
                    previous = None
                    for turn in range(args.turns):
                        question = QUESTIONS[chain % len(QUESTIONS)][turn % 4] + f" (chain {chain})"
                        # A cache domain per chain: each cold replay is cold, not warm on another's prompt.
                        body = {
                            "input": question,
                            "max_output_tokens": args.tokens,
                            "cache_salt": f"c{chain}",
                        }
                        if previous is None:
                            body["instructions"] = SYSTEM_PROMPT
                        else:
                            body["previous_response_id"] = previous
                        previous = create(client, body)["id"]
                    parents.append((previous, f"c{chain}"))
            deadline = time.monotonic() + 120
            while saved_turns(url, key) < args.chains * args.turns and time.monotonic() < deadline:
                time.sleep(0.2)
            print(
                f"built {args.chains} chains of {args.turns} turns; saved {saved_turns(url, key)}", flush=True
            )
        finally:
            stop_process(proc)

        rows: dict[str, list[tuple[float, str, str, int]]] = {"disk": [], "cold": []}
        for round_ in range(args.rounds):
            for mode in ("disk", "cold"):
                extra = {} if mode == "disk" else {"MLXHOST_KV_DISK_BYTES": "0"}
                proc, url = serve(env, state, key, f"{mode}-{round_}", **extra)
                try:
                    with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
                        for parent, salt in parents:
                            body = {
                                "input": "Summarise that in one line.",
                                "max_output_tokens": 16,
                                "cache_salt": salt,
                            }
                            result = streamed_turn(client, {**body, "previous_response_id": parent})
                            rows[mode].append(result)
                            print(
                                f"  round {round_ + 1} {mode:4} {result[2]:11} first token {result[0] * 1000:7.0f} ms"
                                f"  cached {result[3]}",
                                flush=True,
                            )
                finally:
                    stop_process(proc)
        load.append(loadavg())

    disk = median([r[0] for r in rows["disk"]])
    cold = median([r[0] for r in rows["cold"]])
    same = sum(1 for d, c in zip(rows["disk"], rows["cold"], strict=True) if d[1] == c[1])
    outcomes = {mode: sorted({r[2] for r in results}) for mode, results in rows.items()}
    ratio = disk / cold
    verdict = "met" if ratio <= TARGET else f"**missed** by {ratio - TARGET:.2f}"
    report = (
        f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC — continuing a stored chain after a restart: disk tier vs cold replay (issue 12)\n\n"
        f"Command: `python benchmarks/bench_disk.py --chains {args.chains} --turns {args.turns} --rounds {args.rounds}`"
        f" (demo model, SmolLM2's ~350-token system prompt, {args.turns} stored turns of up to {args.tokens} tokens per chain,"
        f" then one streamed turn per chain in a fresh process, each chain in a cache domain of its own; disk tier on and off alternate, {args.rounds} of each).\n\n"
        f"{machine_line(load)}\n\n"
        "| continuation after a restart | first token, median (ms) | X-Session-Cache | cached tokens, median |\n"
        "|---|---|---|---|\n"
        f"| disk tier on | {disk * 1000:.0f} | {', '.join(outcomes['disk'])} | {median([r[3] for r in rows['disk']]):.0f} |\n"
        f"| disk tier off (cold replay) | {cold * 1000:.0f} | {', '.join(outcomes['cold'])} | {median([r[3] for r in rows['cold']]):.0f} |\n\n"
        f"Ratio disk ÷ cold replay: **{ratio:.2f}** (target ≤ {TARGET}: {verdict}). "
        f"Same text (greedy) in {same} of {len(rows['disk'])} pairs.\n"
    )
    print(report)
    if args.write:
        append_results(RESULTS, report)
    return 0 if outcomes["disk"] == ["disk"] and same == len(rows["disk"]) else 1


if __name__ == "__main__":
    sys.exit(main())
