"""Context limits in each provider's words, and keep-alives while a long prompt is prefilled (API-12)."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.api.support import bearer, connect, frames_until, key_headers, post_json, ws_create

pytestmark = [pytest.mark.django_db(transaction=True)]

HELLO = [{"role": "user", "content": "Hello there, how are you today?"}]


@pytest.fixture
async def small_input(tiny_alias):
    tiny_alias.max_input_tokens = 5
    await tiny_alias.asave()
    return tiny_alias


async def test_a_prompt_over_the_limit_is_openais_context_length_exceeded(small_input, api_key, mlx_engine):
    """What Codex compacts on: code `context_length_exceeded`, OpenAI's wording, on chat, text
    completions and Responses, with `param` naming the field that holds the prompt (issue 25)."""
    for path, body in (
        ("/v1/chat/completions", {"messages": HELLO}),
        ("/v1/responses", {"input": "Hello there, how are you today?"}),
        ("/v1/completions", {"prompt": "Hello there, how are you today?"}),
    ):
        response = await post_json(path, {"model": "tiny", **body}, bearer(api_key))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
        assert error["param"] == next(iter(body))
        assert re.fullmatch(
            r"This model's maximum context length is 5 tokens\. However, your messages resulted in \d+ "
            r"tokens\. Please reduce the length of the messages\.",
            error["message"],
        )


async def test_a_prompt_over_the_limit_names_input_on_the_websocket(small_input, api_key, mlx_engine):
    """API-3, API-12: the socket's error frame is the HTTP answer's, `param` included."""
    socket = await connect(key_headers(api_key))
    await ws_create(socket, input="Hello there, how are you today?", store=False)
    [frame] = await frames_until(socket, "error")
    assert frame["status"] == 400
    assert (frame["error"]["code"], frame["error"]["param"]) == ("context_length_exceeded", "input")
    await socket.disconnect()


async def test_a_prompt_over_the_limit_is_anthropics_prompt_is_too_long(small_input, api_key, mlx_engine):
    """What Claude Code compacts on: Anthropic's exact `prompt is too long: N tokens > M maximum`,
    with N the count `count_tokens` gives for the same request."""
    headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
    body = {"model": "tiny", "max_tokens": 8, "messages": HELLO}
    response = await post_json("/v1/messages", body, headers)
    assert response.status_code == 400
    assert response.json()["type"] == "error"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    counted = (await post_json("/v1/messages/count_tokens", body, headers)).json()["input_tokens"]
    assert error["message"] == f"prompt is too long: {counted} tokens > 5 maximum"


async def test_keepalives_flow_while_the_stream_is_idle_and_stop_when_it_ends():
    """While no frame comes (a long prefill), the beat goes out every interval; frames pass through
    in order, and the end of the stream ends it."""
    from api.sse import with_keepalive

    release = asyncio.Event()

    async def frames():
        yield b"first"
        await release.wait()  # a long prefill: nothing to send
        yield b"second"

    stream = with_keepalive(frames(), b": beat\n\n", 0.01)
    seen = [await anext(stream)]
    while seen.count(b": beat\n\n") < 3:
        seen.append(await anext(stream))
    release.set()
    rest = [frame async for frame in stream]
    assert seen[0] == b"first" and set(seen[1:]) == {b": beat\n\n"}
    assert rest[-1] == b"second" and set(rest[:-1]) <= {b": beat\n\n"}


async def test_closing_the_keepalive_stream_closes_the_source():
    """A client that hangs up mid-prefill closes the source generator (which cancels the turn)."""
    from api.sse import with_keepalive

    closed = asyncio.Event()

    async def frames():
        try:
            yield b"first"
            await asyncio.Event().wait()
        finally:
            closed.set()

    stream = with_keepalive(frames(), b": beat\n\n", 0.01)
    assert await anext(stream) == b"first"
    assert await anext(stream) == b": beat\n\n"
    await stream.aclose()
    assert closed.is_set()


async def test_an_anthropic_stream_pings_while_the_prompt_is_prefilled(
    tiny_alias, api_key, mlx_engine, settings
):
    """Claude Code's long first prompt: `ping` events flow before the first token (issue 17)."""
    settings.MLXHOST_SSE_KEEPALIVE_S = 0.001
    headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
    long_prompt = [{"role": "user", "content": "The baker opened his shop. " * 400}]
    response = await post_json(
        "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": long_prompt, "stream": True}, headers
    )
    frames = [chunk async for chunk in response.streaming_content]
    names = [f.split(b"\n", 1)[0] for f in frames]
    prefill = names[names.index(b"event: message_start") + 1 : names.index(b"event: content_block_start")]
    assert prefill and set(prefill) == {b"event: ping"}  # keep-alives, before any content
    assert names[-1] == b"event: message_stop"


