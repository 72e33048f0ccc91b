"""The prefix cache: tiers, scoping, shared and single-use leases, bounds and disposal."""

from __future__ import annotations

import logging
from dataclasses import fields

import pytest

from mlxhost.engine.config import EngineConfig, prefix_cache_bytes
from mlxhost.engine.sessions import SessionCache, SessionQuery, SessionScoper, tier_figures
from tests.support import FakeClock

SECRET = b"s" * 32
PROMPT = (1, 2, 3, 4, 5, 6)


class Disposer:
    """Records disposed kvs; fails the first `failures` calls."""

    def __init__(self, failures: int = 0) -> None:
        self.disposed: list[object] = []
        self.calls = 0
        self.failures = failures

    def __call__(self, kv: object) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("metal said no")
        self.disposed.append(kv)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def disposer() -> Disposer:
    return Disposer()


@pytest.fixture
def cache(clock: FakeClock, disposer: Disposer) -> SessionCache:
    return SessionCache(clock=clock, dispose=disposer)


@pytest.fixture
def scoper() -> SessionScoper:
    return SessionScoper(SECRET)


def query(scoper: SessionScoper, **kwargs: object) -> SessionQuery:
    kwargs.setdefault("tenant", "acme")
    kwargs.setdefault("instructions", "be brief")
    return scoper.query(**kwargs)  # type: ignore[arg-type]


def adopt(cache: SessionCache, q: SessionQuery, rid: str, tokens=PROMPT, nbytes: int = 10) -> bool:
    return cache.adopt(response_id=rid, query=q, tokens=tokens, kv=f"kv-{rid}", nbytes=nbytes)


def test_leases_share_the_entry(cache: SessionCache, scoper: SessionScoper, disposer: Disposer) -> None:
    """SES-4: two lookups for the same parent both hit the one entry, which stays cached."""
    adopt(cache, query(scoper), "resp_1")
    follow_up = query(scoper, previous_response_id="resp_1")
    leases = [cache.lease(follow_up, (*PROMPT, 7, 8)) for _ in range(2)]
    for lease, outcome in leases:
        assert outcome == "hit"
        assert lease is not None and lease.tier == "response_id" and lease.reuse_tokens == 6
        assert lease.entry.kv == "kv-resp_1" and not lease.owned
    entry = leases[0][0].entry  # type: ignore[union-attr]
    assert entry.pins == 2 and len(cache) == 1
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.tokens_saved) == (2, 0, 12)
    for lease, _ in leases:
        cache.release(lease, consumed=True)  # type: ignore[arg-type]
    assert entry.pins == 0 and len(cache) == 1 and disposer.disposed == []


