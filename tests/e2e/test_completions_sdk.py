"""End to end: the official `openai` SDK's legacy `completions.create` against a real daphne process."""

from __future__ import annotations

import openai
import pytest

pytestmark = [pytest.mark.django_db(transaction=True)]

PROMPT = "Once upon a time"


@pytest.fixture
def client(daphne_server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daphne_server.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def test_sdk_creates_a_text_completion(client, tiny_alias, tiny_eos_id):
    """API-1: `completions.create` parses our `text_completion` object."""
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, logit_bias={str(tiny_eos_id): -100}
    )
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    [choice] = completion.choices
    assert choice.finish_reason == "length"
    assert choice.text
    assert completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8


def test_sdk_streams_a_text_completion_with_the_same_greedy_text(client, tiny_alias, tiny_eos_id):
    """API-1: streamed chunks, `include_usage`, then [DONE]; text equals the non-streamed one."""
    kwargs = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "logit_bias": {str(tiny_eos_id): -100},
    }
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].usage.completion_tokens == 10


def test_sdk_raises_typed_errors(client, tiny_alias):
    """API-4: unsupported options are BadRequestError with `param`; unknown models NotFoundError."""
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=PROMPT, echo=True)
    assert bad.value.body["param"] == "echo"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT)
