"""The prefix cache through the engine (SES-*): shared prefixes, copies, scoping, adoption, bounds."""

from __future__ import annotations

import asyncio

import pytest

from mlxhost.engine import Delta, Done, LaneSettings, Message, Started
from tests.engine.conftest import collect, lane_idle, next_event, request, spec

TURN_1 = (Message("user", "hi"),)
TURN_2 = (*TURN_1, Message("assistant", "Hello"), Message("user", "and more?"))
TURN_1_PROMPT = len("<user>hi<assistant>")  # 19 fake tokens, all of them prefix TURN_2's prompt
TURN_2_PROMPT = len("<user>hi<assistant>Hello<user>and more?<assistant>")


def query(engine, tenant: str = "t1", salt: str = "s1", **kwargs):
    return engine.scoper.query(tenant=tenant, salt=salt, **kwargs)


def sessions(engine, instance_id: int = 1) -> dict:
    snap = next(s for s in engine.snapshot() if s["instance_id"] == instance_id)
    return snap["prefix_cache"]["memory"]  # type: ignore[return-value]


async def turn(engine, request_id: str, messages, session, *, model=None, **sampling):
    """Submit one turn, read it to the end, wait until its slot (and session) settled."""
    generation = await engine.submit(
        request(request_id, messages=messages, session=session, spec_=model or spec(1), **sampling)
    )
    events = await asyncio.wait_for(collect(generation), 5)
    await lane_idle(engine, generation.instance_id)
    return generation, events


async def first_turn(engine, backend, request_id: str = "p", **query_kwargs):
    """A clean ("stop") first turn that is adopted as a warm session under `request_id`."""
    backend.enqueue(["Hello"])
    generation, events = await turn(engine, request_id, TURN_1, query(engine, **query_kwargs), max_tokens=50)
    assert events[-1].finish_reason == "stop"
    assert generation.session_outcome == "fresh"
    return generation


def started_of(events) -> Started:
    return next(e for e in events if isinstance(e, Started))


async def test_turn_two_reuses_the_cached_prefix(engine, backend):
    """SES-8: a stateless turn 2 in the same domain reuses turn 1's cache and feeds only the suffix."""
    await first_turn(engine, backend)
    assert sessions(engine)["entries"] == 1
    generation, events = await turn(engine, "c", TURN_2, query(engine), max_tokens=2)
    assert generation.session_outcome == "hit"
    assert generation.cached_tokens == TURN_1_PROMPT
    assert started_of(events) == Started(prompt_tokens=TURN_2_PROMPT, cached_tokens=TURN_1_PROMPT)
    done = events[-1]
    assert isinstance(done, Done)
    assert done.usage.cached_tokens == TURN_1_PROMPT
    assert done.usage.prompt_tokens == TURN_2_PROMPT
    _, fed, _ = backend.history[-1]
    assert len(fed) == TURN_2_PROMPT - TURN_1_PROMPT
    assert "".join(map(chr, fed)) == "Hello<user>and more?<assistant>"
    # The cached start goes along as context, so penalties see the whole prompt (SES-7).
    first_prompt = backend.history[0][1]
    assert backend.contexts[0] == []  # turn 1 started fresh
    assert len(backend.contexts[-1]) == TURN_1_PROMPT
    assert backend.contexts[-1][: len(first_prompt)] == first_prompt
    assert sessions(engine)["hits"] == 1


async def two_continuations_of_p(engine, backend, model):
    """Two turns naming "p", both admitted before either runs; their generations and events."""
    backend.gated = True
    generations = [
        await engine.submit(
            request(
                f"c{i}",
                messages=TURN_2,
                session=query(engine, previous_response_id="p"),
                spec_=model,
                max_tokens=1,
            )
        )
        for i in range(2)
    ]
    backend.gated = False
    backend.gate.set()
    return generations, await asyncio.wait_for(asyncio.gather(*(collect(g) for g in generations)), 5)


async def test_overlapping_continuations_of_one_parent_all_hit(engine, backend):
    """SES-4: two overlapping requests naming the same parent both start from its cached prefix,
    each on its own copy; the parent's entry is neither consumed nor changed. Only a batching
    model overlaps them: one that cannot batch serves one at a time (LANE-1)."""
    model = spec(1, lane=LaneSettings(capacity=2))
    await engine.load(model)
    await first_turn(engine, backend)
    instance = next(i for i in engine.registry.instances() if i.instance_id == 1)
    entry = next(iter(instance.sessions._entries.values()))
    parent_tokens = entry.tokens
    generations, results = await two_continuations_of_p(engine, backend, model)
    assert [g.session_outcome for g in generations] == ["hit", "hit"]
    assert [started_of(events).cached_tokens for events in results] == [TURN_1_PROMPT] * 2
    fed = [len(prompt) for _, prompt, _ in backend.history[1:]]
    assert fed == [TURN_2_PROMPT - TURN_1_PROMPT] * 2
    assert backend.copies == 2
    assert entry.kv.tokens == list(parent_tokens)  # copied from, never written to
    await lane_idle(engine)
    assert sessions(engine)["hits"] == 2


