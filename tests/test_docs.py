"""docs/architecture.md keeps up with the code: every package and runtime/models_app module is named,
and every promise ID it cites exists in docs/behaviour.md (issue 11, item 8)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
BEHAVIOUR = ROOT / "docs" / "behaviour.md"
PACKAGES = ("api", "models_app", "mlxhost")
# Packages whose every module the page must name, not only the package itself.
MODULE_PACKAGES = (
    "mlxhost/runtime",
    "models_app",
    *(f"models_app/{sub}" for sub in ("catalogue", "turns", "persistence", "accounting", "console")),
)
PROMISE_ID = re.compile(r"\b(?:LANE|REG|PER|SES|API|ADM|OPS|KEY)-\d+\b")


def package_dirs(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Every Python package under `packages`, as a path relative to `root` (`api/openai`)."""
    return sorted(
        init.parent.relative_to(root).as_posix()
        for package in packages
        for init in (root / package).rglob("__init__.py")
    )


def modules_of(root: Path, package: str) -> list[str]:
    """The modules directly inside `package` (`models_app/turns.py`), without `__init__.py`."""
    return sorted(
        path.relative_to(root).as_posix()
        for path in (root / package).glob("*.py")
        if path.name != "__init__.py"
    )


def missing_names(text: str, root: Path) -> list[str]:
    """Packages and modules the page does not name, as a path (`api/openai/`, `models_app/turns.py`)
    or a dotted name (`api.openai`, `models_app.turns`)."""
    wanted = [f"{package}/" for package in package_dirs(root)]
    wanted += [module for package in MODULE_PACKAGES for module in modules_of(root, package)]
    missing = []
    for name in wanted:
        dotted = name.removesuffix("/").removesuffix(".py").replace("/", ".")
        if name not in text and not re.search(rf"(?<![\w.]){re.escape(dotted)}(?![\w])", text):
            missing.append(name)
    return missing


def test_architecture_names_every_package_and_module() -> None:
    missing = missing_names(ARCHITECTURE.read_text(), ROOT)
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_architecture_cites_only_promises_that_exist() -> None:
    defined = set(re.findall(r"\*\*([A-Z]+-\d+)\*\*", BEHAVIOUR.read_text()))
    cited = set(PROMISE_ID.findall(ARCHITECTURE.read_text()))
    assert cited, "the page cites no promise at all"
    assert not cited - defined, f"cited but not in docs/behaviour.md: {sorted(cited - defined)}"


def test_a_new_package_or_module_that_the_page_omits_is_reported(tmp_path: Path) -> None:
    for name in ("api/__init__.py", "api/new/__init__.py", "models_app/__init__.py",
                 "models_app/turns.py", "mlxhost/__init__.py", "mlxhost/runtime/__init__.py",
                 "mlxhost/runtime/status.py"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    text = "api/ models_app/ mlxhost/ `mlxhost/runtime/` with mlxhost.runtime.status; models_app.turnsx"
    assert missing_names(text, tmp_path) == ["api/new/", "models_app/turns.py"]
