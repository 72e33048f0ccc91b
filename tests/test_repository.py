"""The repository holds sources only (issue 26, item 7): no generated file is tracked, and every
place that starts Celery beat points its schedule under var/ (ignored) instead of the working directory."""

from __future__ import annotations

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
