"""Each fact once (issue 26): a code, a sampling field or a setting's default is written in one place
and read from there, so the copies cannot drift apart."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from api import errors as api_errors
from mlxhost.engine import errors as engine_errors
from mlxhost.engine.stats import REJECTIONS

ROOT = Path(__file__).resolve().parent.parent


def _error_classes() -> list[type[engine_errors.EngineError]]:
    seen: list[type[engine_errors.EngineError]] = []
    todo = [engine_errors.EngineError]
    while todo:
        kind = todo.pop()
        seen.append(kind)
        todo.extend(kind.__subclasses__())
    return [k for k in seen if k.__module__ == engine_errors.__name__]


def _string_literals(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }


@pytest.mark.parametrize("kind", _error_classes(), ids=lambda k: k.__name__)
def test_every_engine_error_defines_its_own_code(kind: type[engine_errors.EngineError]) -> None:
    assert "code" in vars(kind), f"{kind.__name__} inherits its code; give it its own"
    assert isinstance(kind.code, str) and kind.code


def test_the_api_reads_engine_codes_from_the_error_classes() -> None:
    codes = {kind.code for kind in _error_classes()}
    # Anthropic's error *types* are its own words (`request_too_large` is one), not our codes.
    anthropic_types = set(api_errors._ANTHROPIC_TYPES.values())
    repeated = (_string_literals(ROOT / "api" / "errors.py") & codes) - anthropic_types
    assert not repeated, f"api/errors.py repeats codes the error classes define: {sorted(repeated)}"


def test_the_overloaded_codes_are_defined_once() -> None:
    assert {engine_errors.QueueFullError.code, engine_errors.DrainingError.code} == (
        engine_errors.OVERLOADED_CODES
    )
    assert set(engine_errors.OVERLOADED_CODES) <= set(REJECTIONS)
    assert set(api_errors._ANTHROPIC_STATUS) == engine_errors.OVERLOADED_CODES
    for path in ("api/consumers.py", "api/errors.py", "mlxhost/engine/stats.py"):
        text = (ROOT / path).read_text()
        assert '"queue_full"' not in text, f"{path} spells a refusal code instead of importing it"
