"""The repository (issue 26, item 7): no generated file is tracked, every place that starts Celery
beat points its schedule under var/ (ignored) instead of the working directory, and one helper
(`scripts/deb_package.sh`) installs the Makefile's Debian packages when root."""

from __future__ import annotations

import os
import shutil
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest

from deploy.fleet import Fleet

ROOT = Path(__file__).resolve().parent.parent
# Names that only a run writes: beat's shelve files, databases, bytecode, caches, installs, logs.
GENERATED = (
    "celerybeat-schedule*",
    "*.sqlite3",
    "*.sqlite3-*",
    "__pycache__",
    "*.py[co]",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".cache",
    "*.egg-info",
    "node_modules",
    ".venv",
    "var",
    ".env",
    "*.log",
    ".DS_Store",
)
# The files that start processes; a `--beat` in them must come with `--schedule`.
LAUNCHERS = ("Makefile", "scripts/*", ".ci/*", "deploy/*.py")


def generated(paths: list[str]) -> list[str]:
    """The paths with a component that matches a GENERATED pattern."""
    return [p for p in paths if any(fnmatch(part, pat) for part in p.split("/") for pat in GENERATED)]


def tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def test_no_generated_file_is_tracked() -> None:
    found = generated(tracked())
    assert not found, f"generated files are tracked (git rm them, cover them in .gitignore): {found}"


def test_the_generated_patterns_catch_what_a_run_writes() -> None:
    paths = ["celerybeat-schedule.dat", "var/db.sqlite3", "api/__pycache__/x.cpython-312.pyc",
             "a.egg-info/PKG-INFO", ".env", ".env.example", "api/views.py", "docs/variables.md"]  # fmt: skip
    assert generated(paths) == paths[:5]


def test_gitignore_covers_the_generated_files() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = ["celerybeat-schedule.dat", "celerybeat-schedule.db", "x.sqlite3", "var/db.sqlite3",
             "api/__pycache__/m.cpython-312.pyc", ".env"]  # fmt: skip
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", *names], cwd=ROOT, capture_output=True, text=True
    )
    assert sorted(done.stdout.split()) == sorted(names)


def test_make_worker_keeps_the_beat_schedule_under_var() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make")
    dry = subprocess.run(["make", "-n", "worker"], cwd=ROOT, capture_output=True, text=True, check=True)
    beat = [line for line in dry.stdout.splitlines() if "--beat" in line]
    assert beat, dry.stdout
    assert all("--schedule var/celerybeat-schedule" in line for line in beat), beat


def test_the_fleet_worker_keeps_the_beat_schedule_in_the_fleet_folder(tmp_path: Path) -> None:
    argv = Fleet({}, tmp_path, beat=True).procs["worker"].argv
    assert "--beat" in argv
    assert Path(argv[argv.index("--schedule") + 1]) == tmp_path / "celerybeat-schedule"


def test_every_launcher_that_starts_beat_names_its_schedule() -> None:
    files = sorted({path for pattern in LAUNCHERS for path in ROOT.glob(pattern) if path.is_file()})
    bare = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in files
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if "--beat" in line and "--schedule" not in line
    ]
    assert not bare, (
        f"Celery beat started without --schedule (it would write to the working directory): {bare}"
    )


DEB_TARGETS = ("openblas", "chromium", "haproxy")


def stubs(tmp_path: Path, *, uid: int = 0, apt_ok: bool = True) -> dict[str, str]:
    """An environment whose `id`, `uname` and `apt-get` are stand-ins; apt-get logs its arguments
    to `apt.log` and succeeds unless `apt_ok` is false."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scripts = {
        "id": f"echo {uid}",
        "uname": "echo Linux",
        "apt-get": f'echo "$*" >> {tmp_path / "apt.log"}; exit {0 if apt_ok else 1}',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def make(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("make") is None:
        pytest.skip("no make")
    return subprocess.run(["make", "-s", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def deb_package(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    script = ROOT / "scripts" / "deb_package.sh"
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True)


def test_the_package_targets_use_the_one_helper() -> None:
    dry = make(dict(os.environ), "-n", *DEB_TARGETS)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("scripts/deb_package.sh") == len(DEB_TARGETS)
    recipes = [line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("\t")]
    assert not [line for line in recipes if "apt-get" in line]


def test_the_package_targets_do_nothing_when_the_packages_are_there(tmp_path: Path) -> None:
    env = stubs(tmp_path)
    (tmp_path / "libopenblas.so.0").write_text("")
    (tmp_path / "bin" / "haproxy").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "haproxy").chmod(0o755)
    there = f"OPENBLAS={tmp_path / 'libopenblas.so.0'}", f"CHROMIUM={tmp_path / 'bin' / 'haproxy'}"
    done = make(env, *DEB_TARGETS, *there)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert not (tmp_path / "apt.log").exists()


def test_a_missing_package_is_installed_as_root(tmp_path: Path) -> None:
    gone = f"OPENBLAS={tmp_path / 'none.so'}", f"CHROMIUM={tmp_path / 'none'}"
    done = make(stubs(tmp_path), "openblas", "chromium", *gone)
    assert done.returncode == 0, done.stderr
    assert "Installing libopenblas0-pthread (" in done.stdout and "Installing chromium (" in done.stdout
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert calls == [
        "update -qq",
        "install -y -qq libopenblas0-pthread",
        "update -qq",
        "install -y -qq chromium",
    ]


@pytest.mark.parametrize(("uid", "apt_ok"), [(1000, True), (0, False)], ids=["not root", "apt-get fails"])
def test_a_package_that_stays_missing_warns_or_fails(tmp_path: Path, uid: int, apt_ok: bool) -> None:
    env = stubs(tmp_path, uid=uid, apt_ok=apt_ok)
    warned = make(env, "openblas", f"OPENBLAS={tmp_path / 'none.so'}")
    assert warned.returncode == 0 and "WARNING: " in warned.stdout and "reference BLAS" in warned.stdout
    failed = deb_package(env, "haproxy", "the fleet's load balancer")
    assert failed.returncode == 1 and "apt-get install haproxy" in failed.stderr
    assert (tmp_path / "apt.log").exists() == (uid == 0)
