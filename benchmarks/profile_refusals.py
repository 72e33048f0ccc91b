"""Where a refusal's time goes: cProfile of a real daphne's event loop during refusal bursts (issue 25 §4).

The server is the one `bench_refusals.py` bursts (capacity 1, depth 4, long generations). It
runs daphne in-process under this script's `--serve` mode, which turns a cProfile of the main
thread (the Twisted/asyncio loop, where every refusal is decided) on at SIGUSR1 and off with a
dump at SIGUSR2. The driver warms each surface with one burst, profiles `--rounds` bursts, and
prints the functions that took the loop's time, by own time and by cumulative time.

    .venv/bin/python benchmarks/profile_refusals.py --surfaces chat,websocket --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    DEFAULT_MODELS_ROOT,
    ensure_model,
    free_port,
    register_alias,
    start_process,
    state_env,
    stop_process,
    wait_ready,
)
from bench_refusals import CAPACITY, DEPTH, LONG, bodies, eos_bias, surface_burst


def serve(profile_path: str, daphne_args: list[str]) -> None:
    """Run daphne here; SIGUSR1 starts a profile of this (the loop's) thread, SIGUSR2 dumps it."""
    profiler = cProfile.Profile()

    def start(*_: object) -> None:
        profiler.enable()

    def dump(*_: object) -> None:
        profiler.disable()
        profiler.dump_stats(profile_path)
        Path(profile_path + ".done").touch()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, dump)
    from daphne.cli import CommandLineInterface

    CommandLineInterface().run(daphne_args)


def wait_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"the server wrote no profile at {path}")
        time.sleep(0.1)


async def bursts(
    base: str, key: str, folder: Path, surfaces: list[str], rounds: int
) -> dict[str, list[float]]:
    """`rounds` bursts per surface; the refusals' latencies in ms."""
    shapes = bodies(eos_bias(folder))
    latencies: dict[str, list[float]] = {name: [] for name in surfaces}
    for name in surfaces:
        for _ in range(rounds):
            _, refused = await surface_burst(base, key, shapes, name, 20)
            latencies[name].extend(1000 * t for t in refused)
    return latencies


def report(profile: Path, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(str(profile), stream=out)
    stats.strip_dirs()
    for order in ("tottime", "cumulative"):
        print(f"\n## by {order}", file=out)
        stats.sort_stats(order).print_stats(top)
    return out.getvalue()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "demo"), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--surfaces", default="chat,messages,websocket")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--models-root", default=DEFAULT_MODELS_ROOT)
    parser.add_argument("--out", default="", help="keep the .prof file here")
    args = parser.parse_args()
    surfaces = [s for s in args.surfaces.split(",") if s]

    with tempfile.TemporaryDirectory(prefix="mlxhost-profile-refusals-") as tmp:
        state = Path(tmp)
        env = state_env(Path(args.models_root), state)
        folder = ensure_model(env, args.model)
        key = register_alias(env, folder, concurrency=CAPACITY, queue_depth=DEPTH, max_output_tokens=LONG)
        profile = Path(args.out or state / "refusals.prof")
        log = state / "daphne.log"
        port = free_port()
        cmd = [sys.executable, __file__, "--serve", str(profile), "-b", "127.0.0.1", "-p", str(port)]
        proc = start_process([*cmd, "mlxhost.asgi:application"], {**env, "MLXHOST_PRELOAD": "true"}, log)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(proc, base, key, log)
            asyncio.run(bursts(base, key, folder, surfaces, 1))  # warm-up: imports, first compiles
            os.kill(proc.pid, signal.SIGUSR1)
            latencies = asyncio.run(bursts(base, key, folder, surfaces, args.rounds))
            os.kill(proc.pid, signal.SIGUSR2)
            wait_file(Path(str(profile) + ".done"))
            print(report(profile, args.top))
        except (SystemExit, subprocess.SubprocessError):
            print(log.read_text(errors="replace")[-6000:], file=sys.stderr)
            raise
        finally:
            stop_process(proc)
    for name, values in latencies.items():
        ordered = sorted(values)
        if ordered:
            print(
                f"# {name}: {len(ordered)} refusals under the profiler, median "
                f"{ordered[len(ordered) // 2]:.1f} ms, max {ordered[-1]:.1f} ms"
            )


if __name__ == "__main__":
    main()