async def test_a_shared_cache_lease_is_single_use_under_overlap(engine, backend):
    """SES-4 / SES-5: a model with one shared mutable cache cannot copy: of two requests naming
    the same parent exactly one hits; the other finds the parent gone (a cold replay, though it
    may start from the first one's entry, which its prompt extends)."""
    backend.shared_cache = True
    model = spec(1, lane=LaneSettings(capacity=2))  # it cannot batch: served one at a time (LANE-1)
    await engine.load(model)
    await first_turn(engine, backend)
    generations, results = await two_continuations_of_p(engine, backend, model)
    assert [g.session_outcome for g in generations] == ["hit", "cold_replay"]
    assert started_of(results[0]).cached_tokens == TURN_1_PROMPT
    assert backend.copies == 0


async def test_eight_users_share_one_system_prompt(engine, backend):
    """Issue 12: eight new conversations behind one system prompt all start from the first
    user's cached turn, at once (a batch), each computing only its own part (exact token counts)."""
    model = spec(1, lane=LaneSettings(capacity=8))
    await engine.load(model)
    system = Message("system", "You are a careful assistant. " * 10)
    backend.enqueue(["Hi"])
    await turn(engine, "u0", (system, Message("user", "first")), query(engine), model=model, max_tokens=5)
    shared = len(f"<system>{system.content}<user>")
    backend.gated = True
    generations = [
        await engine.submit(
            request(
                f"u{i}",
                messages=(system, Message("user", f"question {i}")),
                session=query(engine),
                spec_=model,
                max_tokens=1,
            )
        )
        for i in range(1, 9)
    ]
    assert [g.session_outcome for g in generations] == ["partial"] * 8  # SES-7: a shared prefix
    backend.gated = False
    backend.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*(collect(g) for g in generations)), 5)
    assert [started_of(events).cached_tokens for events in results] == [shared] * 8
    assert [len(prompt) for _, prompt, _ in backend.history[1:]] == [
        len(f"question {i}<assistant>") for i in range(1, 9)
    ]
    await lane_idle(engine)
    stats = sessions(engine)
    assert (stats["hits"], stats["partials"], stats["tokens_saved"]) == (0, 8, 8 * shared)


async def test_two_conversations_each_continue_from_their_own_turn(engine, backend):
    """Two users behind one system prompt: each one's second turn reuses its own first turn,
    not just the shared start."""
    system = Message("system", "Be brief.")
    histories = {}
    for user in ("a", "b"):
        backend.enqueue([f"Hello {user}"])
        messages = (system, Message("user", f"I am {user}"))
        await turn(engine, f"{user}1", messages, query(engine), max_tokens=50)
        histories[user] = (*messages, Message("assistant", f"Hello {user}"), Message("user", "again"))
    for user in ("a", "b"):
        generation, events = await turn(engine, f"{user}2", histories[user], query(engine), max_tokens=1)
        assert generation.session_outcome == "hit"
        own = len(f"<system>Be brief.<user>I am {user}<assistant>")
        assert started_of(events).cached_tokens == own


async def test_salt_and_tenant_scope_the_cache(engine, backend):
    """SES-3: another salt or tenant misses (cold replay, full prompt fed); the same salt and tenant hits."""
    await first_turn(engine, backend, tenant="t1", salt="s1")
    # Each miss is kept in its own domain (SES-1), never in "p"'s.
    for tenant, salt in (("t1", "s2"), ("t2", "s1")):
        generation, events = await turn(
            engine,
            f"{tenant}-{salt}",
            TURN_2,
            query(engine, tenant, salt, previous_response_id="p"),
            max_tokens=1,
        )
        assert generation.session_outcome == "cold_replay"
        assert started_of(events).cached_tokens == 0
        assert len(backend.history[-1][1]) == TURN_2_PROMPT
    assert sessions(engine)["entries"] == 3
    # A domain with no session of its own: three sessions share the prefix, none is reused (SES-8).
    generation, events = await turn(engine, "t3-stateless", TURN_2, query(engine, "t3", "s1"), max_tokens=1)
    assert generation.session_outcome == "fresh"
    assert started_of(events).cached_tokens == 0

    generation, events = await turn(
        engine, "same", TURN_2, query(engine, previous_response_id="p"), max_tokens=1
    )
    assert generation.session_outcome == "hit"
    assert started_of(events).cached_tokens == TURN_1_PROMPT
    assert len(backend.history[-1][1]) == TURN_2_PROMPT - TURN_1_PROMPT