async def test_claude_codes_mid_conversation_system_message_and_extras_are_accepted(
    tiny_alias, api_key, mlx_engine
):
    """Issue 17: a system-role message among `messages`, `?beta=true`, Claude Code's betas,
    `context_management`, `output_config.effort`, adaptive thinking and metadata are all accepted."""
    headers = {
        "x-api-key": api_key,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
        "mid-conversation-system-2026-04-07,effort-2025-11-24",
    }
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "system": [
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "system", "content": "Reminder: be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "go", "cache_control": {"type": "ephemeral"}}],
            },
        ],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc"},
    }
    response = await post_json("/v1/messages?beta=true", body, headers)
    assert response.status_code == 200, response.content
    counted = await post_json("/v1/messages/count_tokens?beta=true", body, headers)
    without = await post_json(
        "/v1/messages/count_tokens", {**body, "messages": [body["messages"][0]]}, headers
    )
    assert counted.json()["input_tokens"] > without.json()["input_tokens"]  # the reminder is in the prompt


def _fixture(name: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parents[1] / "fixtures" / "agents" / name).read_text())


async def test_claude_codes_captured_first_request_is_accepted_and_measured(tiny_alias, api_key, mlx_engine):
    """Issue 17: Claude Code's real first request (tests/fixtures/agents) passes validation, renders
    with its 24 tools and mid-conversation system message, and is counted; over the alias's input
    limit it gets Anthropic's exact "prompt is too long", which Claude Code reports (it does not
    compact a first turn). Prefilling its ~45k tiny-model tokens would take minutes, so the limit
    stops it first."""
    captured = _fixture("claude_code_first_request.json")
    body = {**captured["body"], "model": "tiny"}
    headers = {
        "x-api-key": api_key,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": captured["anthropic_beta"],
    }
    path = f"{captured['path']}?{captured['query']}"
    tiny_alias.max_input_tokens = 1000  # count_tokens is not held to it; a generation is
    await tiny_alias.asave()
    counted = await post_json("/v1/messages/count_tokens?beta=true", body, headers)
    assert counted.status_code == 200, counted.content[:500]
    tokens = counted.json()["input_tokens"]
    response = await post_json(path, body, headers)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"prompt is too long: {tokens} tokens > 1000 maximum"


async def test_codexs_captured_first_request_is_accepted_and_measured(tiny_alias, api_key, mlx_engine):
    """Issue 17: Codex's real first request (developer messages, function and namespace tools, a
    hosted web_search, reasoning, include, client_metadata, store false) passes validation and
    rendering; over the input limit it is OpenAI's `context_length_exceeded`."""
    captured = _fixture("codex_first_request.json")
    tiny_alias.max_input_tokens = 1000
    await tiny_alias.asave()
    response = await post_json(captured["path"], {**captured["body"], "model": "tiny"}, bearer(api_key))
    assert response.status_code == 400, response.content[:500]
    assert response.json()["error"]["code"] == "context_length_exceeded"


NAMESPACE = {
    "type": "namespace",
    "name": "agents",
    "description": "Sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "wait_agent",
            "description": "Wait.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"id": {"type": "string", "maxLength": 8}},
                "required": ["id"],
            },
        }
    ],
}


async def test_namespace_tools_and_hosted_tools_as_codex_expects(tiny_alias, api_key, mlx_engine):
    """A namespaced function is offered as `agents__wait_agent`; its call comes back with the bare
    name and `namespace`, and such a call in the input renders back. web_search is left out and
    named in X-Tools-Ignored."""
    tools = [NAMESPACE, {"type": "web_search", "external_web_access": False}]
    choice = {"type": "function", "name": "agents__wait_agent"}
    response = await post_json(
        "/v1/responses",
        {"model": "tiny", "input": "wait", "tools": tools, "tool_choice": choice, "max_output_tokens": 40},
        bearer(api_key),
    )
    assert response.status_code == 200, response.content
    assert response["X-Tools-Ignored"] == "web_search"
    (item,) = response.json()["output"]
    assert (item["type"], item["namespace"], item["name"]) == ("function_call", "agents", "wait_agent")
    echoed = {**item}  # Codex sends the call back as it got it, then the output
    result = {"type": "function_call_output", "call_id": item["call_id"], "output": "done"}
    again = await post_json(
        "/v1/responses",
        {
            "model": "tiny",
            "input": [{"role": "user", "content": "wait"}, echoed, result],
            "tools": tools,
            "max_output_tokens": 4,
            "store": False,
        },
        bearer(api_key),
    )
    assert again.status_code == 200, again.content
