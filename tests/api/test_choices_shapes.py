"""The encoders of a request's choices (OpenAI `n`), on scripted events: indices, interleaving,
the usage of them all, and the error of a choice that failed (pure: no model, no database)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from api.openai.chat import ChatTurn, chat_complete, chat_sse
from api.openai.completions import completion_collect, completion_sse
from mlxhost.engine import Delta, Done, Failed, SamplingParams, Started, Timings, Usage
from tests.api.support import ScriptedGeneration

TIMINGS = Timings(0.0, 0.0, 0.0, 0.0)


def choice(*events, logprobs: int | None = None) -> ScriptedGeneration:
    generation = ScriptedGeneration(*events)
    generation.request = SimpleNamespace(  # type: ignore[attr-defined]
        sampling=SamplingParams(logprobs=logprobs), tools=(), tool_choice=None
    )
    return generation


def ended(prompt: int, output: int, cached: int = 0, finish: str = "length") -> Done:
    return Done(finish_reason=finish, usage=Usage(prompt, output, cached), timings=TIMINGS)  # type: ignore[arg-type]


def payloads(frames: list[bytes]) -> list:
    texts = [frame.decode().removeprefix("data: ").strip() for frame in frames]
    return [text if text == "[DONE]" else json.loads(text) for text in texts]


def shape(include_usage: bool = True) -> ChatTurn:
    return ChatTurn(id="chatcmpl-x", model="tiny", instance_id=1, include_usage=include_usage)


def two_choices():
    return [
        choice(Started(prompt_tokens=9), Delta(text="a"), Delta(text="b"), ended(9, 2, cached=4)),
        choice(Started(prompt_tokens=9), Delta(text="c"), ended(9, 1, cached=8, finish="stop")),
    ]


async def test_chat_choices_are_indexed_and_their_usage_counts_the_prompt_once():
    body = await chat_complete(shape(), two_choices())
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ab", "length"),
        (1, "c", "stop"),
    ]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (9, 3, 12)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}  # as the first choice found it


async def test_streamed_chat_choices_each_open_and_finish_then_one_usage_then_done():
    frames = payloads([frame async for frame in chat_sse(shape(), two_choices())])
    assert frames[-1] == "[DONE]"
    *chunks, usage = frames[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["prompt_tokens"] == 9
    per_index: dict[int, list] = {0: [], 1: []}
    for chunk in chunks:
        [part] = chunk["choices"]
        per_index[part["index"]].append(part)
    assert [p["delta"] for p in per_index[0]] == [
        {"role": "assistant", "content": ""},
        {"content": "a"},
        {"content": "b"},
        {},
    ]
    assert [p["finish_reason"] for p in per_index[1]] == [None, None, "stop"]


async def test_a_failed_choice_ends_the_stream_with_its_error_and_no_usage():
    generations = [
        choice(Started(prompt_tokens=9), Delta(text="a"), ended(9, 1)),
        choice(Started(prompt_tokens=9), Failed(code="generation_failed", message="boom")),
    ]
    frames = payloads([frame async for frame in chat_sse(shape(), generations)])
    assert frames[-1] == "[DONE]"
    assert frames[-2]["error"]["code"] == "generation_failed"
    assert not any(isinstance(f, dict) and f.get("usage") for f in frames)
    assert all(g.cancels == 1 for g in generations)  # every choice is cancelled at the end (a no-op)


async def test_text_completion_choices_are_indexed_streamed_and_not():
    body = await completion_collect(shape(), two_choices())
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "ab"), (1, "c")]
    assert body["usage"]["completion_tokens"] == 3
    frames = payloads([frame async for frame in completion_sse(shape(), two_choices())])
    texts = {0: "", 1: ""}
    for frame in frames[:-2]:
        [part] = frame["choices"]
        texts[part["index"]] += part["text"]
    assert texts == {0: "ab", 1: "c"}
    assert frames[-2]["usage"]["completion_tokens"] == 3