async def test_a_cancelled_turn_is_kept_up_to_the_tokens_it_produced(engine, backend):
    """SES-1 / LANE-6: a cancelled turn's cache is kept, holding its prompt and what it produced
    before the cancel (issue 12: a client that stops early still leaves its prefix)."""
    await engine.load(spec(1))
    backend.gated = True
    generation = await engine.submit(request("c", messages=TURN_1, session=query(engine), max_tokens=10_000))
    stream = generation.stream()
    assert isinstance(await next_event(stream), Started)
    backend.gate.set()
    assert isinstance(await next_event(stream), Delta)
    assert engine.cancel("c") is True
    backend.gated = False
    backend.gate.set()
    events = [event async for event in stream]
    assert events[-1].finish_reason == "cancelled"
    await lane_idle(engine)
    assert sessions(engine)["entries"] == 1
    assert backend.dispose_calls == 0

    follow_up, events = await turn(engine, "n", TURN_2, query(engine, previous_response_id="c"), max_tokens=1)
    assert follow_up.session_outcome == "hit"
    assert started_of(events).cached_tokens == TURN_1_PROMPT  # the prompt; the reply text differs


async def test_an_aborted_turn_is_never_kept(engine, backend):
    """SES-1 / LANE-7: a turn the server cut short (a drain ran out of time) leaves no session."""
    await engine.load(spec(1))
    backend.gated = True
    generation = await engine.submit(request("a", messages=TURN_1, session=query(engine), max_tokens=10_000))
    stream = generation.stream()
    assert isinstance(await next_event(stream), Started)
    drain = asyncio.create_task(engine.drain(1, "abort"))
    backend.gated = False
    backend.gate.set()
    events = [event async for event in stream]
    assert events[-1].finish_reason == "aborted"
    await drain
    assert sessions(engine)["entries"] == 0


async def test_a_turn_cut_by_length_is_reused(engine, backend):
    """SES-1 (issue 12): a turn that ends with "length" is kept; the next turn starts from it."""
    _generation, events = await turn(engine, "t", TURN_1, query(engine), max_tokens=2)
    assert events[-1].finish_reason == "length"
    assert sessions(engine)["entries"] == 1
    assert backend.dispose_calls == 0

    follow_up, events = await turn(engine, "n", TURN_2, query(engine, previous_response_id="t"), max_tokens=1)
    assert follow_up.session_outcome == "hit"
    assert started_of(events).cached_tokens == TURN_1_PROMPT


@pytest.mark.parametrize(("shared", "kept"), [(True, 1), (False, 2)])
async def test_a_shared_cache_model_keeps_one_warm_session(engine, backend, shared: bool, kept: int):
    """SES-5: a single-stream (shared-cache) model keeps at most one warm session; a batching one keeps more."""
    backend.shared_cache = shared
    await engine.load(spec(1))
    await first_turn(engine, backend, "a", tenant="t1")
    await first_turn(engine, backend, "b", tenant="t2")  # another domain: no prefix reuse between them
    assert sessions(engine)["entries"] == kept
    assert backend.dispose_calls == 2 - kept  # the evicted one was disposed

    # The most recent session survives in both cases; the older one only on a batching model.
    newest, _ = await turn(engine, "nb", TURN_2, query(engine, "t2", previous_response_id="b"), max_tokens=1)
    assert newest.session_outcome == "hit"
    oldest, _ = await turn(engine, "na", TURN_2, query(engine, "t1", previous_response_id="a"), max_tokens=1)
    assert oldest.session_outcome == ("cold_replay" if shared else "hit")


async def test_expired_sessions_are_swept_and_disposed(make_engine, backend, fake_clock):
    """SES-1 / SES-6: a warm session past its TTL is disposed by engine.sweep() and no longer hits."""
    engine = make_engine(clock=fake_clock, session_ttl_s=10.0)
    await first_turn(engine, backend)
    assert engine.sweep() == 0
    fake_clock.advance(9.9)
    assert engine.sweep() == 0
    assert sessions(engine)["entries"] == 1
    fake_clock.advance(0.2)
    assert engine.sweep() == 1
    assert sessions(engine)["entries"] == 0
    assert backend.dispose_calls == 1
    assert engine.sweep() == 0

    follow_up, events = await turn(engine, "n", TURN_2, query(engine, previous_response_id="p"), max_tokens=1)
    assert follow_up.session_outcome == "cold_replay"
    assert started_of(events).cached_tokens == 0


async def test_a_continuation_queued_behind_its_parent_hits(engine, backend):
    """SES-1 / SES-2: a turn waiting behind its parent gets the parent's warm session once it starts."""
    await engine.load(spec(1))
    backend.gated = True
    backend.enqueue(["Hello"])
    parent = await engine.submit(request("p", messages=TURN_1, session=query(engine), max_tokens=50))
    child = await engine.submit(
        request("c", messages=TURN_2, session=query(engine, previous_response_id="p"), max_tokens=1)
    )
    backend.gated = False
    backend.gate.set()
    parent_events, child_events = await asyncio.wait_for(asyncio.gather(collect(parent), collect(child)), 5)
    assert parent_events[-1].finish_reason == "stop"
    assert child.session_outcome == "hit"
    assert started_of(child_events).cached_tokens == TURN_1_PROMPT
