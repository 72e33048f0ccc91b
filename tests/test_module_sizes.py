"""Issue 26's size guards: no product module over 500 lines, no class over 400.

A module that outgrows 500 lines, or a class that outgrows 400, is where a newcomer gets lost and
where the next feature squeezes in on top (the engine's one class reached 772 lines). Split it by
what it does before adding to it. Migrations are generated and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("mlxhost", "api", "models_app", "deploy")
MODULE_LINES = 500
CLASS_LINES = 400


def product_modules(root: Path = ROOT, packages: tuple[str, ...] = PRODUCT) -> list[Path]:
    return sorted(
        path
        for package in packages
        for path in (root / package).rglob("*.py")
        if "migrations" not in path.relative_to(root).parts
    )


def oversized(paths: list[Path], root: Path = ROOT) -> list[str]:
    """Every module over MODULE_LINES and every class over CLASS_LINES, as "path: what"."""
    found = []
    for path in paths:
        text = path.read_text()
        name = path.relative_to(root)
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            found.append(f"{name}: {lines} lines (at most {MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > CLASS_LINES:
                    found.append(f"{name}: class {node.name} is {length} lines (at most {CLASS_LINES})")
    return found


def test_no_product_module_or_class_is_too_long() -> None:
    modules = product_modules()
    assert len(modules) > 100  # the scan sees the product
    assert oversized(modules) == []


def test_the_guard_reports_a_long_module_and_a_long_class(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "migrations").mkdir(parents=True)
    (package / "short.py").write_text("x = 1\n" * MODULE_LINES)
    (package / "long.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    body = "".join(f"    a{i} = {i}\n" for i in range(CLASS_LINES))  # the class line makes 401
    (package / "klass.py").write_text(f"class Big:\n{body}\nclass Small:\n    pass\n")
    (package / "migrations" / "0001_initial.py").write_text("x = 1\n" * 900)
    found = oversized(product_modules(tmp_path, ("pkg",)), tmp_path)
    assert found == [
        f"pkg/klass.py: class Big is {CLASS_LINES + 1} lines (at most {CLASS_LINES})",
        f"pkg/long.py: {MODULE_LINES + 1} lines (at most {MODULE_LINES})",
    ]
