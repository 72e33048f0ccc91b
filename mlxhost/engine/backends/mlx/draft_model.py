"""A draft model inside the batch: its own batch KV cache beside the target's, drafting for every row.

`SpeculativeGenerationBatch` (speculative.py) verifies per-row drafts in one target pass; this
module gives rows whose model names a draft model (docs/speculation.md, "Draft models") their
drafts from that model instead of from prompt lookup. `DraftModelRows` keeps:

- one mlx-lm `BatchKVCache` per draft layer over the drafting rows (its own row order, by uid),
  and per row how many of the row's tokens (prompt and output, as the target's cache holds
  them) the draft cache holds. A row joins the draft cache the first time it drafts: its tokens
  so far are prefilled into a fresh draft cache alone (the draft's KV is recomputed at
  admission, never taken from the prefix cache or the disk tier), then merged in with
  `BatchKVCache.merge` / `extend`; a row that ends leaves it with `filter`.
- `draft(...)`: each row's backlog (tokens the draft cache lacks: after a plain step, a pass
  whose every draft was accepted, or a prediction's pass, plus the pending token) is fed in one
  right-padded forward, the padding rolled off with mlx-lm's own `_right_padding` + `finalize()`
  (as the target's roll-back does), then one batched one-token forward per further draft
  position. Drafts are greedy over the row's own logits processors (penalties, logit bias): the
  target's verify pass alone decides what is emitted, so a draft only changes how many tokens a
  pass yields, never which.
- `settle(...)`: after the verify pass, each row keeps the draft positions that match what it
  emitted (its pending token and accepted drafts), the rest trimmed exactly as the target's are.

The draft's forwards are priced into the width plan: a pass drafting k tokens costs the target's
verify pass plus k draft forwards (`DraftCost`, measured per rows like pacing.py's steps, seeded
from the two models' weight bytes).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxhost.engine.errors import DraftMismatchError
from mlxhost.engine.vocabularies import vocabulary_mismatch

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from mlxhost.engine.backends.base import DraftCounts

# Tokens per forward when a row's tokens are prefilled into the draft cache alone.
DRAFT_PREFILL_STEP = 512
# Weight of a new measurement of a draft forward in its mean (pacing.py's WEIGHT), and how far a
# measured value moves back towards the seed per plain step (pacing.py's DRIFT): a batch whose
# draft forwards once looked dear tries them again some time later.
WEIGHT = 0.25
DRIFT = 0.01


def check_draft(target_tokenizer: Any, draft: Any, draft_tokenizer: Any) -> None:
    """Refuse a draft that cannot draft for the target: another vocabulary, or a cache the batch
    cannot roll back per row.

    Raises:
        DraftMismatchError: in one sentence, why.
    """
    reason = vocabulary_mismatch(target_tokenizer.get_vocab(), draft_tokenizer.get_vocab())
    if reason is not None:
        raise DraftMismatchError(reason)
    if not all(type(layer) is KVCache for layer in make_prompt_cache(draft)):
        raise DraftMismatchError(
            "The draft model's cache cannot be rolled back (it must be a plain KV cache)."
        )


def prefill_draft(draft: Any, tokens: Sequence[int]) -> list[Any]:
    """A fresh draft cache holding `tokens` (the draft's KV is recomputed, never cached)."""
    cache = make_prompt_cache(draft)
    for start in range(0, len(tokens), DRAFT_PREFILL_STEP):
        chunk = mx.array(list(tokens[start : start + DRAFT_PREFILL_STEP]), dtype=mx.uint32)
        draft(chunk[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def weight_bytes(model: Any) -> int:
    """Bytes of a model's weights: what a decode step reads (the seed of a draft forward's cost
    as a share of the target's; a quantized draft reads fewer)."""
    return sum(int(v.nbytes) for _, v in cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters())))


class DraftCost:
    """Milliseconds of one batched one-token draft forward, by rows: measured as an
    exponentially weighted mean, seeded as `share` of the target's plain step. A fixed `share`
    (not `measured`) prices draft forwards at that fraction of the target's step always."""

    __slots__ = ("_ms", "_seed", "measured", "share")

    def __init__(self, share: float, *, measured: bool = True) -> None:
        self.share = share
        self.measured = measured
        self._ms: dict[int, float] = {}
        self._seed: dict[int, float] = {}  # rows -> the seed at the plain step last asked with

    def __call__(self, rows: int, plain_ms: float) -> float:
        seed = self._seed[rows] = plain_ms * self.share
        ms = self._ms.get(rows) if self.measured else None
        return ms if ms is not None else seed

    def drift(self) -> None:
        """A plain step: every measured value moves a little back towards its seed."""
        for rows, ms in self._ms.items():
            seed = self._seed.get(rows)
            if seed is not None:
                self._ms[rows] = ms + (seed - ms) * DRIFT

    def record(self, rows: int, forwards: int, seconds: float) -> None:
        if not self.measured or forwards <= 0:
            return
        ms = seconds * 1000.0 / forwards
        old = self._ms.get(rows)
        self._ms[rows] = ms if old is None else old + (ms - old) * WEIGHT

    def priced(self, cost: Callable[[int, int], float]) -> Callable[[int, int], float]:
        """`cost` (a verify pass by width and rows) plus the draft forwards that fill it: a pass
        of width w drafts w - 1 tokens, one draft forward each."""

        def total(width: int, rows: int) -> float:
            base = cost(width, rows)
            return base if width <= 1 else base + (width - 1) * self(rows, cost(1, rows))

        return total


class DraftModelRows:
    """The draft model's batch cache and its rows (module docstring); worker thread only."""

    def __init__(self, model: Any, cost: DraftCost) -> None:
        self.model = model
        self.cost = cost
        self.uids: list[int] = []  # the draft cache's rows, in its order
        self.cache: list[Any] = []  # one BatchKVCache per draft layer; empty without rows
        self.fed: dict[int, int] = {}  # uid -> how many of the row's tokens the draft cache holds
        # uid -> what this step fed after the row's tokens: its pending token and drafts 1..k-1
        self._fed_now: dict[int, list[int]] = {}
        self.forwards = 0  # draft forwards run (for tests and benchmarks)

    def forget(self, uid: int) -> None:
        """A row ended or was removed: drop it from the draft cache."""
        self.fed.pop(uid, None)
        self._fed_now.pop(uid, None)
        if uid in self.uids:
            self._keep([u for u in self.uids if u != uid])

    def draft(
        self,
        uids: Sequence[int],
        tokens: Sequence[Sequence[int]],
        pending: Sequence[int],
        k: int,
        processors: Sequence[Any] | None = None,
    ) -> list[list[int]]:
        """k greedy drafts after each row's `pending` token; row i is `uids[i]` with its cache
        tokens `tokens[i]` and logits processors `processors[i]` (None or empty: none)."""
        if k <= 0 or not uids:
            return [[] for _ in uids]
        self._join(uids, tokens)  # a joining row's prefill is its admission, not a draft's cost
        started = time.perf_counter()
        where = {uid: i for i, uid in enumerate(uids)}
        order = [where[uid] for uid in self.uids]  # draft-cache row -> caller's row
        backlogs = [[*tokens[i][self.fed[self.uids[j]] :], pending[i]] for j, i in enumerate(order)]
        drafts: list[list[int]] = [[] for _ in self.uids]
        logits = self._feed(backlogs)
        for j, backlog in enumerate(backlogs):
            self.fed[self.uids[j]] += len(backlog)
            self._fed_now[self.uids[j]] = [backlog[-1]]
        for position in range(k):
            chosen = self._choose(logits, order, tokens, pending, drafts, processors)
            for j, token in enumerate(chosen):
                drafts[j].append(token)
            if position == k - 1:
                break
            logits = self._forward([[d[-1]] for d in drafts])[:, -1, :]
            for j, uid in enumerate(self.uids):
                self.fed[uid] += 1
                self._fed_now[uid].append(drafts[j][-1])
        self.cost.record(len(self.uids), k, time.perf_counter() - started)
        out: list[list[int]] = [[] for _ in uids]
        for j, i in enumerate(order):
            out[i] = drafts[j]
        return out

    def settle(self, emitted: dict[int, Sequence[int]]) -> None:
        """After the verify pass: each row keeps the positions fed this step that match what it
        emitted (`emitted[uid]`: its pending token and accepted drafts), the rest rolled off."""
        if not self._fed_now:
            return
        fed_now, self._fed_now = self._fed_now, {}
        if set(fed_now) != set(self.uids):  # a row joined or left since it was fed: start over
            self._keep([])
            return
        width = len(fed_now[self.uids[0]])
        keeps = []
        for uid in self.uids:
            fed, out = fed_now[uid], emitted.get(uid, ())
            keep = 0
            while keep < len(fed) and keep < len(out) and fed[keep] == out[keep]:
                keep += 1
            keeps.append(keep)
            self.fed[uid] -= len(fed) - keep
        most = max(keeps)
        garbage = [most - keep for keep in keeps]
        for cache in self.cache:
            cache.trim(width - most)
            if any(garbage):
                cache._right_padding = mx.array(garbage)
                cache.finalize()
        mx.eval([c.state for c in self.cache])

    def _choose(
        self,
        logits: mx.array,
        order: list[int],
        tokens: Sequence[Sequence[int]],
        pending: Sequence[int],
        drafts: list[list[int]],
        processors: Sequence[Any] | None,
    ) -> list[int]:
        """The greedy token of each draft-cache row, after the row's processors where it has any."""
        if processors and any(processors[i] for i in order):
            rows = []
            for j, i in enumerate(order):
                row = logits[j : j + 1]
                if processors[i]:
                    context = mx.array([*tokens[i], pending[i], *drafts[j]], dtype=mx.int32)
                    for processor in processors[i]:
                        row = processor(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        return cast("list[int]", mx.argmax(logits, axis=-1).tolist())

    def _feed(self, backlogs: list[list[int]]) -> mx.array:
        """Feed each row its backlog in one right-padded forward; each row's last logits."""
        width = max(len(b) for b in backlogs)
        rows = [b + [0] * (width - len(b)) for b in backlogs]
        logits = self._forward(rows)
        last = mx.array([len(b) - 1 for b in backlogs])
        picked = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0, :]
        garbage = [width - len(b) for b in backlogs]
        if any(garbage):
            for cache in self.cache:
                cache._right_padding = mx.array(garbage)
                cache.finalize()
        mx.eval(picked, [c.state for c in self.cache])
        return picked

    def _forward(self, rows: list[list[int]]) -> mx.array:
        self.forwards += 1
        return cast("mx.array", self.model(mx.array(rows, dtype=mx.uint32), cache=self.cache))

    def _join(self, uids: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Make the draft cache's rows exactly `uids`: rows gone are filtered out, new rows are
        prefilled alone on their tokens so far and appended."""
        wanted = set(uids)
        if any(uid not in wanted for uid in self.uids):
            self._keep([uid for uid in self.uids if uid in wanted])
        new = [(uid, tokens[i]) for i, uid in enumerate(uids) if uid not in self.fed]
        if not new:
            return
        singles = [prefill_draft(self.model, row_tokens) for _, row_tokens in new]
        merged = [
            BatchKVCache.merge([single[layer] for single in singles]) for layer in range(len(singles[0]))
        ]
        if self.cache:
            for cache, joining in zip(self.cache, merged, strict=True):
                cache.extend(joining)
        else:
            self.cache = merged
        for uid, row_tokens in new:
            self.uids.append(uid)
            self.fed[uid] = len(row_tokens)
        mx.eval([c.state for c in self.cache])

    def _keep(self, uids: list[int]) -> None:
        index = {uid: i for i, uid in enumerate(self.uids)}
        for uid in self.uids:
            if uid not in uids:
                self.fed.pop(uid, None)
        if not uids:
            self.uids, self.cache = [], []
            return
        keep = [index[uid] for uid in uids]
        for cache in self.cache:
            cache.filter(keep)
        self.uids = list(uids)


class SinglePasses:
    """A single stream's speculation counts from mlx-lm's `from_draft` flags: each verify pass of
    `speculative_generate_step` drafts min(k, tokens left) and yields its accepted drafts
    (`from_draft`) then the target's own token, so a token after a non-drafted one opens a pass."""

    __slots__ = ("_counts", "_k", "_left", "_open")

    def __init__(self, counts: DraftCounts | None, k: int, max_tokens: int) -> None:
        self._counts = counts if k > 0 else None
        self._k = k
        self._left = max_tokens
        self._open = False  # inside a pass: the last token was an accepted draft

    def add(self, from_draft: bool) -> None:
        counts = self._counts
        if counts is None:
            return
        if not self._open:
            counts.passes += 1
            counts.drafted += min(self._k, self._left)
        counts.accepted += from_draft
        counts.emitted += 1
        self._left -= 1
        self._open = from_draft
