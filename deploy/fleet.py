"""A local mlxhost fleet: engine hosts, an admin-only process, a Celery worker and HAProxy (issue 15).

`make fleet` runs this file: it prepares the database named by DATABASE_URL (migrations, the demo
model, a staff login and an API key), starts everything on this machine with `deploy/haproxy.cfg`,
prints the addresses and runs until Ctrl-C. A process that exits is started again with backoff
while the others keep serving; the run ends non-zero only when the fleet as a whole cannot serve
(no engine host, or no proxy, that stays up). The fleet tests (`tests/fleet/`) use the `Fleet`
class.

    python deploy/fleet.py [--port 8000] [--admin-port 8100] [--hosts 2]

The proxy listens on --port; the admin-only process on --admin-port and host n on admin-port + n
(8101, 8102: the addresses `deploy/haproxy.cfg` defaults to).

Every process shares DATABASE_URL (PostgreSQL) and REDIS_URL (broker, channel layer, cache and
pending writes), and the models folder. Each engine host has its own MLXHOST_HOST_ID, port and disk
tier (MLXHOST_KV_DIR).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/mlxhost_fleet"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_ADMIN_PORT = 8100  # host n listens on this + n
MAX_HOSTS = 2  # the server lines deploy/haproxy.cfg names (h01, h02)
# Restarts: the wait doubles from BACKOFF_FIRST_S up to BACKOFF_MAX_S after each exit that came
# within STABLE_S of its start; GIVE_UP_AFTER such exits in a row and the process is left down.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 30.0
GIVE_UP_AFTER = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """The status of GET `url`, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None


