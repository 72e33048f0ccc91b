"""The alias's chat-template settings in the admin form (API-9)."""

from __future__ import annotations

import pytest

from models_app.catalogue.specs import template_options_for
from models_app.console.forms import ModelAliasForm

pytestmark = pytest.mark.django_db


def form(alias, **changes) -> ModelAliasForm:
    data = {field: getattr(alias, field) for field in ModelAliasForm.Meta.fields}
    data["model"] = alias.model_id
    data["max_input_tokens"] = data["max_input_tokens"] or ""
    data["repetition_penalty"] = data["repetition_penalty"] or ""
    data["enable_thinking"] = {None: "unknown", True: "true", False: "false"}[data["enable_thinking"]]
    data["chat_template_kwargs"] = "{}"
    return ModelAliasForm({**data, **changes}, instance=alias)


def test_thinking_reads_in_words_and_reaches_the_template(tiny_alias):
    rendered = str(form(tiny_alias)["enable_thinking"])
    assert "The model&#x27;s default" in rendered and ">On<" in rendered and ">Off<" in rendered
    saved = form(tiny_alias, enable_thinking="false", chat_template_kwargs='{"reasoning_effort": "low"}')
    assert saved.is_valid(), saved.errors
    alias = saved.save()
    assert template_options_for(alias) == (("enable_thinking", False), ("reasoning_effort", "low"))
    assert template_options_for(alias, thinking=True)[0] == ("enable_thinking", True)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[1]", "JSON object"),
        ('{"tools": 1}', "sets tools itself"),
        ('{"enable_thinking": true}', "own field"),
    ],
)
def test_template_options_that_the_server_sets_are_refused(tiny_alias, value, message):
    bad = form(tiny_alias, chat_template_kwargs=value)
    assert not bad.is_valid()
    assert message in str(bad.errors["chat_template_kwargs"])


@pytest.mark.parametrize(
    ("thinking", "effort", "expected"),
    [
        (None, "high", {"enable_thinking": True, "reasoning_effort": "high"}),
        (None, "max", {"enable_thinking": True, "reasoning_effort": "high"}),
        (None, "minimal", {"enable_thinking": False, "reasoning_effort": "low"}),
        (None, "none", {"enable_thinking": False}),
        (False, "high", {"enable_thinking": False, "reasoning_effort": "high"}),  # an explicit switch wins
        (None, None, {}),  # neither: the model's default
    ],
)
def test_a_requests_effort_sets_the_thinking_switch_and_reasoning_effort(
    tiny_alias, thinking, effort, expected
):
    """Issue 17: `output_config.effort` / `reasoning.effort` / `reasoning_effort` reach the template."""
    assert dict(template_options_for(tiny_alias, thinking=thinking, effort=effort)) == expected
