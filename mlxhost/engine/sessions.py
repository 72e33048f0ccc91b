"""The prefix cache: KV caches of finished turns, scoped by HMAC fingerprints, shared by every request.

Each entry is the KV of one turn (prompt plus what it produced) in one cache domain. A request
takes the longest cached prefix of its prompt without removing it: it works on its own copy of
that prefix (the backend's `copy_cache`, made on the worker thread), so any number of requests
start from the same system prompt at once and no entry ever changes after it is adopted. Models
whose cache is one shared mutable state (SES-5) cannot copy; there a lease takes the entry out.

The index is a flat dict of entries whose token tuples are compared in C-sized chunks, not
mlx-lm's `PromptTrie` (one dict per token): measured by `benchmarks/bench_prefix_index.py` for 64
conversations of 4,000 tokens behind one system prompt, the trie holds 52 MB of Python objects
against 2 MB, every full GC pass walks them (61 ms against 22 ms) and a lookup takes 1.5 ms against
0.6 ms. The copies and the files are mlx-lm's (`copy_cache` slices its KVCache arrays; the disk tier
uses `save_prompt_cache` / `load_prompt_cache`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

# What a request may reuse, fingerprinted per tenant (SES-3): in scoping.py, still imported from here.
from mlxhost.engine.scoping import SessionQuery, SessionScoper

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "Outcome",
    "SessionCache",
    "SessionEntry",
    "SessionLease",
    "SessionQuery",
    "SessionScoper",
    "SessionStats",
    "Tier",
    "TierStats",
    "reusable_prefix",
    "tier_figures",
]

logger = logging.getLogger(__name__)

# SES-7: `hit` when the reused prefix holds the parent turn's whole input, `partial` when it holds
# less (a shared system prompt, another conversation's start), `cold_replay` when the named parent
# is not cached and its chain is replayed, `fresh` when nothing was reused or named.
Outcome = Literal["hit", "partial", "disk", "cold_replay", "fresh"]
Tier = Literal["response_id", "cache_key", "warm_any", "prefix"]

_PREFIX_CHUNK = 256  # tuple slices compare in C; only the mismatching chunk is walked in Python


@dataclass(slots=True)
class SessionEntry:
    response_id: str
    domain: str
    instructions: str
    cache_key: str | None
    tokens: tuple[int, ...]
    kv: object  # owned by the backend; this cache never inspects it
    prompt_tokens: int  # how many of `tokens` were the turn's input (the rest it produced)
    nbytes: int
    created_at: float
    last_used_at: float
    expires_at: float
    pins: int = 0  # leases being copied from now: disposal waits for the last one
    cached: bool = True  # false once evicted, replaced or expired


@dataclass(frozen=True, slots=True)
class SessionLease:
    """A request's claim on an entry: copy `reuse_tokens` of `entry.kv`, or (when `owned`) use
    the kv itself, which left the cache with this lease (SES-5)."""

    entry: SessionEntry
    reuse_tokens: int  # common prefix with the new prompt, capped so at least one token is fed
    tier: Tier
    owned: bool = False
    hit: bool = False  # counted as a hit (else as a partial) in the stats


@dataclass(slots=True)
class SessionStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0  # lookups that reused the parent turn's whole input (SES-7 `hit`)
    partials: int = 0  # lookups that reused a shorter prefix (`partial`, or a `cold_replay` with some)
    misses: int = 0
    tokens_saved: int = 0  # prompt tokens that hits and partials did not have to compute
    adopted: int = 0
    evicted: int = 0
    expired: int = 0
    disposed: int = 0
    dispose_failures: int = 0
    dispose_retries: int = 0


class TierStats(Protocol):
    """What `tier_figures` reads: `SessionStats` (memory) and `DiskStats` (disk) both have it."""

    entries: int
    bytes: int
    hits: int
    partials: int
    misses: int
    tokens_saved: int
    evicted: int


def tier_figures(stats: TierStats, max_bytes: int) -> dict[str, Any]:
    """One prefix-cache tier as /readyz, /metrics and the dashboard show it (memory or disk)."""
    lookups = stats.hits + stats.partials + stats.misses
    return {
        "entries": stats.entries,
        "bytes": stats.bytes,
        "max_bytes": max_bytes,
        "hits": stats.hits,
        "partials": stats.partials,
        "misses": stats.misses,
        "hit_rate": round(stats.hits / lookups, 3) if lookups else None,
        "tokens_saved": stats.tokens_saved,
        "evicted": stats.evicted,
    }


class SessionCache:
    """The prefix cache of one model instance, bounded by entries, bytes and TTL (SES-1).

    Not thread-safe: the engine calls it from the asyncio loop thread only.
    """

    def __init__(
        self,
        *,
        max_entries: int = 64,
        max_bytes: int = 2 << 30,
        ttl_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
        dispose: Callable[[object], None] = lambda kv: None,
    ) -> None:
        self._entries: dict[str, SessionEntry] = {}  # insertion order breaks last_used_at ties
        self._by_key: dict[tuple[str, str], str] = {}  # (domain, cache_key) -> response_id
        # An entry dropped because a newer one starts with its tokens -> (that one, its input
        # length): a continuation naming it is still served whole (SES-1, SES-7). Bounded.
        self._superseded: dict[str, tuple[str, int]] = {}
        self._bytes = 0
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._ttl_s = ttl_s
        self._clock = clock
        self._dispose_fn = dispose
        self._stats = SessionStats()
        self._shared_kv = False

    @property
    def max_entries(self) -> int:
        return self._max_entries

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def stats(self) -> SessionStats:
        return replace(self._stats, entries=len(self._entries), bytes=self._bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def single_use(self) -> None:
        """The model's cache is one shared mutable state (SES-5): it cannot be copied, so a lease
        takes its entry out and at most one entry is kept. Applies at once."""
        self._shared_kv = True
        self._max_entries = 1
        self._evict()

    def lease(self, query: SessionQuery, prompt_ids: Sequence[int]) -> tuple[SessionLease | None, Outcome]:
        """Find the entry `query` may start from, and pin it until `release`.

        Tiers (SES-2): `previous_response_id` exact, else `cache_key`, else `warm_any`, each
        falling back to the longest in-domain token prefix (SES-8); a `previous_response_id`
        never falls through to a cache key. The entry stays cached (SES-4), except on a
        single-use cache, where it is taken out; there a keyed lease with nothing reusable is
        still returned, so its kv can be recycled, but its outcome is not "hit". The outcome
        (SES-7) is "hit" only when the reused prefix holds the entry's whole input (or all of this
        prompt that can be reused), else "partial"; a named parent that is not cached is
        "cold_replay" even when another entry lends a shorter prefix.
        """
        self.sweep()
        prompt = tuple(prompt_ids)
        found = self._find(query, prompt)
        cold: Outcome = "cold_replay" if query.previous_response_id is not None else "fresh"
        reuse = 0 if found is None else reusable_prefix(found[0].tokens, prompt)
        if found is None or (reuse == 0 and not self._shared_kv):
            self._stats.misses += 1
            return None, cold
        entry, tier, parent_input = found
        if self._shared_kv:
            self._remove(entry)
        else:
            entry.pins += 1
            entry.last_used_at = self._clock()
        outcome = _outcome(query, tier, reuse, min(parent_input, len(prompt) - 1))
        hit = outcome == "hit"
        lease = SessionLease(entry=entry, reuse_tokens=reuse, tier=tier, owned=self._shared_kv, hit=hit)
        if reuse == 0:
            self._stats.misses += 1
            return lease, cold
        if hit:
            self._stats.hits += 1
        else:
            self._stats.partials += 1
        self._stats.tokens_saved += reuse
        return lease, outcome

    @property
    def copies(self) -> bool:
        """Whether leases copy (entries never change); false for a single-use cache (SES-5)."""
        return not self._shared_kv

    def entry(self, response_id: str) -> SessionEntry | None:
        return self._entries.get(response_id)

    def pin(self, entry: SessionEntry) -> None:
        """Keep `entry`'s kv alive past eviction until `unpin` (a disk write reads it)."""
        entry.pins += 1

    def unpin(self, entry: SessionEntry) -> None:
        entry.pins -= 1
        if not entry.cached and entry.pins == 0:
            self._dispose(entry.kv)

    def unlease(self, lease: SessionLease) -> None:
        """Give back a shared lease the request will not use (a better start was found elsewhere),
        counting it as the miss it turned out to be."""
        if lease.hit:
            self._stats.hits -= 1
        else:
            self._stats.partials -= 1
        self._stats.tokens_saved -= lease.reuse_tokens
        self._stats.misses += 1
        self.release(lease, consumed=False)

    def release(self, lease: SessionLease, *, consumed: bool) -> None:
        """End a lease. A shared entry is unpinned (and disposed if it left the cache meanwhile);
        an owned one is reinserted unless the request `consumed` its kv (it ran on it)."""
        entry = lease.entry
        if not lease.owned:
            self.unpin(entry)
            return
        if consumed:
            return
        if entry.expires_at <= self._clock():
            self._stats.expired += 1
            self._dispose(entry.kv)
        elif entry.response_id in self._entries:
            self._dispose(entry.kv)
        else:
            entry.cached = True
            self._insert(entry)
            self._evict()

    def adopt(
        self,
        *,
        response_id: str,
        query: SessionQuery,
        tokens: Sequence[int],
        kv: object,
        nbytes: int,
        prompt_tokens: int | None = None,
    ) -> bool:
        """Keep a turn's kv as the entry of `response_id`.

        A finished, length-cut or cancelled turn may be adopted (SES-1); after an error or a
        server abort the caller must `discard(kv)` instead. An older entry with the same response
        id, with the same cache key in the same domain, or whose tokens are a prefix of `tokens`
        in the same domain (the new entry serves every prompt it served), is dropped.
        `prompt_tokens` says how many of `tokens` were the turn's input (all when not given).

        Returns:
            Whether the entry is now cached; False when `nbytes` alone exceeds `max_bytes`
            (the kv is then disposed).
        """
        if nbytes > self._max_bytes:
            self._dispose(kv)
            return False
        tokens = tuple(tokens)
        self._drop(self._entries.get(response_id), kv)
        if query.cache_key is not None:
            self._drop(self._keyed(query.domain, query.cache_key), kv)
        if not self._shared_kv:
            for older in [e for e in self._entries.values() if e.domain == query.domain]:
                if len(older.tokens) <= len(tokens) and _common_prefix(older.tokens, tokens) == len(
                    older.tokens
                ):
                    self._drop(older, kv)
                    self._supersede(older, response_id)
        now = self._clock()
        entry = SessionEntry(
            response_id=response_id,
            domain=query.domain,
            instructions=query.instructions,
            cache_key=query.cache_key,
            tokens=tokens,
            kv=kv,
            prompt_tokens=len(tokens) if prompt_tokens is None else min(prompt_tokens, len(tokens)),
            nbytes=nbytes,
            created_at=now,
            last_used_at=now,
            expires_at=now + self._ttl_s,
        )
        self._insert(entry)
        self._stats.adopted += 1
        self._evict()
        return self._entries.get(response_id) is entry

    def discard(self, kv: object) -> None:
        """Dispose a kv that will not be adopted (a failed or aborted turn)."""
        self._dispose(kv)

    def sweep(self) -> int:
        """Drop expired entries; return how many there were."""
        now = self._clock()
        expired = [e for e in self._entries.values() if e.expires_at <= now]
        for entry in expired:
            self._uncache(entry)
            self._stats.expired += 1
        return len(expired)

    def clear(self) -> None:
        """Drop every entry (model unload)."""
        for entry in list(self._entries.values()):
            self._uncache(entry)

    def _find(self, query: SessionQuery, prompt: tuple[int, ...]) -> tuple[SessionEntry, Tier, int] | None:
        """The entry to start from, its tier and how many tokens of it are the named parent's input."""
        if (parent := query.previous_response_id) is not None:
            entry = self._entries.get(parent)
            parent_input = entry.prompt_tokens if entry is not None else 0
            if entry is None and parent in self._superseded:
                newer, parent_input = self._superseded[parent]
                entry = self._entries.get(newer)
            if entry is not None and _scoped(entry, query):
                return entry, "response_id", parent_input
        elif query.cache_key is not None:
            entry = self._keyed(query.domain, query.cache_key)
            if entry is not None and _scoped(entry, query):
                return entry, "cache_key", entry.prompt_tokens
        elif query.warm_any:
            entry = self._most_recent(query)
            if entry is not None:
                return entry, "warm_any", entry.prompt_tokens
        best = self._longest_prefix(query.domain, prompt)
        return None if best is None else (best[0], best[1], best[0].prompt_tokens)

    def _supersede(self, older: SessionEntry, newer: str) -> None:
        parent_input = older.prompt_tokens
        if (chained := self._superseded.get(older.response_id)) is not None:
            parent_input = chained[1]
        self._superseded.pop(older.response_id, None)
        self._superseded[older.response_id] = (newer, parent_input)
        for name, (target, length) in list(self._superseded.items()):
            if target == older.response_id:  # a chain of supersessions points at the newest
                self._superseded[name] = (newer, length)
        while len(self._superseded) > 4 * self._max_entries:
            del self._superseded[next(iter(self._superseded))]

    def _keyed(self, domain: str, cache_key: str) -> SessionEntry | None:
        response_id = self._by_key.get((domain, cache_key))
        return None if response_id is None else self._entries[response_id]

    def _most_recent(self, query: SessionQuery) -> SessionEntry | None:
        ranked = [(e.last_used_at, i, e) for i, e in enumerate(self._entries.values()) if _scoped(e, query)]
        return max(ranked, key=lambda r: (r[0], r[1]))[2] if ranked else None

    def _longest_prefix(self, domain: str, prompt: tuple[int, ...]) -> tuple[SessionEntry, Tier] | None:
        ranked = [
            (reusable_prefix(e.tokens, prompt), e.last_used_at, i, e)
            for i, e in enumerate(self._entries.values())
            if e.domain == domain
        ]
        best = max(ranked, key=lambda r: (r[0], r[1], r[2]), default=None)
        return (best[3], "prefix") if best is not None and best[0] > 0 else None

    def _insert(self, entry: SessionEntry) -> None:
        self._entries[entry.response_id] = entry
        self._bytes += entry.nbytes
        if entry.cache_key is not None and (entry.domain, entry.cache_key) not in self._by_key:
            self._by_key[(entry.domain, entry.cache_key)] = entry.response_id

    def _remove(self, entry: SessionEntry) -> None:
        """Take `entry` out of the index (it may live on in a lease)."""
        if self._entries.get(entry.response_id) is not entry:
            return
        entry.cached = False
        del self._entries[entry.response_id]
        self._bytes -= entry.nbytes
        if entry.cache_key is None:
            return
        slot = (entry.domain, entry.cache_key)
        if self._by_key.get(slot) == entry.response_id:
            del self._by_key[slot]

    def _uncache(self, entry: SessionEntry) -> None:
        """Remove `entry` and free its kv, now or when its last lease ends."""
        self._remove(entry)
        if entry.pins == 0:
            self._dispose(entry.kv)

    def _drop(self, old: SessionEntry | None, kv: object) -> None:
        if old is None or not old.cached:
            return
        self._stats.evicted += 1
        if old.kv is kv:  # a single-use lease's kv, adopted again: it lives on in the new entry
            self._remove(old)
        else:
            self._uncache(old)

    def _evict(self) -> None:
        self.sweep()
        while self._entries and (len(self._entries) > self._max_entries or self._bytes > self._max_bytes):
            victim = min(self._entries.values(), key=lambda e: e.last_used_at)  # first wins ties
            self._uncache(victim)
            self._stats.evicted += 1

    def _dispose(self, kv: object) -> None:
        # SES-6: the client already has its answer, so a failing dispose is logged, never raised.
        for attempt in range(2):
            try:
                self._dispose_fn(kv)
            except Exception:
                if attempt == 0:
                    self._stats.dispose_retries += 1
                    continue
                self._stats.dispose_failures += 1
                logger.warning("Disposing a cached KV failed twice", exc_info=True)
                return
            self._stats.disposed += 1
            return


def _outcome(query: SessionQuery, tier: Tier, reuse: int, covers: int) -> Outcome:
    if query.previous_response_id is not None and tier != "response_id":
        return "cold_replay"  # the parent is gone: its chain is replayed, a shared prefix aside
    # `covers`: the parent's whole input (its own answer may re-tokenize differently), or all of
    # this prompt but the token that must be fed.
    return "hit" if reuse >= covers else "partial"


def _scoped(entry: SessionEntry, query: SessionQuery) -> bool:
    return entry.domain == query.domain and entry.instructions == query.instructions


def reusable_prefix(cached: tuple[int, ...], prompt: tuple[int, ...]) -> int:
    """How many tokens of `cached` may start `prompt`: their common prefix, leaving one to feed."""
    # At least one prompt token must be fed to get logits for the next token.
    return max(0, min(_common_prefix(cached, prompt), len(prompt) - 1))


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    limit = min(len(a), len(b))
    i = 0
    while i < limit:
        end = min(i + _PREFIX_CHUNK, limit)
        if a[i:end] != b[i:end]:
            while a[i] == b[i]:
                i += 1
            return i
        i = end
    return limit
