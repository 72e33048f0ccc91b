"""Refusal benchmark: a burst over the lane's budget on every surface; served/refused counts and
refusal latency (LANE-2, issue 10 item 4).

A real daphne serves one alias at concurrency 1 and queue depth 4, so 5 requests of a 20-request
burst hold a place and 15 must be refused (429, 529 on Anthropic, an error frame on the socket).
Each burst is fired at once (httpx async for HTTP, `websockets` for the socket), with long
generations, so no place frees up during it. Latency is from sending a request to receiving its
refusal status (or frame).
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
import websockets
from _common import (
    ALIAS,
    DEFAULT_MODELS_ROOT,
    ensure_model,
    loadavg,
    percentile,
    register_alias,
    start_daphne,
    state_env,
    stop_process,
    wait_ready,
)

CAPACITY, DEPTH = 1, 4
LONG = 100_000
HELLO = [{"role": "user", "content": "hello there"}]
REFUSED = {429, 529}


def bodies(eos_bias: dict[str, float]) -> dict[str, tuple[str, dict]]:
    """Surface -> (path, body): long streamed generations; the EOS token is banned where allowed."""
    return {
        "chat": ("/v1/chat/completions", {"messages": HELLO, "max_tokens": LONG, "logit_bias": eos_bias}),
        "completions": ("/v1/completions", {"prompt": "hello", "max_tokens": LONG, "logit_bias": eos_bias}),
        "responses": (
            "/v1/responses",
            {"input": "hello", "max_output_tokens": LONG, "store": False, "logit_bias": eos_bias},
        ),
        "messages": ("/v1/messages", {"messages": HELLO, "max_tokens": LONG}),
    }


async def lane(client: httpx.AsyncClient) -> dict:
    instances = (await client.get("/readyz")).json().get("instances", [])
    return instances[0]["lane"] if instances else {}


async def wait_idle(client: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        probe = await lane(client)
        if probe.get("active", 0) == probe.get("queued", 0) == probe.get("permits", 0) == 0:
            return
        await asyncio.sleep(0.05)
    raise SystemExit(f"the lane did not go idle between bursts: {(await client.get('/readyz')).text}")


async def settle(client: httpx.AsyncClient, refused: list[float], burst: int) -> int:
    """Wait until every request of the burst is refused or holds a place; return the places."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        probe = await lane(client)
        held = probe.get("active", 0) + probe.get("queued", 0)
        if len(refused) + held >= burst:
            return held
        await asyncio.sleep(0.01)
    return -1


