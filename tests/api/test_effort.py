"""Reasoning effort on every chat surface reaches the chat template (API-9)."""

from __future__ import annotations

import pytest

from models_app.catalogue import specs
from tests.api.support import bearer, post_json

pytestmark = [pytest.mark.django_db(transaction=True)]

ANTHROPIC = {"anthropic-version": "2023-06-01"}


def surfaces(api_key: str, effort: str) -> list[tuple[str, dict, dict]]:
    hi = [{"role": "user", "content": "hi"}]
    anthropic = {"x-api-key": api_key, **ANTHROPIC}
    return [
        ("/v1/chat/completions", {"messages": hi, "reasoning_effort": effort}, bearer(api_key)),
        (
            "/v1/responses",
            {"input": "hi", "reasoning": {"effort": effort, "summary": "auto"}},
            bearer(api_key),
        ),
        (
            "/v1/messages",
            {
                "messages": hi,
                "max_tokens": 4,
                "thinking": {"type": "adaptive"},
                "output_config": {"effort": effort},
            },
            anthropic,
        ),
    ]


@pytest.fixture
def template_calls(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    original = specs.template_options_for

    def spy(alias, **kwargs):
        calls.append(kwargs)
        return original(alias, **kwargs)

    monkeypatch.setattr(specs, "template_options_for", spy)
    return calls


async def test_each_surface_passes_its_effort_to_the_template(
    tiny_alias, api_key, mlx_engine, template_calls
):
    for path, body, headers in surfaces(api_key, "low"):
        response = await post_json(path, {"model": "tiny", "max_tokens": 4, **body}, headers)
        assert response.status_code == 200, (path, response.content)
    assert [call["effort"] for call in template_calls] == ["low", "low", "low"]
    # Anthropic's adaptive thinking leaves the switch to the effort; OpenAI's surfaces never set it.
    assert [call["thinking"] for call in template_calls] == [None, None, None]


async def test_anthropic_thinking_without_effort_still_switches(
    tiny_alias, api_key, mlx_engine, template_calls
):
    headers = {"x-api-key": api_key, **ANTHROPIC}
    hi = [{"role": "user", "content": "hi"}]
    for thinking, expected in (({"type": "adaptive"}, True), ({"type": "disabled"}, False), (None, None)):
        body = {"model": "tiny", "max_tokens": 4, "messages": hi, "thinking": thinking}
        assert (await post_json("/v1/messages", body, headers)).status_code == 200
        assert template_calls[-1] == {"thinking": expected, "effort": None}


async def test_an_unknown_effort_is_a_400_naming_the_field(tiny_alias, api_key, mlx_engine):
    expected = {
        "/v1/chat/completions": "reasoning_effort",
        "/v1/responses": "reasoning",
        "/v1/messages": "output_config",
    }
    for path, body, headers in surfaces(api_key, "extreme"):
        response = await post_json(path, {"model": "tiny", "max_tokens": 4, **body}, headers)
        assert response.status_code == 400, path
        assert expected[path] in response.content.decode(), response.content
