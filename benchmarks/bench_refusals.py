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
    ROOT,
    ensure_model,
    export_revision,
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


async def surface_burst(base: str, key: str, surfaces: dict[str, tuple[str, dict]], name: str, burst: int):
    if name == "websocket":
        return await ws_burst(base, key, surfaces["responses"][1], burst)
    return await http_burst(base, key, *surfaces[name], burst)


def row(surface: str, held: list[int], refused: list[list[float]]) -> dict:
    latencies = [1000 * t for r in refused for t in r]
    return {
        "surface": surface,
        "served": held,
        "refused": [len(r) for r in refused],
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies, default=float("nan")),
        "round_max_ms": [round(1000 * max(r, default=float("nan"))) for r in refused],
    }


async def run(
    servers: dict[str, tuple[str, str]], folder: Path, burst: int, rounds: int, only: set[str]
) -> list[dict]:
    """Rows per surface and server (`name -> (base, key)`); the servers take turns burst by burst,
    so a before/after pair shares the machine's load."""
    rows = []
    for label, (base, _) in servers.items():
        floor = [1000 * t for _ in range(rounds) for t in await floor_burst(base, burst)]
        rows.append(
            {
                "surface": "healthz",
                "server": label,
                "served": [burst] * rounds,
                "refused": ["-"] * rounds,
                "p50_ms": percentile(floor, 50),
                "p99_ms": percentile(floor, 99),
                "max_ms": max(floor),
            }
        )
    surfaces = bodies(eos_bias(folder))
    for name in [n for n in [*surfaces, "websocket"] if not only or n in only]:
        print(f"bursting {name} ...", file=sys.stderr, flush=True)
        held: dict[str, list[int]] = {label: [] for label in servers}
        refused: dict[str, list[list[float]]] = {label: [] for label in servers}
        # One unmeasured burst first: the surface's first request imports and compiles what it
        # needs once per process (serializers, templates), as every benchmark here warms up.
        for base, key in servers.values():
            await surface_burst(base, key, surfaces, name, burst)
        labels = list(servers)
        for index in range(rounds):
            for label in labels if index % 2 == 0 else labels[::-1]:  # alternate who goes first
                base, key = servers[label]
                count, times = await surface_burst(base, key, surfaces, name, burst)
                held[label].append(count)
                refused[label].append(times)
        rows.extend({**row(name, held[label], refused[label]), "server": label} for label in servers)
    return rows


def start_server(root: Path, state: Path, folder: Path, models_root: Path) -> tuple:
    state.mkdir(parents=True, exist_ok=True)
    env = state_env(models_root, state)
    key = register_alias(env, folder, concurrency=CAPACITY, queue_depth=DEPTH, max_output_tokens=LONG)
    log = state / "daphne.log"
    proc, base = start_daphne(env, log, root)
    return proc, base, key, log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "demo"), default="tiny")
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="bursts per surface (per server)")
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    parser.add_argument("--surfaces", default="", help="comma-separated subset (default: all)")
    parser.add_argument(
        "--compare",
        default="",
        help="a git revision: serve it too (as 'before'), bursts alternating with this checkout ('after')",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-refusals-") as tmp:
        state = Path(tmp)
        models_root = Path(args.models_root)
        folder = ensure_model(state_env(models_root, state), args.model)
        roots = {"after" if args.compare else "this": ROOT}
        if args.compare:
            roots = {"before": export_revision(args.compare, state / "before"), **roots}
        procs, servers = [], {}
        try:
            for label, root in roots.items():
                proc, base, key, log = start_server(root, state / label, folder, models_root)
                procs.append((proc, log))
                wait_ready(proc, base, key, log)
                servers[label] = (base, key)
            only = set(filter(None, args.surfaces.split(",")))
            try:
                rows = asyncio.run(run(servers, folder, args.burst, args.rounds, only))
            except SystemExit:
                for _, log in procs:
                    print(log.read_text(errors="replace")[-6000:], file=sys.stderr)  # why it went wrong
                raise
        finally:
            for proc, _ in procs:
                stop_process(proc)
    compared = f", compared with {args.compare}" if args.compare else ""
    print(
        f"# refusals: burst {args.burst} at capacity {CAPACITY}, depth {DEPTH}, model {args.model}, "
        f"{args.rounds} round(s), load {loadavg():.2f}{compared}"
    )
    print(
        f"{'surface':<12} {'server':<7} {'served':<12} {'refused':<14} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
        "  max per round"
    )
    for r in rows:
        print(
            f"{r['surface']:<12} {r['server']:<7} {','.join(map(str, r['served'])):<12} "
            f"{','.join(map(str, r['refused'])):<14} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} {r['max_ms']:8.1f}  "
            f"{','.join(map(str, r.get('round_max_ms', [])))}"
        )
    if args.compare:
        print("\n# after / before")
        by = {(r["surface"], r["server"]): r for r in rows}
        for surface in dict.fromkeys(r["surface"] for r in rows):
            before, after = by[(surface, "before")], by[(surface, "after")]
            print(
                f"{surface:<12} p50 {after['p50_ms'] / before['p50_ms']:.2f}x  "
                f"p99 {after['p99_ms'] / before['p99_ms']:.2f}x"
            )
    expected_refused = args.burst - CAPACITY - DEPTH
    exact = all(set(r["refused"]) == {expected_refused} for r in rows if r["surface"] != "healthz")
    sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
