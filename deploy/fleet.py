"""A local mlxhost fleet: engine hosts, an admin-only process, a Celery worker and HAProxy (issue 15).

`make fleet` runs this file: it prepares the database named by DATABASE_URL (migrations, the demo
model, a staff login and an API key), starts everything on this machine with `deploy/haproxy.cfg`,
prints the addresses and runs until Ctrl-C. The fleet tests (`tests/fleet/`) use the `Fleet` class.

    python deploy/fleet.py [--port 8000] [--hosts 2]

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
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/mlxhost_fleet"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
MAX_HOSTS = 2  # the server lines deploy/haproxy.cfg names (h01, h02)


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
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT
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
        if not self.alive:
            return
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Fleet:
    """Engine hosts 1..`hosts`, an admin-only process, a Celery worker and HAProxy in front.

    `env` is the base environment of every Django process (DATABASE_URL and REDIS_URL included);
    `folder` holds logs, each host's var folder and the rendered addresses. Ports are free ones
    unless given.
    """

    env: dict[str, str]
    folder: Path
    hosts: int = 2
    port: int | None = None
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
        admin_port = free_port()
        self.procs["admin"] = self._daphne("admin", admin_port, base | {"MLXHOST_RUN_ENGINE": "false"})
        for n in range(1, self.hosts + 1):
            # One disk tier per host; the models folder and the rest of var/ are shared.
            kv = self.folder / f"h{n:02d}" / "kv"
            host_env = base | {"MLXHOST_HOST_ID": str(n), "MLXHOST_KV_DIR": str(kv)}
            self.procs[f"h{n:02d}"] = self._daphne(f"h{n:02d}", free_port(), host_env)
        worker = [py, "-m", "celery", "-A", "mlxhost.celery", "worker", "--pool=solo", "--loglevel=INFO"]
        worker += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        if self.beat:
            worker.append("--beat")
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

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):
            proc.stop()


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--hosts", type=int, default=MAX_HOSTS)
    parser.add_argument("--folder", type=Path, default=ROOT / "var" / "fleet")
    args = parser.parse_args()
    if shutil.which("haproxy") is None:
        sys.exit("fleet: haproxy not found (Debian: apt-get install haproxy; `make fleet` does it)")
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
    fleet = Fleet(env, args.folder, hosts=args.hosts, port=args.port, beat=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        fleet.start()
        lines = [f"  {name:<7}{proc.url or ''}  log: {proc.log}" for name, proc in fleet.procs.items()]
        sys.stdout.write(
            "\n".join(["", f"Fleet serving on {fleet.url}/ (Ctrl-C to stop)", *lines, ""]) + "\n"
        )
        sys.stdout.flush()
        while all(proc.alive for proc in fleet.procs.values()):
            time.sleep(1)  # supervising: report the first process that exits
        dead = [name for name, proc in fleet.procs.items() if not proc.alive]
        sys.stderr.write(f"fleet: {', '.join(dead)} exited; stopping (see the logs above)\n")
    except KeyboardInterrupt:
        pass
    finally:
        fleet.stop()


if __name__ == "__main__":
    main()