def test_a_single_use_lease_takes_the_entry(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-4, SES-5: where the cache cannot be copied, the first lookup takes it; the second runs cold."""
    cache.single_use()
    adopt(cache, query(scoper), "resp_1")
    follow_up = query(scoper, previous_response_id="resp_1")
    lease, outcome = cache.lease(follow_up, (*PROMPT, 7, 8))
    assert outcome == "hit" and lease is not None and lease.owned and lease.reuse_tokens == 6
    assert cache.lease(follow_up, (*PROMPT, 7, 8)) == (None, "cold_replay")
    assert (cache.stats.hits, cache.stats.misses, len(cache)) == (1, 1, 0)


def test_eight_requests_start_from_one_entry(cache: SessionCache, scoper: SessionScoper) -> None:
    """A shared system prompt: eight new conversations all reuse the one cached turn's prefix;
    SES-7: that is a `partial` (the entry's own input went further), never a `hit`."""
    system = tuple(range(300))
    adopt(cache, query(scoper), "resp_1", tokens=(*system, 1000, 1001))
    leases = [cache.lease(query(scoper), (*system, 2000 + i, 7)) for i in range(8)]
    assert [(outcome, lease.reuse_tokens) for lease, outcome in leases if lease] == [("partial", 300)] * 8
    assert len(cache) == 1 and cache.stats.tokens_saved == 8 * 300


def test_same_salt_hits_and_different_salt_misses(scoper: SessionScoper, clock: FakeClock) -> None:
    """SES-3: the same salt hits; a different salt is a cold replay; different instructions fall
    back to the token prefix (the entry is not named, its shared tokens are), which is still a
    cold replay of the named parent (SES-7)."""
    cases = {"same": ("s1", "be brief"), "salt": ("s2", "be brief"), "instr": ("s1", "be verbose")}
    outcomes, tiers = {}, {}
    for name, (salt, instructions) in cases.items():
        cache = SessionCache(clock=clock)
        adopt(cache, query(scoper, salt="s1"), "resp_1")
        q = query(scoper, salt=salt, instructions=instructions, previous_response_id="resp_1")
        outcomes[name] = cache.lease(q, (*PROMPT, 7))[1]
        lease = cache.lease(q, (*PROMPT, 7))[0]
        if lease is not None:
            tiers[name] = lease.tier
    assert outcomes == {"same": "hit", "salt": "cold_replay", "instr": "cold_replay"}
    # Other instructions never name the entry; only the tokens they share can be reused.
    assert tiers == {"same": "response_id", "instr": "prefix"}


def test_cache_key_is_bound_to_tenant(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-3: the same prompt_cache_key under another tenant is a different fingerprint and misses."""
    adopt(cache, query(scoper, tenant="acme", prompt_cache_key="shared"), "resp_1")
    other = query(scoper, tenant="evil", prompt_cache_key="shared")
    assert other.cache_key != query(scoper, tenant="acme", prompt_cache_key="shared").cache_key
    assert cache.lease(other, (*PROMPT, 7)) == (None, "fresh")
    lease, outcome = cache.lease(query(scoper, tenant="acme", prompt_cache_key="shared"), (*PROMPT, 7))
    assert outcome == "hit" and lease is not None and lease.tier == "cache_key"


def test_raw_key_and_salt_are_never_stored(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-3: entries hold HMAC fingerprints only, never the raw prompt_cache_key or salt."""
    raw_key, raw_salt = "my-secret-cache-key", "my-secret-salt"
    adopt(cache, query(scoper, salt=raw_salt, prompt_cache_key=raw_key), "resp_1")
    entry = next(iter(cache._entries.values()))
    dumped = repr(vars(cache)) + repr(entry) + repr([getattr(entry, f.name) for f in fields(entry)])
    assert raw_key not in dumped and raw_salt not in dumped
    assert raw_key not in repr(scoper) and SECRET.decode() not in repr(scoper)


def test_tier1_miss_never_falls_through_to_the_key(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-2: a tier-1 miss takes the longest prefix, never the entry of its cache key; SES-7: the
    parent is not cached, so it is a cold replay, whatever prefix it borrows."""
    adopt(cache, query(scoper, prompt_cache_key="k"), "resp_1", tokens=(9, 9, 9))
    q = query(scoper, previous_response_id="resp_gone", prompt_cache_key="k")
    assert cache.lease(q, (*PROMPT, 7)) == (None, "cold_replay")
    adopt(cache, query(scoper), "resp_2")
    lease, outcome = cache.lease(q, (*PROMPT, 7))
    assert outcome == "cold_replay" and lease is not None
    assert (lease.entry.response_id, lease.tier, lease.reuse_tokens) == ("resp_2", "prefix", 6)


def test_tier2_hits_by_cache_key(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-2: without a previous id, the entry adopted under the cache key is leased."""
    adopt(cache, query(scoper, prompt_cache_key="k"), "resp_1", tokens=(9, 9, 9))
    adopt(cache, query(scoper), "resp_2")  # better prefix, but not keyed
    lease, outcome = cache.lease(query(scoper, prompt_cache_key="k"), (9, 9, 9, 1))
    assert outcome == "hit" and lease is not None
    assert (lease.entry.response_id, lease.tier, lease.reuse_tokens) == ("resp_1", "cache_key", 3)


def test_keyed_lease_without_reusable_prefix_is_fresh(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-2: a keyed entry with no common prefix is a miss; a single-use cache still leases it
    (its kv object is recycled) but reports fresh."""
    adopt(cache, query(scoper, prompt_cache_key="k"), "resp_1", tokens=(9, 9))
    assert cache.lease(query(scoper, prompt_cache_key="k"), (1, 2, 3)) == (None, "fresh")
    cache.single_use()
    lease, outcome = cache.lease(query(scoper, prompt_cache_key="k"), (1, 2, 3))
    assert outcome == "fresh" and lease is not None and lease.reuse_tokens == 0
    assert (cache.stats.hits, cache.stats.misses) == (0, 2)


def test_cache_key_adopt_replaces_older_entry(
    cache: SessionCache, scoper: SessionScoper, disposer: Disposer
) -> None:
    """SES-1: a newer session under the same cache key replaces and disposes the older one."""
    adopt(cache, query(scoper, prompt_cache_key="k"), "resp_1")
    adopt(cache, query(scoper, prompt_cache_key="k"), "resp_2")
    assert len(cache) == 1 and disposer.disposed == ["kv-resp_1"]
    lease, _ = cache.lease(query(scoper, prompt_cache_key="k"), (*PROMPT, 7))
    assert lease is not None and lease.entry.response_id == "resp_2"


def test_warm_any_picks_most_recent_in_domain(
    cache: SessionCache, scoper: SessionScoper, clock: FakeClock
) -> None:
    """SES-2: tier 3 (Anthropic messages) takes the most recently used entry of the same domain."""
    adopt(cache, query(scoper), "resp_old", tokens=(1, 2, 3, 4, 5))
    clock.advance(1)
    adopt(cache, query(scoper), "resp_new", tokens=(1, 2))
    clock.advance(1)
    adopt(cache, query(scoper, tenant="other"), "resp_foreign")
    lease, outcome = cache.lease(query(scoper, warm_any=True), (1, 2, 3, 4, 5, 6))
    assert outcome == "hit" and lease is not None
    assert (lease.entry.response_id, lease.tier, lease.reuse_tokens) == ("resp_new", "warm_any", 2)


def test_prefix_reuse_longest_wins_and_is_capped(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-8: the longest common prefix wins, capped at len(prompt) - 1."""
    adopt(cache, query(scoper), "resp_short", tokens=(1, 2))
    adopt(cache, query(scoper), "resp_long", tokens=(1, 2, 3, 4, 99))
    lease, outcome = cache.lease(query(scoper), (1, 2, 3, 4))
    assert outcome == "hit" and lease is not None
    assert (lease.entry.response_id, lease.tier, lease.reuse_tokens) == ("resp_long", "prefix", 3)


def test_prefix_reuse_on_long_prompts(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-8: the common prefix is exact across chunk boundaries of several-thousand-token prompts."""
    cached = tuple(range(5000))
    adopt(cache, query(scoper), "resp_1", tokens=cached)
    prompt = (*cached[:4321], -1, *cached[4322:])
    lease, _ = cache.lease(query(scoper), prompt)
    assert lease is not None and lease.reuse_tokens == 4321


def test_prefix_reuse_never_crosses_domains(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-8: an identical prompt under another tenant or salt does not reuse the cache."""
    adopt(cache, query(scoper, salt="a"), "resp_1")
    assert cache.lease(query(scoper, salt="b"), (*PROMPT, 7)) == (None, "fresh")
    assert cache.lease(query(scoper, tenant="other", salt="a"), (*PROMPT, 7)) == (None, "fresh")
    assert cache.lease(query(scoper, salt="a"), (*PROMPT, 7))[1] == "hit"


def test_prefix_needs_one_reusable_token(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-8: a one-token prompt can reuse nothing (one token must be fed), so it stays fresh."""
    adopt(cache, query(scoper), "resp_1")
    assert cache.lease(query(scoper), (1,)) == (None, "fresh")
    assert cache.lease(query(scoper), (7, 1, 2)) == (None, "fresh")
    assert len(cache) == 1


def test_ttl_expiry_disposes(
    cache: SessionCache, scoper: SessionScoper, clock: FakeClock, disposer: Disposer
) -> None:
    """SES-1, SES-6: entries expire after the TTL; expired ones are disposed and counted."""
    adopt(cache, query(scoper), "resp_1")
    clock.advance(1799)
    adopt(cache, query(scoper), "resp_2", tokens=(8, 9))
    clock.advance(1)
    q = query(scoper, previous_response_id="resp_1")
    assert cache.lease(q, (*PROMPT, 7)) == (None, "cold_replay")
    assert disposer.disposed == ["kv-resp_1"]
    clock.advance(1800)
    assert cache.sweep() == 1
    stats = cache.stats
    assert (stats.expired, stats.disposed, stats.entries, stats.bytes) == (2, 2, 0, 0)


def test_byte_bound_eviction(clock: FakeClock, disposer: Disposer, scoper: SessionScoper) -> None:
    """SES-1, SES-6: total bytes stay under max_bytes by evicting least recently used entries."""
    cache = SessionCache(max_bytes=100, clock=clock, dispose=disposer)
    for i, nbytes in enumerate((40, 40, 40)):
        clock.advance(1)
        assert adopt(cache, query(scoper), f"resp_{i}", tokens=(i, 1), nbytes=nbytes)
    assert disposer.disposed == ["kv-resp_0"]
    stats = cache.stats
    assert (stats.entries, stats.bytes, stats.evicted, stats.adopted) == (2, 80, 1, 3)


def test_entry_bound_lru_eviction(clock: FakeClock, disposer: Disposer, scoper: SessionScoper) -> None:
    """SES-1, SES-6: the least recently used entry goes first when max_entries is exceeded."""
    cache = SessionCache(max_entries=3, clock=clock, dispose=disposer)
    for i in range(5):
        clock.advance(1)
        adopt(cache, query(scoper), f"resp_{i}", tokens=(i, 1))
    assert disposer.disposed == ["kv-resp_0", "kv-resp_1"]
    assert (len(cache), cache.stats.evicted, cache.stats.disposed) == (3, 2, 2)


def test_single_stream_keeps_one_session(
    cache: SessionCache, scoper: SessionScoper, disposer: Disposer
) -> None:
    """SES-5: a single-use cache keeps at most one entry; switching evicts at once."""
    adopt(cache, query(scoper), "resp_0", tokens=(1, 2))
    adopt(cache, query(scoper), "resp_1", tokens=(3, 4))
    cache.single_use()
    assert len(cache) == 1 and disposer.disposed == ["kv-resp_0"]
    adopt(cache, query(scoper, tenant="other"), "resp_2")
    assert len(cache) == 1 and disposer.disposed == ["kv-resp_0", "kv-resp_1"]


def test_dispose_retried_once(clock: FakeClock, scoper: SessionScoper) -> None:
    """SES-6: a disposal that fails once is retried and succeeds."""
    disposer = Disposer(failures=1)
    cache = SessionCache(clock=clock, dispose=disposer)
    cache.discard("kv")
    stats = cache.stats
    assert (stats.disposed, stats.dispose_retries, stats.dispose_failures) == (1, 1, 0)
    assert disposer.disposed == ["kv"]


def test_dispose_failing_twice_is_counted_not_raised(
    clock: FakeClock, scoper: SessionScoper, caplog: pytest.LogCaptureFixture
) -> None:
    """SES-6: a disposal that fails twice is counted and logged, never raised to the caller."""
    cache = SessionCache(max_entries=1, clock=clock, dispose=Disposer(failures=2))
    adopt(cache, query(scoper), "resp_0")
    with caplog.at_level(logging.WARNING, logger="mlxhost.engine.sessions"):
        assert adopt(cache, query(scoper), "resp_1")  # evicts resp_0: both dispose attempts fail
    stats = cache.stats
    assert (stats.disposed, stats.dispose_retries, stats.dispose_failures, stats.evicted) == (0, 1, 1, 1)
    assert "failed twice" in caplog.text


def test_an_unused_single_use_lease_goes_back(
    cache: SessionCache, scoper: SessionScoper, disposer: Disposer
) -> None:
    """SES-4: a single-use lease cancelled before use is given back unchanged and can be leased again."""
    cache.single_use()
    adopt(cache, query(scoper, prompt_cache_key="k"), "resp_1")
    lease, _ = cache.lease(query(scoper, prompt_cache_key="k"), (*PROMPT, 7))
    assert lease is not None and len(cache) == 0
    cache.release(lease, consumed=False)
    assert len(cache) == 1 and cache.stats.bytes == 10 and disposer.disposed == []
    again, outcome = cache.lease(query(scoper, prompt_cache_key="k"), (*PROMPT, 7))
    assert outcome == "hit" and again is not None and again.entry is lease.entry


def test_give_back_after_expiry_disposes(
    cache: SessionCache, scoper: SessionScoper, clock: FakeClock, disposer: Disposer
) -> None:
    """SES-1: a returned lease keeps the original expiry, so an expired entry is disposed instead."""
    cache.single_use()
    adopt(cache, query(scoper), "resp_1")
    lease, _ = cache.lease(query(scoper, previous_response_id="resp_1"), (*PROMPT, 7))
    assert lease is not None
    clock.advance(1800)
    cache.release(lease, consumed=False)
    assert len(cache) == 0 and disposer.disposed == ["kv-resp_1"] and cache.stats.expired == 1


def test_discard_disposes(cache: SessionCache, disposer: Disposer) -> None:
    """SES-1, SES-6: a kv from an aborted turn is discarded (disposed), never cached."""
    cache.discard("kv-aborted")
    assert disposer.disposed == ["kv-aborted"] and len(cache) == 0 and cache.stats.disposed == 1


def test_oversized_kv_is_not_adopted(clock: FakeClock, disposer: Disposer, scoper: SessionScoper) -> None:
    """SES-1: a kv larger than max_bytes is disposed instead of adopted, and evicts nothing."""
    cache = SessionCache(max_bytes=100, clock=clock, dispose=disposer)
    adopt(cache, query(scoper), "resp_0", nbytes=50)
    assert not adopt(cache, query(scoper), "resp_1", nbytes=101)
    assert len(cache) == 1 and disposer.disposed == ["kv-resp_1"] and cache.stats.adopted == 1


def test_clear_disposes_everything(cache: SessionCache, scoper: SessionScoper, disposer: Disposer) -> None:
    """SES-6: unloading the model disposes every warm session."""
    adopt(cache, query(scoper), "resp_0")
    adopt(cache, query(scoper, prompt_cache_key="k"), "resp_1")
    cache.clear()
    assert len(cache) == 0 and sorted(disposer.disposed) == ["kv-resp_0", "kv-resp_1"]
    assert cache.stats.bytes == 0


def test_an_entry_evicted_while_leased_is_freed_by_its_last_lease(
    clock: FakeClock, disposer: Disposer, scoper: SessionScoper
) -> None:
    """SES-6: eviction never frees a kv a request is still copying from; the last release does."""
    cache = SessionCache(max_entries=1, clock=clock, dispose=disposer)
    adopt(cache, query(scoper), "resp_0", tokens=(1, 2, 3))
    lease, _ = cache.lease(query(scoper), (1, 2, 3, 4))
    assert lease is not None
    adopt(cache, query(scoper), "resp_1", tokens=(7, 8))  # evicts resp_0 while it is leased
    assert [e.response_id for e in cache._entries.values()] == ["resp_1"] and disposer.disposed == []
    cache.release(lease, consumed=True)
    assert disposer.disposed == ["kv-resp_0"]


def test_a_longer_turn_replaces_its_prefix(
    cache: SessionCache, scoper: SessionScoper, disposer: Disposer
) -> None:
    """An entry whose tokens start the new one's is dropped: the new entry serves its prompts too,
    in the same domain only."""
    adopt(cache, query(scoper), "resp_1", tokens=(1, 2, 3))
    adopt(cache, query(scoper, tenant="other"), "resp_x", tokens=(1, 2, 3))
    adopt(cache, query(scoper), "resp_2", tokens=(1, 2, 3, 4, 5))
    assert sorted(cache._entries) == ["resp_2", "resp_x"] and disposer.disposed == ["kv-resp_1"]
    lease, outcome = cache.lease(query(scoper, previous_response_id="resp_1"), (1, 2, 3, 9))
    assert outcome == "hit" and lease is not None
    assert (lease.entry.response_id, lease.reuse_tokens) == ("resp_2", 3)


def test_hits_refresh_recency(clock: FakeClock, disposer: Disposer, scoper: SessionScoper) -> None:
    """LRU: an entry that was just used outlives an older unused one."""
    cache = SessionCache(max_entries=2, clock=clock, dispose=disposer)
    adopt(cache, query(scoper), "resp_a", tokens=(1, 2, 3))
    clock.advance(1)
    adopt(cache, query(scoper), "resp_b", tokens=(4, 5, 6))
    clock.advance(1)
    lease, _ = cache.lease(query(scoper), (1, 2, 3, 9))
    assert lease is not None
    cache.release(lease, consumed=True)
    clock.advance(1)
    adopt(cache, query(scoper), "resp_c", tokens=(7, 8))
    assert sorted(cache._entries) == ["resp_a", "resp_c"] and disposer.disposed == ["kv-resp_b"]


def test_the_byte_bound_is_sized_from_the_memory_budget() -> None:
    """Issue 12: unset, the bound is a quarter of the memory budget, else of RAM; a setting wins."""
    assert prefix_cache_bytes(EngineConfig(memory_budget_bytes=8 << 30), 64 << 30) == 2 << 30
    assert prefix_cache_bytes(EngineConfig(), 24 << 30) == 6 << 30
    assert prefix_cache_bytes(EngineConfig(max_session_bytes=5), 24 << 30) == 5
    assert prefix_cache_bytes(EngineConfig(), None) == 2 << 30


def test_hit_only_when_the_parent_turn_is_covered(cache: SessionCache, scoper: SessionScoper) -> None:
    """SES-7 (issue 25): `hit` only when the reused prefix holds the parent turn's whole input;
    reusing only a shared start (the chat template, a system prompt) is `partial`; a named parent
    that is not cached is `cold_replay` even when another entry lends a prefix; the hit rate
    counts hits only."""
    template = (1, 2, 3)
    parent = (*template, 10, 11, 12, 13, 14, 15)  # 9 tokens of input...
    cache.adopt(
        response_id="resp_1",
        query=query(scoper),
        tokens=(*parent, 50, 51),
        kv="kv",
        nbytes=1,
        prompt_tokens=9,
    )  # ...and 2 of answer
    # The continuation's re-tokenized answer differs after its first token: still the parent's whole input.
    continuation = (*parent, 50, 99, 7, 8)
    assert cache.lease(query(scoper, previous_response_id="resp_1"), continuation)[1] == "hit"
    # Another conversation shares the template only: 3 of the entry's 9 input tokens.
    lease, outcome = cache.lease(query(scoper), (*template, 40, 41, 42))
    assert (outcome, lease is not None and lease.reuse_tokens) == ("partial", 3)
    # A parent that is gone is replayed from its chain, even though the template prefix is reused.
    lease, outcome = cache.lease(query(scoper, previous_response_id="resp_gone"), (*template, 40, 41))
    assert (outcome, lease is not None and lease.reuse_tokens) == ("cold_replay", 3)
    # The same prompt again: everything reusable is reused.
    assert cache.lease(query(scoper), parent)[1] == "hit"
    stats = cache.stats
    assert (stats.hits, stats.partials, stats.misses) == (2, 2, 0)
    figures = tier_figures(stats, cache.max_bytes)
    assert figures["hit_rate"] == 0.5 and figures["partials"] == 2


def test_a_parent_superseded_by_its_continuation_is_still_a_hit(
    cache: SessionCache, scoper: SessionScoper
) -> None:
    """SES-1, SES-7: the parent's entry was dropped because its child's tokens start with it; a
    second child of the same parent (a regenerate) is served from the child's entry as a hit."""
    parent = (1, 2, 3, 4, 5, 6)
    cache.adopt(
        response_id="resp_p", query=query(scoper), tokens=parent, kv="kv-p", nbytes=1, prompt_tokens=4
    )
    child = (*parent, 7, 8, 9)
    cache.adopt(response_id="resp_c", query=query(scoper), tokens=child, kv="kv-c", nbytes=1, prompt_tokens=8)
    assert sorted(cache._entries) == ["resp_c"]
    lease, outcome = cache.lease(query(scoper, previous_response_id="resp_p"), (*parent, 7, 20))
    assert outcome == "hit" and lease is not None
    assert (lease.entry.response_id, lease.reuse_tokens) == ("resp_c", 7)
