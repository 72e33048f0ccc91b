"""Bounded work before admission (issue 25): a prompt too long in characters is refused before it
is rendered or tokenized, and renders and tokenizations run a few at a time, on every path."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlxhost.engine import (
    EmbeddingRequest,
    GenerationRequest,
    InvalidRequestError,
    LaneSettings,
    Message,
    PromptTooLongError,
    SamplingParams,
)
from mlxhost.engine.tokenizing import nonspace_characters
from tests.engine.conftest import collect, request, spec, until

HUGE = "x" * (4 << 20)  # a 4 MiB prompt
CONTEXT = 100


def raw(request_id: str, text: str) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, binding="raw", sampling=SamplingParams(), prompt=text)


def embedding(request_id: str, *texts: str | tuple[int, ...], **fields) -> EmbeddingRequest:
    return EmbeddingRequest(request_id=request_id, binding="embedder", texts=texts, **fields)


def embedding_spec():
    return spec(2, kind="embedding", lane=LaneSettings(capacity=8, queue_depth=16))


async def test_a_prompt_too_long_in_characters_is_refused_without_tokenizing(engine, backend):
    """Chat, raw completions and count_tokens refuse a 4 MiB prompt for a 100-token context
    before any template or tokenizer runs: context_length_exceeded with the fewest tokens its
    characters can be (the fake's tokens cover one character each)."""
    backend.context_length = CONTEXT
    engine.bind("raw", spec())
    attempts = (
        engine.submit(request("chat", text=HUGE)),
        engine.count_tokens(request("count", text=HUGE)),
        engine.submit(raw("completion", HUGE)),
        engine.count_tokens(raw("raw-count", HUGE)),
    )
    for attempt in attempts:
        with pytest.raises(PromptTooLongError) as caught:
            await attempt
        assert caught.value.at_least
        assert caught.value.prompt_tokens == len(HUGE)
        assert "at least 4194304 tokens" in str(caught.value)
    assert caught.value.limit == CONTEXT - 1  # the context less one token for the answer
    assert (backend.render_calls, backend.encode_calls) == (0, 0)


async def test_a_prompt_within_the_character_bound_is_counted_by_its_tokens(engine, backend):
    """The bound never refuses what may fit: a message of exactly as many characters as the
    limit is rendered, and then refused by its exact token count (the template adds tokens)."""
    backend.context_length = CONTEXT
    with pytest.raises(PromptTooLongError) as caught:
        await engine.submit(request("chat", text="y" * (CONTEXT - 1)))
    assert not caught.value.at_least
    assert caught.value.prompt_tokens == len(f"<user>{'y' * (CONTEXT - 1)}<assistant>")
    assert backend.render_calls == 1
    short = await engine.submit(request("short", text="y" * 10, max_tokens=2))
    await collect(short)


async def test_the_alias_input_limit_lowers_the_character_bound(engine, backend):
    """`max_input_tokens` counts too: 50 characters cannot fit in 20 tokens of one character."""
    with pytest.raises(PromptTooLongError) as caught:
        await engine.submit(request("chat", text="z" * 50, max_input_tokens=20))
    assert caught.value.at_least and caught.value.limit == 20
    assert backend.render_calls == 0


async def test_an_embedding_input_too_long_in_characters_is_refused_without_tokenizing(engine, backend):
    """Embeddings count the characters besides whitespace (an encoder drops whitespace): a 4 MiB
    input is a 400 naming it before the tokenizer runs; one that is mostly spaces is tokenized."""
    engine.bind("embedder", embedding_spec())
    with pytest.raises(InvalidRequestError) as caught:
        await engine.embed(embedding("e1", "fine", HUGE))
    assert caught.value.param == "input[1]"
    assert f"{len(HUGE)} characters besides spaces" in str(caught.value)
    assert backend.tokenize_calls == 0

    spaced = "a" + " " * 10_000 + "b"  # 10,002 characters, two of them not spaces
    assert nonspace_characters(spaced) == 2
    with pytest.raises(InvalidRequestError) as caught:
        await engine.embed(embedding("e2", spaced))
    assert "this input has 10004 tokens" in str(caught.value)  # the fake keeps spaces: counted
    assert backend.tokenize_calls == 1


async def test_token_arrays_over_the_limit_are_refused_before_decoding(engine, backend):
    """A token array longer than the model's per-input limit is a 400 naming it; `decode` never
    runs for it. One that fits is decoded and embedded as its text."""
    engine.bind("embedder", embedding_spec())
    decoded: list[tuple[int, ...]] = []

    def decode(ids) -> str:
        decoded.append(tuple(ids))
        return "".join(chr(ord("a") + i % 26) for i in ids)

    too_long = tuple(range(backend.embedding_max_tokens + 1))
    with pytest.raises(InvalidRequestError) as caught:
        await engine.embed(embedding("e1", "ok", too_long, decode=decode))
    assert caught.value.param == "input[1]"
    assert f"this token array has {len(too_long)} tokens" in str(caught.value)
    assert decoded == [] and backend.tokenize_calls == 0

    result = await engine.embed(embedding("e2", (0, 1, 2), decode=decode))
    assert decoded == [(0, 1, 2)] and result.prompt_tokens == len("abc") + 2

    def refuse(ids) -> str:
        raise ValueError("not an id of this encoding.")

    with pytest.raises(InvalidRequestError) as caught:
        await engine.embed(embedding("e3", "ok", (5,), decode=refuse))
    assert caught.value.param == "input[1]" and "not an id of this encoding" in str(caught.value)


async def test_renders_and_tokenizations_run_a_few_at_a_time(make_engine, backend):
    """At most `tokenize_threads` renders or tokenizations run at once, across chat submits,
    count_tokens and embeddings: the others wait in line; a waiter whose caller gives up leaves
    the line without running."""
    engine = make_engine(tokenize_threads=2)
    engine.bind("embedder", embedding_spec())
    release = threading.Event()
    backend.before_render = lambda _messages: release.wait(10)
    wide = spec(1, lane=LaneSettings(capacity=8, queue_depth=16))
    pool = engine.tokenizers
    first = [asyncio.ensure_future(engine.count_tokens(request(f"count-{i}", spec_=wide))) for i in range(2)]
    calls = [
        engine.count_tokens(request("count-2", spec_=wide)),
        *(engine.submit(request(f"chat-{i}", spec_=wide, max_tokens=1)) for i in range(3)),
        *(engine.embed(embedding(f"embed-{i}", "hello")) for i in range(2)),
    ]
    try:
        await until(lambda: pool.running == 2, what="the first two to run")
        tasks = first + [asyncio.ensure_future(call) for call in calls]
        await until(lambda: (pool.running, pool.waiting) == (2, 6), what="2 running and 6 in line")
        tasks[-1].cancel()  # an embedding still in line
        await until(lambda: pool.waiting == 5, what="the cancelled waiter to leave the line")
    finally:
        release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[-1], asyncio.CancelledError)
    for generation in results[3:6]:
        await collect(generation)
    assert pool.peak == 2
    assert backend.render_calls == 6 and backend.tokenize_calls == 1  # the cancelled one never ran
    assert (pool.running, pool.waiting) == (0, 0)


async def test_a_message_list_counts_every_message_and_call(engine, backend):
    """The characters counted are every message's text and its tool calls' names and arguments."""
    backend.context_length = 30
    messages = (Message(role="system", content="s" * 20), Message(role="user", content="u" * 20))
    with pytest.raises(PromptTooLongError) as caught:
        await engine.count_tokens(request("count", messages=messages))
    assert caught.value.prompt_tokens == 40 and caught.value.at_least
    assert backend.render_calls == 0
