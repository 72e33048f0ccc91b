"""`Fleet.supervise` (what `make fleet` runs) on stand-in processes: a process that exits is started
again with a doubling backoff while the others run, and the run ends non-zero only once the fleet
as a whole cannot serve. No PostgreSQL or daphne: the real fleet's version is in test_fleet.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deploy.fleet import GIVE_UP_AFTER, Fleet, Proc, free_port
from tests.support import wait_until

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(120)]

LIVES = "import time; time.sleep(120)"
# Exits with code 3 on its first `n` starts (counted in a file), then lives.
FLAKY = (
    "import pathlib, sys, time; p = pathlib.Path(sys.argv[1]); n = int(p.read_text() or 0) if p.exists() else 0;"
    " p.write_text(str(n + 1)); sys.exit(3) if n < int(sys.argv[2]) else time.sleep(120)"
)


def stand_ins(tmp_path: Path, **code: list[str]) -> Fleet:
    """A Fleet whose processes are small Python scripts: `code[name]` is each one's argv tail."""
    fleet = Fleet({}, tmp_path)
    fleet.procs = {
        name: Proc(name, [sys.executable, "-c", *argv], {}, tmp_path / f"{name}.log")
        for name, argv in code.items()
    }
    return fleet


class Run:
    """`supervise` in a thread, with its report lines."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet, self.lines, self.stop, self.code = fleet, [], threading.Event(), None
        self.thread = threading.Thread(target=self._run, daemon=True)
        for proc in fleet.procs.values():
            proc.start()
        self.thread.start()

    def _run(self) -> None:
        self.code = self.fleet.supervise(self.stop, self.lines.append, backoff_first_s=0.05, poll_s=0.02)

    def said(self, pattern: str) -> list[re.Match[str]]:
        return [m for line in list(self.lines) if (m := re.search(pattern, line))]

    def end(self) -> int | None:
        self.stop.set()
        self.thread.join(30)
        self.fleet.stop()
        return self.code


def test_a_host_that_exits_is_started_again_with_backoff_while_the_others_serve(tmp_path):
    """h01 exits three times right after starting: each exit is reported with a wait that
    doubles, it is started again each time, and h02 and the proxy are never touched."""
    starts = tmp_path / "h01-starts"
    fleet = stand_ins(tmp_path, proxy=[LIVES], h01=[FLAKY, str(starts), "3"], h02=[LIVES])
    run = Run(fleet)
    try:
        wait_until(
            lambda: starts.exists() and starts.read_text() == "4", timeout=30, what="h01's fourth start"
        )
        wait_until(lambda: run.lines[-1] == "fleet: h01 is back", timeout=30, what="h01 to be back")
        assert fleet.serving() and fleet.procs["h02"].alive
    finally:
        code = run.end()
    waits = [float(m[1]) for m in run.said(r"h01 exited \(code 3\); starting it again in ([\d.]+)s")]
    assert waits == [0.05, 0.1, 0.2]
    assert len(run.said(r"h01 started again")) == 3 and starts.read_text() == "4"
    assert not run.said(r"h02|proxy")
    assert code == 0


def test_the_run_fails_only_once_no_engine_host_stays_up(tmp_path):
    """h01 never stays up and is given up on, while h02 serves: the run goes on; once h02 is
    given up on too, no host can serve and supervise returns 1."""
    fleet = stand_ins(
        tmp_path,
        proxy=[LIVES],
        h01=[FLAKY, str(tmp_path / "h01"), "1000"],
        h02=[FLAKY, str(tmp_path / "h02"), "0"],
    )
    run = Run(fleet)
    try:
        wait_until(lambda: run.said(r"h01 exited .*giving up on it"), timeout=30, what="h01 given up")
        assert run.code is None and fleet.serving()  # h02 still serves: the fleet goes on
        (tmp_path / "h02").write_text("-1000")  # h02 now exits on every start
        fleet.procs["h02"].kill()
        wait_until(lambda: run.code is not None, timeout=30, what="the run to end")
    finally:
        run.end()
    assert run.code == 1
    assert len(run.said(r"h02 started again")) == GIVE_UP_AFTER
    assert run.said(r"cannot serve: h01, h02 stay down")


def test_make_fleet_names_a_port_in_use_before_starting_anything(tmp_path):
    """The fleet's ports are fixed (proxy, admin-only process, hosts at admin + n): one already
    taken is named, with the make variables that move them, before any database work or process
    starts; the run exits non-zero."""
    root = Path(__file__).resolve().parents[2]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        admin = taken.getsockname()[1] - 1  # host 1 would listen on the taken port
        run = subprocess.run(
            [
                *(sys.executable, "deploy/fleet.py", "--port", str(free_port())),
                *("--admin-port", str(admin), "--folder", str(tmp_path / "fleet")),
            ],
            cwd=root,
            env={**os.environ, "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode == 1
    assert f"port {admin + 1} is in use" in run.stderr and "FLEET_ADMIN_PORT" in run.stderr
    assert not (tmp_path / "fleet").exists()  # nothing prepared, nothing started
