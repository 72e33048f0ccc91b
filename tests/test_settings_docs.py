"""Each setting is written down once (issue 26, item 6): every environment variable the product reads
(`mlxhost/settings.py`, `mlxhost/runtime/config.py`, any `os.environ` or `env.` read) has one entry in
`.env.example`, under a comment that says what it does, and one row in a table of the README or
`docs/*.md` (`| \\`NAME\\` | default | meaning |`). Neither lists a variable nothing reads."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("mlxhost", "api", "models_app", "deploy")
ENV_EXAMPLE = ROOT / ".env.example"
NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*")
# Read, but not a setting of ours: Django's own (manage.py, asgi.py and celery.py set it).
NOT_SETTINGS = frozenset({"DJANGO_SETTINGS_MODULE"})
# A second name for a setting: documented in the same row, and named in the setting's comment in
# .env.example instead of an entry of its own.
ALIASES = {"DJANGO_SECRET_KEY": "SECRET_KEY"}
EXAMPLE_ENTRY = re.compile(rf"^#\s?({NAME.pattern})=")
# A table row whose first cell is one name or several (`A` / `B`): where a variable is documented.
DOC_ROW = re.compile(rf"^\|\s*(`{NAME.pattern}`(?:\s*/\s*`{NAME.pattern}`)*)\s*\|")


def env_reads(paths: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    """The variable names read in `paths`, each with where: a call on something named like `env` or
    `environ` (`env.int("X")`, `os.environ.get("X")`, `os.getenv("X")`) or a call that passes an
    `env` mapping (`_float(env, "X", 1.0)`) with the name as a literal, or `os.environ["X"]`."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[object] = []
            if isinstance(node, ast.Call):
                passes_env = any(isinstance(a, ast.Name) and "env" in a.id.lower() for a in node.args)
                if "env" in ast.unparse(node.func).lower() or passes_env:
                    names = [a.value for a in node.args[:2] if isinstance(a, ast.Constant)]
            elif isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
                names = [node.slice.value] if isinstance(node.slice, ast.Constant) else []
            for name in names:
                if isinstance(name, str) and NAME.fullmatch(name) and name not in NOT_SETTINGS:
                    found.setdefault(name, []).append(
                        f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
                    )
    return found


def read_settings() -> dict[str, list[str]]:
    return env_reads(sorted(p for package in SOURCES for p in (ROOT / package).rglob("*.py")))


def example_entries(text: str) -> tuple[Counter[str], dict[str, str]]:
    """How often each variable has an entry (`# NAME=value`), and the comment line right above it
    (empty when the line above is another entry or not a comment)."""
    counts: Counter[str] = Counter()
    comments: dict[str, str] = {}
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if match := EXAMPLE_ENTRY.match(line):
            counts[match[1]] += 1
            above = lines[n - 1] if n else ""
            described = above.startswith("#") and not EXAMPLE_ENTRY.match(above)
            comments[match[1]] = above.lstrip("# ").strip() if described else ""
    return counts, comments


def doc_rows(texts: list[str]) -> Counter[str]:
    """How many table rows across `texts` (Markdown pages) document each variable."""
    rows: Counter[str] = Counter()
    for text in texts:
        for line in text.splitlines():
            if match := DOC_ROW.match(line):
                rows.update(re.findall(r"`([^`]+)`", match[1]))
    return rows


def doc_texts() -> list[str]:
    return [page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]


def listing(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


def example_problems(read: set[str], text: str) -> list[str]:
    counts, comments = example_entries(text)
    wanted = read - set(ALIASES)
    problems = []
    if missing := wanted - set(counts):
        problems.append(
            f".env.example lacks (add `# what it does` then `# NAME=default`): {listing(missing)}"
        )
    if twice := {name for name, n in counts.items() if n > 1}:
        problems.append(f".env.example lists more than once: {listing(twice)}")
    if stale := set(counts) - read:
        problems.append(f".env.example lists what no code reads: {listing(stale)}")
    if bare := {name for name in wanted & set(counts) if not comments[name]}:
        problems.append(f".env.example has no comment line right above: {listing(bare)}")
    unnamed = {
        alias for alias, name in ALIASES.items() if alias in read and alias not in comments.get(name, "")
    }
    if unnamed:
        problems.append(
            f".env.example does not name these aliases in their setting's comment: {listing(unnamed)}"
        )
    return problems


def doc_problems(read: set[str], rows: Counter[str]) -> list[str]:
    problems = []
    if missing := read - set(rows):
        problems.append(f"no README/docs table row documents: {listing(missing)}")
    if twice := {name for name, n in rows.items() if n > 1 and name in read}:
        problems.append(f"documented in more than one table row: {listing(twice)}")
    if stale := {name for name in rows if name.startswith("MLXHOST_") and name not in read}:
        problems.append(f"documented but read by no code: {listing(stale)}")
    return problems


def test_every_setting_read_has_one_described_entry_in_env_example() -> None:
    problems = example_problems(set(read_settings()), ENV_EXAMPLE.read_text())
    assert not problems, "\n".join(problems)


def test_every_setting_read_is_documented_in_one_table_row() -> None:
    problems = doc_problems(set(read_settings()), doc_rows(doc_texts()))
    assert not problems, "\n".join(problems)


def test_the_reads_found_include_every_form(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import os\nimport environ\nenv = environ.Env()\n"
        'A = env.int("MLXHOST_A", default=1)\nB = os.environ.get("PORT")\nC = os.environ["MLXHOST_C"]\n'
        'D = _float(env, "MLXHOST_D", 2.0)\nE = os.getenv("MLXHOST_E")\nos.environ.setdefault("DJANGO_SETTINGS_MODULE", "x")\n'
        'F = {"MLXHOST_F": "1"}\nG = settings.get("MLXHOST_G")\n'
    )
    found = env_reads([module], tmp_path)
    assert sorted(found) == ["MLXHOST_A", "MLXHOST_C", "MLXHOST_D", "MLXHOST_E", "PORT"]


def test_a_missing_twice_stale_or_bare_entry_is_named() -> None:
    text = "# what A does\n# MLXHOST_A=1\n# MLXHOST_B=2\n# MLXHOST_B=3\n# about OLD\n# MLXHOST_OLD=1\n"
    problems = example_problems({"MLXHOST_A", "MLXHOST_B", "MLXHOST_NEW"}, text)
    assert problems == [
        ".env.example lacks (add `# what it does` then `# NAME=default`): MLXHOST_NEW",
        ".env.example lists more than once: MLXHOST_B",
        ".env.example lists what no code reads: MLXHOST_OLD",
        ".env.example has no comment line right above: MLXHOST_B",
    ]
    rows = doc_rows(
        ["| `MLXHOST_A` / `MLXHOST_B` | 1 | x |\n| `MLXHOST_B` | 2 | y |\n| `MLXHOST_OLD` | z |\n"]
    )
    assert doc_problems({"MLXHOST_A", "MLXHOST_B", "MLXHOST_NEW"}, rows) == [
        "no README/docs table row documents: MLXHOST_NEW",
        "documented in more than one table row: MLXHOST_B",
        "documented but read by no code: MLXHOST_OLD",
    ]
