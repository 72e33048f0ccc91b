"""Each fact once (issue 26): a code, a sampling field or a setting's default is written in one place
and read from there, so the copies cannot drift apart."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from api import errors as api_errors
from api.sampling import SAMPLING_KEYS, SamplingInput
from mlxhost.engine import ALIAS_SAMPLING_FIELDS, SAMPLING_KNOBS, SamplingParams
from mlxhost.engine import errors as engine_errors
from mlxhost.engine.limits import _RANGES
from mlxhost.engine.stats import REJECTIONS
from mlxhost.runtime.config import PersistenceSettings, runtime_settings_from
from models_app.catalogue import specs
from models_app.console import admin as models_admin
from models_app.console.forms import ALIAS_FORM_FIELDS
from models_app.models import ModelAlias
from models_app.persistence.persistence import Persistence

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
    for path in ("api/ws/responses.py", "api/errors.py", "mlxhost/engine/stats.py"):
        text = (ROOT / path).read_text()
        assert '"queue_full"' not in text, f"{path} spells a refusal code instead of importing it"


SAMPLING_LITERAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def test_the_sampling_knobs_are_the_dataclass_fields() -> None:
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    assert [name for name in fields if name != "grammar"] == list(SAMPLING_KNOBS) == list(SAMPLING_KEYS)
    # What the shared serializer validates is every knob; `logprobs` each surface sets its way.
    assert set(SamplingInput().fields) - {"model"} == set(SAMPLING_KNOBS) - {"logprobs"}
    assert {name for name, _, _ in _RANGES} <= set(SAMPLING_KNOBS)


def test_the_alias_sampling_defaults_are_listed_once() -> None:
    assert set(ALIAS_SAMPLING_FIELDS) <= set(SAMPLING_KNOBS)
    columns = {f.name for f in ModelAlias._meta.get_fields()}
    assert set(ALIAS_SAMPLING_FIELDS) <= columns
    # The merge covers every knob once: an alias default, a request-only knob, or shaped apart.
    merged = [*specs.SAMPLING_FIELDS, *specs.REQUEST_ONLY_FIELDS, *specs._SHAPED_FIELDS]
    assert sorted(merged) == sorted(SAMPLING_KNOBS)
    assert set(ALIAS_SAMPLING_FIELDS) <= set(ALIAS_FORM_FIELDS)
    fieldsets = dict(models_admin.ModelAliasAdmin.fieldsets or ())
    assert tuple(fieldsets["Sampling defaults"]["fields"]) == ALIAS_SAMPLING_FIELDS
    for path in (
        "api/sampling.py",
        "models_app/catalogue/selectors.py",
        "models_app/console/forms.py",
        "models_app/console/admin.py",
    ):
        text = " ".join((ROOT / path).read_text().split())
        spelled = ", ".join(f'"{name}"' for name in SAMPLING_LITERAL[:3])
        assert spelled not in text, f"{path} lists sampling fields instead of importing them"


PERSISTENCE_ENV = {
    "MLXHOST_PERSIST_PUBLISH_TIMEOUT_S": "publish_timeout_s",
    "MLXHOST_PERSIST_HARD_TIMEOUT_S": "hard_timeout_s",
    "MLXHOST_PERSIST_WAIT_S": "wait_s",
    "MLXHOST_PERSIST_POLL_S": "poll_s",
    "MLXHOST_TOMBSTONE_TTL_S": "tombstone_ttl_s",
    "MLXHOST_SWEEP_INTERVAL_S": "sweep_interval_s",
}


def test_the_persistence_settings_are_parsed_in_the_runtime_config() -> None:
    assert runtime_settings_from({}).persistence == PersistenceSettings()
    env = {name: str(10 + i) for i, name in enumerate(PERSISTENCE_ENV)}
    parsed = runtime_settings_from(env).persistence
    for i, (name, attr) in enumerate(PERSISTENCE_ENV.items()):
        assert getattr(parsed, attr) == 10 + i, name
    assert {f.name for f in dataclasses.fields(PersistenceSettings)} == set(PERSISTENCE_ENV.values())


def test_the_persistence_defaults_live_in_the_runtime_config_only() -> None:
    # A store takes the one settings object; one a test builds by hand gets its defaults.
    parameters = inspect.signature(Persistence).parameters
    for attr in PERSISTENCE_ENV.values():
        assert attr not in parameters, f"Persistence spells its own {attr} default"
    store = Persistence()
    try:
        assert store.config == PersistenceSettings()
    finally:
        store.close()
    settings_text = (ROOT / "mlxhost" / "settings.py").read_text()
    for name in PERSISTENCE_ENV:
        assert f'"{name}"' not in settings_text, f"mlxhost/settings.py parses {name} again"