@dataclass
class Proc:
    """One process of the fleet: how to start it, and the running one."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    url: str | None = None  # where it answers HTTP (hosts, admin, proxy)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # A process group of its own: Ctrl-C reaches `deploy/fleet.py` alone, which stops the
        # fleet in order (the proxy first, so the hosts see their clients leave).
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT, process_group=0
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL, as a host that dies: no shutdown hooks run."""
        if self.alive:
            assert self.process is not None
            self.process.kill()
            self.process.wait()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`."""
        self.terminate()
        self.wait_stopped(timeout)

    def terminate(self) -> None:
        """SIGTERM: a daphne drains (OPS-5), HAProxy closes its connections."""
        if self.alive:
            assert self.process is not None
            self.process.terminate()

    def wait_stopped(self, timeout: float) -> bool:
        """Wait for the exit; SIGKILL after `timeout`. True when it exited by itself."""
        if self.process is None:
            return True
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return False
        return True


@dataclass
class Fleet:
    """Engine hosts 1..`hosts`, an admin-only process, a Celery worker and HAProxy in front.

    `env` is the base environment of every Django process (DATABASE_URL and REDIS_URL included);
    `folder` holds logs, each host's var folder and the rendered addresses. Ports are free ones
    unless given: the proxy on `port`, the admin-only process on `admin_port`, host n on
    `admin_port + n`.
    """

    env: dict[str, str]
    folder: Path
    hosts: int = 2
    port: int | None = None
    admin_port: int | None = None
    beat: bool = False
    procs: dict[str, Proc] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"deploy/haproxy.cfg names {MAX_HOSTS} hosts; add server lines for more")
        self.folder.mkdir(parents=True, exist_ok=True)
        py = sys.executable
        base = {
            "DJANGO_SETTINGS_MODULE": "mlxhost.settings",
            "PYTHONUNBUFFERED": "1",
            "SECRET_KEY": self.env.get("SECRET_KEY") or secrets.token_urlsafe(50),
            **self.env,
        }
        admin_port = self.admin_port or free_port()
        self.procs["admin"] = self._daphne("admin", admin_port, base | {"MLXHOST_RUN_ENGINE": "false"})
        for n in range(1, self.hosts + 1):
            # One disk tier per host; the models folder and the rest of var/ are shared.
            kv = self.folder / f"h{n:02d}" / "kv"
            host_env = base | {"MLXHOST_HOST_ID": str(n), "MLXHOST_KV_DIR": str(kv)}
            port = admin_port + n if self.admin_port else free_port()
            self.procs[f"h{n:02d}"] = self._daphne(f"h{n:02d}", port, host_env)
        worker = [py, "-m", "celery", "-A", "mlxhost.celery", "worker", "--pool=solo", "--loglevel=INFO"]
        worker += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        if self.beat:  # beat's schedule with the fleet's other state, never in the working directory
            worker += ["--beat", "--schedule", str(self.folder / "celerybeat-schedule")]
        self.procs["worker"] = Proc("worker", worker, base, self.folder / "worker.log")
        proxy_port = self.port or free_port()
        addresses = {
            "MLXHOST_FLEET_BIND": f"127.0.0.1:{proxy_port}",
            "MLXHOST_FLEET_ADMIN": f"127.0.0.1:{admin_port}",
            # A host not started still needs an address: a closed port, always down.
            **{f"MLXHOST_FLEET_H{n:02d}": f"127.0.0.1:{free_port()}" for n in range(1, MAX_HOSTS + 1)},
        }
        for n in range(1, self.hosts + 1):
            url = self.procs[f"h{n:02d}"].url
            assert url is not None
            addresses[f"MLXHOST_FLEET_H{n:02d}"] = url.removeprefix("http://")
        proxy = [shutil.which("haproxy") or "haproxy", "-db", "-f", str(HAPROXY_CFG)]
        self.procs["proxy"] = Proc(
            "proxy",
            proxy,
            {**os.environ, **addresses},
            self.folder / "haproxy.log",
            f"http://127.0.0.1:{proxy_port}",
        )

    def _daphne(self, name: str, port: int, env: dict[str, str]) -> Proc:
        argv = [
            sys.executable,
            "-m",
            "daphne",
            "-b",
            "127.0.0.1",
            "-p",
            str(port),
            "mlxhost.asgi:application",
        ]
        return Proc(name, argv, env, self.folder / f"{name}.log", f"http://127.0.0.1:{port}")

    @property
    def url(self) -> str:
        """The fleet's one address (HAProxy)."""
        url = self.procs["proxy"].url
        assert url is not None
        return url

    def host(self, n: int) -> Proc:
        return self.procs[f"h{n:02d}"]

    def start(self, timeout: float = 90.0) -> None:
        """Start every process and wait until each answers (the proxy: until it routes to a host)."""
        for proc in self.procs.values():
            proc.start()
        self.wait_up([p for p in self.procs.values() if p.url], timeout)

    def start_host(self, n: int, timeout: float = 90.0) -> None:
        """Start host `n` again (after `kill`) and wait until it answers."""
        self.host(n).start()
        self.wait_up([self.host(n)], timeout)

    def wait_up(self, procs: list[Proc], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in procs:
            assert proc.url is not None
            while http_status(f"{proc.url}/healthz") != 200:
                if not proc.alive:
                    raise RuntimeError(f"{proc.name} exited:\n{proc.output()[-4000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} did not come up:\n{proc.output()[-4000:]}")
                time.sleep(0.2)  # polling a process that is starting: the condition is its answer

    def stop(self, report: Callable[[str], None] | None = None, timeout: float = 15.0) -> None:
        """Stop every process, saying how it goes to `report`: the proxy first (clients leave,
        so the hosts cancel their work, LANE-6), then the daphnes together (each drains, OPS-5),
        then the worker."""
        say = report or (lambda _line: None)
        groups = [
            ["proxy"],
            [name for name in self.procs if name == "admin" or name.startswith("h")],
            ["worker"],
        ]
        for names in groups:
            procs = [self.procs[name] for name in names if name in self.procs]
            running = [proc for proc in procs if proc.alive]
            if not running:
                continue
            say(f"fleet: stopping {', '.join(proc.name for proc in running)}")
            started = time.monotonic()
            for proc in running:
                proc.terminate()
            for proc in running:
                clean = proc.wait_stopped(max(0.0, timeout - (time.monotonic() - started)))
                how = "stopped" if clean else "killed (did not stop in time)"
                say(f"fleet: {proc.name} {how} after {time.monotonic() - started:.1f}s")

    def serving(self) -> bool:
        """Whether the fleet can serve now: the proxy and at least one engine host are running."""
        hosts = [proc for name, proc in self.procs.items() if name.startswith("h")]
        return self.procs["proxy"].alive and any(proc.alive for proc in hosts)

    def supervise(
        self,
        stop: threading.Event,
        report: Callable[[str], None],
        *,
        backoff_first_s: float = BACKOFF_FIRST_S,
        poll_s: float = 0.5,
    ) -> int:
        """Keep the fleet up until `stop` is set: a process that exits is started again after a
        backoff, while the others keep serving; each exit, restart and return goes to `report`.
        Returns 0 when stopped, 1 once the fleet cannot serve (the proxy or every engine host
        given up on, GIVE_UP_AFTER quick exits in a row)."""
        watch = {name: _Watch(backoff_first_s) for name in self.procs}
        while not stop.wait(poll_s):  # polling child processes: the condition is their exit
            for name, proc in self.procs.items():
                watch[name].step(proc, report)
            given_up = {name for name, w in watch.items() if w.given_up}
            hosts = {name for name in self.procs if name.startswith("h")}
            if "proxy" in given_up or hosts <= given_up:
                report(f"fleet: cannot serve: {', '.join(sorted(given_up))} stay down; stopping")
                return 1
        return 0


class _Watch:
    """One process under `Fleet.supervise`: its exits, its backoff, and whether it is back."""

    def __init__(self, backoff_first_s: float) -> None:
        self.first = backoff_first_s
        self.quick_exits = 0
        self.started_at = time.monotonic()
        self.restart_at: float | None = None
        self.back = True  # answered since its last start (or was never watched down)
        self.given_up = False

    def step(self, proc: Proc, report: Callable[[str], None]) -> None:
        if self.given_up:
            return
        now = time.monotonic()
        if proc.alive:
            if not self.back and (proc.url is None or http_status(f"{proc.url}/healthz", 0.5) == 200):
                self.back = True
                report(f"fleet: {proc.name} is back")
            if now - self.started_at >= STABLE_S:
                self.quick_exits = 0
            return
        if self.restart_at is None:
            code = proc.process.returncode if proc.process is not None else None
            self.quick_exits += 1 if now - self.started_at < STABLE_S else 0
            self.quick_exits = max(self.quick_exits, 1)
            if self.quick_exits > GIVE_UP_AFTER:
                self.given_up = True
                report(
                    f"fleet: {proc.name} exited (code {code}), {self.quick_exits} times in a row; giving up on it"
                )
                return
            wait = min(self.first * 2 ** (self.quick_exits - 1), BACKOFF_MAX_S)
            self.restart_at = now + wait
            report(
                f"fleet: {proc.name} exited (code {code}); starting it again in {wait:g}s (log: {proc.log})"
            )
        elif now >= self.restart_at:
            self.restart_at, self.started_at, self.back = None, now, False
            proc.start()
            report(f"fleet: {proc.name} started again")


def _prepare_database(env: dict[str, str]) -> None:
    """Create the database if PostgreSQL lacks it, then migrate, prepare the demo, print the login."""
    url = env["DATABASE_URL"]
    if url.startswith(("postgres://", "postgresql://")):
        import psycopg

        name = url.rsplit("/", 1)[1].split("?")[0]
        admin_url = url.rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin_url, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{name}"')
    manage = [sys.executable, "manage.py"]
    for command in (["migrate", "--noinput", "-v", "0"], ["mlxhost_prepare_demo"]):
        subprocess.run(manage + command, cwd=ROOT, env=env, check=True)


def _ports_taken(ports: list[int]) -> list[int]:
    taken = []
    for port in ports:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    return taken


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument(
        "--admin-port",
        type=int,
        default=int(os.environ.get("MLXHOST_FLEET_ADMIN_PORT", DEFAULT_ADMIN_PORT)),
        help="the admin-only process; host n listens on this + n (default 8100: 8101, 8102)",
    )
    parser.add_argument("--hosts", type=int, default=MAX_HOSTS)
    parser.add_argument("--folder", type=Path, default=ROOT / "var" / "fleet")
    args = parser.parse_args()
    if shutil.which("haproxy") is None:
        sys.exit("fleet: haproxy not found (Debian: apt-get install haproxy; `make fleet` does it)")
    ports = [args.port, args.admin_port, *(args.admin_port + n for n in range(1, args.hosts + 1))]
    if taken := _ports_taken(ports):
        sys.exit(
            f"fleet: port {', '.join(map(str, taken))} is in use; choose others with "
            "`make fleet PORT=... FLEET_ADMIN_PORT=...` (hosts use FLEET_ADMIN_PORT + 1, + 2)"
        )
    env = dict(os.environ)
    env.setdefault("DATABASE_URL", DEFAULT_DATABASE_URL)
    env.setdefault("REDIS_URL", DEFAULT_REDIS_URL)
    secret_file = args.folder / "secret_key"
    args.folder.mkdir(parents=True, exist_ok=True)
    if not secret_file.exists():
        secret_file.write_text(secrets.token_urlsafe(50))
        secret_file.chmod(0o600)
    env.setdefault("SECRET_KEY", secret_file.read_text().strip())
    _prepare_database(env)
    subprocess.run(
        [sys.executable, "manage.py", "mlxhost_bootstrap", "--port", str(args.port)],
        cwd=ROOT,
        env=env,
        check=True,
    )
    fleet = Fleet(env, args.folder, hosts=args.hosts, port=args.port, admin_port=args.admin_port, beat=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # while starting: stop what started
    code = 0
    try:
        fleet.start()
        for signum in (signal.SIGINT, signal.SIGTERM):  # from now on: stop in order (below)
            signal.signal(signum, lambda *_: stop.set())
        lines = [f"  {name:<7}{proc.url or ''}  log: {proc.log}" for name, proc in fleet.procs.items()]
        say("\n".join(["", f"Fleet serving on {fleet.url}/ (Ctrl-C to stop)", *lines, ""]))
        code = fleet.supervise(stop, say)
    except RuntimeError as exc:  # a process did not come up
        say(f"fleet: {exc}")
        code = 1
    except KeyboardInterrupt:  # Ctrl-C while starting
        code = 130
    finally:
        say("fleet: stopping (the proxy first, then the hosts drain)")
        fleet.stop(say)
        say("fleet: stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