async def raw_connections(base: str, count: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """`count` open TCP connections to daphne. The burst is sent over them with a minimal HTTP/1.1
    client: httpx spends milliseconds of CPU per request, which on a small machine would be
    measured as server latency."""
    url = httpx.URL(base)
    return [await asyncio.open_connection(url.host, url.port) for _ in range(count)]


def raw_request(base: str, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {httpx.URL(base).netloc.decode()}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def status_of(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes) -> int:
    reader, writer = connection
    writer.write(request)
    return int((await reader.readline()).split()[1])


async def http_burst(base: str, key: str, path: str, body: dict, burst: int) -> tuple[int, list[float]]:
    headers = {"Authorization": f"Bearer {key}", "x-api-key": key, "anthropic-version": "2023-06-01"}
    payload = json.dumps({"model": ALIAS, "stream": True, **body}).encode()
    request = raw_request(base, "POST", path, headers, payload)
    connections = await raw_connections(base, burst)
    refused: list[float] = []

    async def one(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        started = time.perf_counter()
        if await status_of(connection, request) in REFUSED:
            refused.append(time.perf_counter() - started)
            return
        while await connection[0].read(65536):  # hold the place until hung up
            pass

    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as client:
        tasks = [asyncio.create_task(one(connection)) for connection in connections]
        held = await settle(client, refused, burst)
        for task in tasks:
            task.cancel()
        for _, writer in connections:
            writer.close()  # the server sees the disconnect: streams and waiters are cancelled (LANE-6)
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_idle(client)
        return held, refused


async def ws_burst(base: str, key: str, body: dict, burst: int) -> tuple[int, list[float]]:
    url = base.replace("http://", "ws://") + "/ws/v1/responses"
    headers = {"Authorization": f"Bearer {key}"}
    sockets = [await websockets.connect(url, additional_headers=headers) for _ in range(burst)]
    refused: list[float] = []

    async def one(socket) -> None:
        started = time.perf_counter()
        await socket.send(json.dumps({"type": "response.create", "model": ALIAS, **body}))
        frame = json.loads(await socket.recv())
        if frame.get("type") in ("error", "overloaded") and frame.get("status", 429) in REFUSED:
            refused.append(time.perf_counter() - started)

    try:
        await asyncio.gather(*(one(socket) for socket in sockets))
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as client:
            held = await settle(client, refused, burst)
            for socket in sockets:
                await socket.close()  # closing the socket cancels its turn
            await wait_idle(client)
    finally:
        for socket in sockets:
            await socket.close()
    return held, refused


async def floor_burst(base: str, burst: int) -> list[float]:
    """The same burst of GET /healthz (no auth, no engine): this machine's HTTP floor."""
    request = raw_request(base, "GET", "/healthz", {})
    connections = await raw_connections(base, burst)

    async def one(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> float:
        started = time.perf_counter()
        await status_of(connection, request)
        return time.perf_counter() - started

    try:
        return list(await asyncio.gather(*(one(connection) for connection in connections)))
    finally:
        for _, writer in connections:
            writer.close()


def eos_bias(folder: Path) -> dict[str, float]:
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return {str(token): -100.0 for token in ids}


async def run(base: str, key: str, folder: Path, burst: int, rounds: int, only: set[str]) -> list[dict]:
    floor = [1000 * t for _ in range(rounds) for t in await floor_burst(base, burst)]
    rows = [
        {
            "surface": "healthz",
            "served": [burst] * rounds,
            "refused": ["-"] * rounds,
            "p50_ms": percentile(floor, 50),
            "p99_ms": percentile(floor, 99),
            "max_ms": max(floor),
        }
    ]
    surfaces = bodies(eos_bias(folder))
    for name in [n for n in [*surfaces, "websocket"] if not only or n in only]:
        print(f"bursting {name} ...", file=sys.stderr, flush=True)
        held_counts, latencies, refused_counts, round_max = [], [], [], []
        # One unmeasured burst first: the surface's first request imports and compiles what it
        # needs once per process (serializers, templates), as every benchmark here warms up.
        if name == "websocket":
            await ws_burst(base, key, surfaces["responses"][1], burst)
        else:
            await http_burst(base, key, *surfaces[name], burst)
        for _ in range(rounds):
            if name == "websocket":
                held, refused = await ws_burst(base, key, surfaces["responses"][1], burst)
            else:
                held, refused = await http_burst(base, key, *surfaces[name], burst)
            held_counts.append(held)
            refused_counts.append(len(refused))
            round_max.append(round(1000 * max(refused, default=float("nan"))))
            latencies.extend(1000 * t for t in refused)
        rows.append(
            {
                "surface": name,
                "served": held_counts,
                "refused": refused_counts,
                "p50_ms": percentile(latencies, 50),
                "p99_ms": percentile(latencies, 99),
                "max_ms": max(latencies, default=float("nan")),
                "round_max_ms": round_max,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "demo"), default="tiny")
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="bursts per surface")
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    parser.add_argument("--surfaces", default="", help="comma-separated subset (default: all)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-refusals-") as tmp:
        state = Path(tmp)
        env = state_env(Path(args.models_root), state)
        folder = ensure_model(env, args.model)
        key = register_alias(env, folder, concurrency=CAPACITY, queue_depth=DEPTH, max_output_tokens=LONG)
        log = state / "daphne.log"
        proc, base = start_daphne(env, log)
        try:
            wait_ready(proc, base, key, log)
            only = set(filter(None, args.surfaces.split(",")))
            try:
                rows = asyncio.run(run(base, key, folder, args.burst, args.rounds, only))
            except SystemExit:
                print(log.read_text(errors="replace")[-6000:], file=sys.stderr)  # why it went wrong
                raise
        finally:
            stop_process(proc)
    print(
        f"# refusals: burst {args.burst} at capacity {CAPACITY}, depth {DEPTH}, model {args.model}, "
        f"{args.rounds} round(s), load {loadavg():.2f}"
    )
    print(
        f"{'surface':<12} {'served':<12} {'refused':<14} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}  max per round"
    )
    for row in rows:
        print(
            f"{row['surface']:<12} {','.join(map(str, row['served'])):<12} "
            f"{','.join(map(str, row['refused'])):<14} {row['p50_ms']:8.1f} {row['p99_ms']:8.1f} {row['max_ms']:8.1f}  "
            f"{','.join(map(str, row.get('round_max_ms', [])))}"
        )
    expected_refused = args.burst - CAPACITY - DEPTH
    exact = all(set(r["refused"]) == {expected_refused} for r in rows[1:])
    sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
