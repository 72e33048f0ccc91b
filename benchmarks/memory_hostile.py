"""Server memory over the hostile corpus: RSS before, after, and at idle (issue 25 §4, item 5).

A real daphne serves one alias. The script reads the process's RSS (`/proc/PID/status`) and the
server's own memory gauges (`/metrics`: MLX active and cache bytes, the prefix cache, heap trims)
once the model is warm, after the corpus, and after `--idle` seconds without requests. The
corpus is `tests/api/test_hostile_corpus.py`'s table (every POST surface broken field by field)
sent over HTTP, then `--large` requests with prompts of about `--large-mib` MiB each (to
count_tokens and chat, `--concurrency` at a time), the class that left the most memory behind.

    .venv/bin/python benchmarks/memory_hostile.py --model demo --compare HEAD~1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import (
    ALIAS,
    DEFAULT_MODELS_ROOT,
    ROOT,
    ensure_model,
    export_revision,
    loadavg,
    register_alias,
    start_daphne,
    state_env,
    stop_process,
    wait_ready,
)

GAUGES = (
    "mlxhost_mlx_active_bytes",
    "mlxhost_mlx_cache_bytes",
    "mlxhost_warm_session_bytes",
    "mlxhost_memory_trims_total",
)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def gauges(base: str, key: str) -> dict[str, float]:
    """The server's memory gauges summed over labels; absent ones (an older server) are left out."""
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in GAUGES:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def corpus() -> list[tuple[str, bytes]]:
    """(path, raw body) of every HTTP case of the hostile corpus, the model renamed to ours."""
    sys.path.insert(0, str(ROOT))
    from tests.api.test_hostile_corpus import CASES

    return [(p.values[0], p.values[1].replace(b'"tiny"', f'"{ALIAS}"'.encode())) for p in CASES]


def large_bodies(mib: float, count: int) -> list[tuple[str, bytes]]:
    text = "hello world, " * int(mib * 1024 * 1024 / 13)
    messages = [{"role": "user", "content": text}]
    shapes = [
        ("/v1/messages/count_tokens", {"model": ALIAS, "messages": messages}),
        ("/v1/chat/completions", {"model": ALIAS, "messages": messages, "max_tokens": 1}),
    ]
    return [(path, json.dumps(body).encode()) for _ in range(count // 2) for path, body in shapes]


async def send_all(
    base: str, key: str, requests: list[tuple[str, bytes]], concurrency: int
) -> dict[int, int]:
    headers = {
        "Authorization": f"Bearer {key}",
        "x-api-key": key,
        "anthropic-version": "2023-06-01",
        "Content-Type": "application/json",
    }
    statuses: dict[int, int] = {}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300) as client:

        async def one(path: str, body: bytes) -> None:
            async with gate:
                status = (await client.post(path, content=body)).status_code
            statuses[status] = statuses.get(status, 0) + 1

        await asyncio.gather(*(one(path, body) for path, body in requests))
    return statuses


def measure(root: Path, state: Path, folder: Path, models_root: Path, args: argparse.Namespace) -> dict:
    state.mkdir(parents=True, exist_ok=True)
    env = state_env(models_root, state)
    # Housekeeping (and the idle trim) looks often enough to act within the idle wait.
    env["MLXHOST_HOUSEKEEPING_INTERVAL_S"] = str(min(5.0, args.idle / 3))
    key = register_alias(env, folder, max_tokens=4, max_output_tokens=4)
    log = state / "daphne.log"
    proc, base = start_daphne(env, log, root)
    try:
        wait_ready(proc, base, key, log)
        asyncio.run(send_all(base, key, corpus()[:20], 1))  # warm: first requests import and compile
        time.sleep(2)
        points = {"warm": (rss_bytes(proc.pid), gauges(base, key))}
        statuses = asyncio.run(send_all(base, key, corpus(), args.concurrency))
        points["hostile"] = (rss_bytes(proc.pid), gauges(base, key))
        large = asyncio.run(send_all(base, key, large_bodies(args.large_mib, args.large), args.concurrency))
        points["large"] = (rss_bytes(proc.pid), gauges(base, key))
        time.sleep(args.idle)
        points["idle"] = (rss_bytes(proc.pid), gauges(base, key))
    finally:
        stop_process(proc)
    return {"points": points, "statuses": statuses, "large_statuses": large}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "demo"), default="demo")
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--large", type=int, default=16, help="large-prompt requests")
    parser.add_argument("--large-mib", type=float, default=2.0)
    parser.add_argument("--idle", type=float, default=30.0, help="seconds without requests at the end")
    parser.add_argument("--compare", default="", help="a git revision to measure first, as 'before'")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mlxhost-memory-") as tmp:
        state = Path(tmp)
        models_root = Path(args.models_root)
        folder = ensure_model(state_env(models_root, state), args.model)
        roots = {"after" if args.compare else "this": ROOT}
        if args.compare:
            roots = {"before": export_revision(args.compare, state / "before-tree"), **roots}
        results = {
            label: measure(root, state / label, folder, models_root, args) for label, root in roots.items()
        }

    print(
        f"# memory over the hostile corpus: model {args.model}, concurrency {args.concurrency}, "
        f"{args.large} large prompts of {args.large_mib} MiB, idle {args.idle:.0f} s, load {loadavg():.2f}"
    )
    print(
        f"{'server':<7} {'point':<8} {'RSS GB':>7} {'MLX active':>11} {'MLX cache':>10} {'prefix':>8} {'trims':>6}"
    )
    for label, result in results.items():
        for point, (rss, found) in result["points"].items():
            cells = [f"{found[name] / 1e9:.3f}" if name in found else "-" for name in GAUGES[:3]] + [
                f"{found.get(GAUGES[3], float('nan')):.0f}" if GAUGES[3] in found else "-"
            ]
            print(
                f"{label:<7} {point:<8} {rss / 1e9:7.3f} {cells[0]:>11} {cells[1]:>10} {cells[2]:>8} {cells[3]:>6}"
            )
        print(f"{label:<7} statuses: corpus {result['statuses']}, large {result['large_statuses']}")


if __name__ == "__main__":
    main()
