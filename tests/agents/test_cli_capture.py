"""Both coding-agent CLIs, run against the capture server: their first requests still match the fixtures."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.agents.capture import FIXTURES, CliRun, install_clis, run_claude, run_codex

pytestmark = pytest.mark.agent_cli


@pytest.fixture(scope="module", autouse=True)
def clis() -> None:
    """npm installs Claude Code and Codex into .cache/agent-clis once (a no-op when present)."""
    install_clis()


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}_first_request.json").read_text())
    return data


@pytest.mark.parametrize(("runner", "name"), [(run_claude, "claude_code"), (run_codex, "codex")])
def test_first_request_matches_fixture(runner: Any, name: str) -> None:
    run: CliRun = runner()
    stored = fixture(name)
    first = run.model_requests()[0]
    path, _, query = first.path.partition("?")
    assert (path, query) == (stored["path"], stored["query"])
    assert sorted(first.body) == sorted(stored["body"]), f"{run.version} vs fixture {stored['version']}"
    assert first.headers.get("anthropic-beta") == stored["anthropic_beta"]


def test_claude_reports_prompt_too_long_without_retrying() -> None:
    run = run_claude("anthropic_too_long")
    assert run.returncode == 1
    assert "Prompt is too long" in run.output
    assert len(run.model_requests()) == 1


def test_codex_reports_context_length_exceeded_without_retrying() -> None:
    run = run_codex("openai_too_long")
    assert run.returncode == 1
    assert "ran out of room in the model's context window" in run.output
    assert len(run.model_requests()) == 1


@pytest.mark.parametrize(
    ("reply", "routed"),
    [("openai_namespace_call", True), ("openai_joined_call", False), ("openai_bare_call", False)],
)
def test_codex_routes_namespaced_calls_by_the_namespace_field(reply: str, routed: bool) -> None:
    run = run_codex(f"{reply},openai_bad_request")
    second = run.model_requests()[1].body["input"]
    output = next(item["output"] for item in second if item["type"] == "function_call_output")
    assert output.startswith("unsupported call") is not routed
