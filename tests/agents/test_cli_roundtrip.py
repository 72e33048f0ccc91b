"""Claude Code and Codex CLI against a real daphne (API-11, API-12): one full agent round trip through each surface,
and the demo model's "too long" answer to their first request.

The server runs the scripted fake backend (`MLXHOST_ENGINE_BACKEND=fake:SCRIPT`), a model with a
long context and a native tool format whose answers depend on the prompt: asked with the CLI's
shell tool on offer, it calls that tool with `echo mlxhost-ok`; once the prompt holds a tool
result saying `mlxhost-ok`, it gives the final answer. So the final answer on the CLI's output is
the server's own proof that the tool result came back in the next request. The recording proxy
between CLI and server shows the requests themselves.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from tests.agents.capture import CliRun, Target, install_clis, run_claude, run_codex
from tests.e2e.conftest import database_url, running_daphne, stored_rows_settle  # noqa: F401 (fixture)
from tests.support import register_alias

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.e2e.conftest import Server

pytestmark = [pytest.mark.agent_cli, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

MARKER = "mlxhost-ok"
FINAL = "Round trip done: the shell printed the marker."
ASK = "Run the shell command `echo mlxhost-ok` and tell me what it printed."


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# First match wins (see FakeBackend.from_script). A tool result holding the marker comes back as a
# "tool" message, which the fake renders as `<tool>CONTENT`; tools on offer render as `<tool>NAME`.
SCRIPT = {
    "knows_tools": True,
    "markers": True,
    "context_length": 1_000_000,
    "replies": [
        {"when": f"<tool>[^<]*{MARKER}", "text": FINAL},
        {"when": "<tool>Bash<", "text": _call("Bash", {"command": f"echo {MARKER}", "description": "Print"})},
        {"when": "<tool>exec_command<", "text": _call("exec_command", {"cmd": f"echo {MARKER}"})},
        {"when": "", "text": "Nothing to do."},
    ],
}


@pytest.fixture(scope="module", autouse=True)
def clis() -> None:
    install_clis()


@pytest.fixture(scope="module")
def scripted_server(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("scripted")
    script = folder / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with django_db_blocker.unblock():
        url = database_url()
    with running_daphne(url, folder, MLXHOST_ENGINE_BACKEND=f"fake:{script}") as server:
        yield server


@pytest.fixture(scope="module")
def demo_server(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Server]:
    with django_db_blocker.unblock():
        url = database_url()
    with running_daphne(url, tmp_path_factory.mktemp("demo")) as server:
        yield server


@pytest.fixture
def target(scripted_server: Server, tiny_tools_model_dir, api_key: str) -> Target:
    # The fake loads no weights; the folder only gives the alias a model to stand for.
    register_alias(name="scripted", folder="tiny-llama-tools", max_output_tokens=4096)
    return Target(upstream=scripted_server.url, model="scripted", api_key=api_key, prompt=ASK)


def model_posts(run: CliRun, path: str) -> list[dict[str, Any]]:
    return [r.body for r in run.model_requests() if r.path.partition("?")[0] == path]


def test_claude_code_runs_the_shell_tool_and_answers(target: Target) -> None:
    run = run_claude(target=target, args=("--allowedTools", "Bash(echo:*)"), timeout=180)
    assert run.returncode == 0, run.output
    assert FINAL in run.output
    bodies = model_posts(run, "/v1/messages")
    results = [
        block
        for body in bodies
        for message in body["messages"]
        if message["role"] == "user" and isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    assert any(MARKER in json.dumps(block["content"]) for block in results), run.output


def test_codex_runs_the_shell_tool_and_answers(target: Target) -> None:
    run = run_codex(target=target, timeout=180)
    assert run.returncode == 0, run.output
    assert FINAL in run.output
    outputs = [
        item["output"]
        for body in model_posts(run, "/v1/responses")
        for item in body["input"]
        if item.get("type") == "function_call_output"
    ]
    assert any(MARKER in json.dumps(output) for output in outputs), run.output


@pytest.fixture
def demo_target(demo_server: Server, demo_alias, api_key: str) -> Target:
    return Target(upstream=demo_server.url, model=demo_alias.name, api_key=api_key)


def test_claude_code_on_the_demo_model_reports_the_prompt_is_too_long(demo_target: Target) -> None:
    """The first request (about 20k tokens) does not fit SmolLM2's 8192: Anthropic's exact error, which
    Claude Code turns into its own message; one request, no retry, no hang."""
    run = run_claude(target=demo_target, timeout=180)
    assert run.returncode == 1, run.output
    # 8191: the prompt may fill the 8192-token context but for the one token of the answer.
    assert "Prompt is too long" in run.output and "(limit 8191)" in run.output, run.output
    assert len(run.model_requests()) == 1


def test_codex_on_the_demo_model_reports_the_context_window(demo_target: Target) -> None:
    run = run_codex(target=demo_target, timeout=180)
    assert run.returncode == 1, run.output
    assert "ran out of room in the model's context window" in run.output, run.output
    assert len(run.model_requests()) == 1
