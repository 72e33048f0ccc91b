"""`continue_final`: a last assistant message the answer continues (an Anthropic prefill)."""

from __future__ import annotations

from dataclasses import replace

from mlxhost.engine import Delta, Done, Message
from tests.engine.conftest import collect, request

PREFILLED = (Message(role="user", content="hi"), Message(role="assistant", content="Sure, "))


def prompt_text(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)  # the fake backend's tokens are the prompt's characters


async def test_the_last_assistant_message_is_left_open_and_the_answer_only_continues_it(engine, backend):
    backend.enqueue(["here", " it is"])
    events = await collect(await engine.submit(replace(request(messages=PREFILLED), continue_final=True)))
    [(_, prompt_ids, _)] = backend.history
    assert prompt_text(prompt_ids) == "<user>hi<assistant>Sure, "  # no generation prompt after it
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "here it is"
    assert isinstance(events[-1], Done)


async def test_without_it_the_same_messages_get_a_generation_prompt(engine, backend):
    backend.enqueue(["x"])
    await collect(await engine.submit(request(messages=PREFILLED)))
    [(_, prompt_ids, _)] = backend.history
    assert prompt_text(prompt_ids) == "<user>hi<assistant>Sure, <assistant>"


async def test_count_tokens_renders_it_the_same_way(engine):
    prefilled = replace(request(messages=PREFILLED), continue_final=True)
    assert await engine.count_tokens(prefilled) == len("<user>hi<assistant>Sure, ")
