"""Prefix index for the prefix cache: mlx-lm's `PromptTrie` vs mlxhost's scan of entries (issue 12).

Why the prefix cache (mlxhost/engine/sessions.py) keeps a flat list of entries whose token tuples
it compares in C-sized chunks instead of mlx-lm's `PromptTrie` (one dict per token): for 64 cached
conversations of 4,000 tokens behind one system prompt, the trie holds ~25x the Python objects,
every full GC pass walks them, and its lookup is slower.

    .venv/bin/python benchmarks/bench_prefix_index.py
"""

import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm.models.cache import PromptTrie

from mlxhost.engine.sessions import SessionCache, SessionScoper

random.seed(0)
SYSTEM = [random.randrange(50000) for _ in range(350)]
ENTRIES, LENGTH = 64, 4000
convs = [SYSTEM + [random.randrange(50000) for _ in range(LENGTH - 350)] for _ in range(ENTRIES)]
prompt = [*convs[17][:3000], 1, 2, 3]

tracemalloc.start()
trie = PromptTrie()
t = time.perf_counter()
for i, c in enumerate(convs):
    trie.add("m", c, i)
add_s = time.perf_counter() - t
trie_bytes = tracemalloc.get_traced_memory()[0]
tracemalloc.stop()
t = time.perf_counter()
for _ in range(100):
    r = trie.search("m", prompt)
trie_search_ms = (time.perf_counter() - t) * 10
gc.collect()
t = time.perf_counter()
gc.collect()
gc_trie_ms = (time.perf_counter() - t) * 1000
del trie
gc.collect()

tracemalloc.start()
cache = SessionCache(max_entries=ENTRIES, max_bytes=1 << 40)
q = SessionScoper(b"s" * 32).query(tenant="t")
for i, c in enumerate(convs):
    cache.adopt(response_id=f"r{i}", query=q, tokens=c, kv=object(), nbytes=1)
scan_bytes = tracemalloc.get_traced_memory()[0]
tracemalloc.stop()
t = time.perf_counter()
for _ in range(100):
    lease, _ = cache.lease(q, prompt)
    cache.release(lease, consumed=False)
scan_ms = (time.perf_counter() - t) * 10
gc.collect()
t = time.perf_counter()
gc.collect()
gc_scan_ms = (time.perf_counter() - t) * 1000
print(f"{ENTRIES} entries x {LENGTH} tokens, shared 350-token start; lookup of a 3003-token prompt")
print(
    f"PromptTrie: index {trie_bytes / 1e6:.1f} MB of Python objects, add all {add_s * 1000:.0f} ms, search {trie_search_ms:.2f} ms, full GC pass {gc_trie_ms:.0f} ms"
)
print(
    f"scan:       index {scan_bytes / 1e6:.1f} MB (token tuples), lease {scan_ms:.2f} ms, full GC pass {gc_scan_ms:.0f} ms"
)
print(
    "lease result",
    lease.reuse_tokens,
    "trie result",
    r.shorter and len(r.shorter),
    r.longer and len(r.longer),
    r.common_prefix,
)
