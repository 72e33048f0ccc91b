"""What the durable handoff costs: time from the last token to the terminal event, stored vs not.

Since issue 10 item 5 a stored turn (`store: true`) is handed to a durable place (the Celery task
published to the broker, or the row written inline) BEFORE `response.completed` is sent; a turn
with `store: false` sends it at once, as every turn did before. So the difference of the two
gaps is what the change adds. Turns alternate stored / not stored, sequentially, on the tiny model.

    .venv/bin/python benchmarks/bench_durable.py --turns 200                     # inline SQLite
    .venv/bin/python benchmarks/bench_durable.py --redis redis://127.0.0.1:6379/0 # Celery over Redis
    .venv/bin/python benchmarks/bench_durable.py --database postgres://postgres@127.0.0.1:5432/bench
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from _common import (
    DEFAULT_MODELS_ROOT,
    ensure_model,
    percentile,
    register_alias,
    start_daphne,
    start_process,
    state_env,
    stop_process,
    wait_ready,
)

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def gap_ms(client: httpx.Client, url: str, key: str, store: bool, i: int) -> float:
    """One streamed turn; ms between the last output_text.delta and the terminal event."""
    body = {"model": "bench", "input": f"turn {i}", "max_output_tokens": 8, "stream": True, "store": store}
    last_delta = None
    with client.stream(
        "POST", f"{url}/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            kind = json.loads(line[6:])["type"]
            if kind == "response.output_text.delta":
                last_delta = time.perf_counter()
            elif kind in TERMINAL:
                return (time.perf_counter() - last_delta) * 1000
    raise RuntimeError("no terminal event")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200, help="turns of each kind")
    parser.add_argument("--redis", default="", help="broker URL; a Celery worker runs beside daphne")
    parser.add_argument("--database", default="", help="DATABASE_URL (default: a throwaway SQLite)")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="bench-durable-"))
    env = state_env(Path(DEFAULT_MODELS_ROOT), state)
    if args.database:
        env["DATABASE_URL"] = args.database
    if args.redis:
        env["REDIS_URL"] = args.redis
        env["MLXHOST_CELERY_QUEUE"] = f"bench-durable-{uuid.uuid4().hex[:8]}"
    folder = ensure_model(env, "tiny")
    key = register_alias(env, folder, max_output_tokens=8, max_tokens=8)
    worker = None
    if args.redis:
        cmd = ["-m", "celery", "-A", "mlxhost.celery", "worker", "--pool=solo", "--without-gossip"]
        worker = start_process([sys.executable, *cmd], env, state / "celery.log")
    proc, url = start_daphne(env, state / "daphne.log")
    try:
        wait_ready(proc, url, key, state / "daphne.log")
        gaps: dict[bool, list[float]] = {True: [], False: []}
        with httpx.Client(timeout=60) as client:
            for i in range(5):  # warm-up, not counted
                gap_ms(client, url, key, i % 2 == 0, i)
            for i in range(2 * args.turns):
                store = i % 2 == 0
                gaps[store].append(gap_ms(client, url, key, store, i))
    finally:
        stop_process(proc)
        if worker is not None:
            stop_process(worker)
    where = "Celery over Redis" if args.redis else "inline write"
    db = "PostgreSQL" if "postgres" in env["DATABASE_URL"] else "SQLite"
    print(f"last token -> terminal event, {args.turns} turns each, {where}, {db}:")
    for store, values in gaps.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        print(f"  store={str(store).lower():5}  p50 {p50:6.2f} ms  p99 {p99:6.2f} ms")
    added = percentile(gaps[True], 50) - percentile(gaps[False], 50)
    print(f"  added by the durable handoff (p50): {added:.2f} ms")


if __name__ == "__main__":
    main()
