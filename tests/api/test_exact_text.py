"""Issue 25: a continuation (completions, Anthropic prefill) loses or adds no character, and the
logprob tokens join to the text, streamed and not, on both schedulers, with the tiny real model."""

from __future__ import annotations

import pytest

from tests.api.support import bearer, post_json, set_lane, sse_events, sse_payloads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

PROMPT = "1, 2, 3,"  # the repro: the tiny model answers " could could ..."
PREFILL = "The baker"
SCHEDULERS = [pytest.param(1, id="exclusive"), pytest.param(2, id="batched")]


@pytest.fixture(scope="module")
def greedy(tiny_model_dir):
    """`continuation(prompt_ids, n)`: the text the tiny model's greedy output ids add to the
    prompt's decoding (the `tokenizers` decoder, no streaming detokenizer): what a reply must be."""
    from tokenizers import Tokenizer

    from mlxhost.engine import Message, ModelSpec, SamplingParams
    from mlxhost.engine.backends.base import StepEnd
    from mlxhost.engine.backends.mlx.backend import MlxBackend

    model = MlxBackend().load(ModelSpec(1, str(tiny_model_dir), "f" * 64), lambda *_: None)
    decoder = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))

    def continuation(prompt_ids: list[int], n: int, bias: tuple[tuple[int, float], ...] = ()) -> str:
        sampling = SamplingParams(temperature=0.0, max_tokens=n, logit_bias=bias)
        steps = model.generate(prompt_ids, sampling, model.new_cache())
        out = [step.token_id for step in steps if not isinstance(step, StepEnd)]
        whole = decoder.decode(prompt_ids + out, skip_special_tokens=False)
        head = decoder.decode(prompt_ids, skip_special_tokens=False)
        assert whole.startswith(head)
        return whole[len(head) :]

    continuation.encode = model.encode  # type: ignore[attr-defined]
    continuation.prefilled = lambda messages: model.render_chat(  # type: ignore[attr-defined]
        [Message(role=m["role"], content=m["content"]) for m in messages], continue_final=True
    )
    yield continuation
    model.close()


@pytest.mark.parametrize("capacity", SCHEDULERS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("echo", [None, False], ids=["no-echo", "echo-false"])
async def test_a_completion_continues_the_prompt_exactly(
    tiny_alias, api_key, mlx_engine, greedy, tiny_eos_id, capacity, stream, echo
):
    """`{"prompt":"1, 2, 3,","max_tokens":4,"temperature":0,"logprobs":1}` answered "could ..."
    with tokens [" could", ...]: `prompt + text` was not the decoded ids, and the tokens did
    not join to the text."""
    await set_lane(tiny_alias, concurrency=capacity)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    body |= {"logit_bias": {str(tiny_eos_id): -100}, "stream": stream}
    if echo is not None:
        body["echo"] = echo
    response = await post_json("/v1/completions", body, bearer(api_key))
    assert response.status_code == 200, response.content
    if stream:
        chunks = [c for c in await sse_payloads(response) if c != "[DONE]"]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        tokens = [t for c in chunks if (lp := c["choices"][0]["logprobs"]) for t in lp["tokens"]]
        offsets = [o for c in chunks if (lp := c["choices"][0]["logprobs"]) for o in lp["text_offset"]]
    else:
        choice = response.json()["choices"][0]
        text, tokens, offsets = (
            choice["text"],
            choice["logprobs"]["tokens"],
            choice["logprobs"]["text_offset"],
        )
    expected = greedy(greedy.encode(PROMPT), 4, ((tiny_eos_id, -100.0),))
    assert expected.startswith(" ")  # the space the old detokenizer dropped
    assert PROMPT + text == PROMPT + expected
    assert "".join(tokens) == text
    assert len(tokens) == 4
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


@pytest.mark.parametrize("capacity", SCHEDULERS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_anthropic_prefill_is_continued_exactly(
    tiny_alias, api_key, mlx_engine, greedy, capacity, stream
):
    """Anthropic answers " Paris." after the prefill "The capital of France is": the space stays."""
    await set_lane(tiny_alias, concurrency=capacity)
    messages = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": PREFILL}]
    body = {"model": "tiny", "max_tokens": 6, "messages": messages, "stream": stream}
    headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
    response = await post_json("/v1/messages", body, headers)
    assert response.status_code == 200, response.content
    if stream:
        events = await sse_events(response)
        text = "".join(d["delta"]["text"] for name, d in events if name == "content_block_delta")
    else:
        text = response.json()["content"][0]["text"]
    expected = greedy(greedy.prefilled(messages), 6)
    assert expected.startswith(" ")
    assert text == expected
