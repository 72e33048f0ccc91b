"""Speculative decoding inside mlx-lm's continuous batch: a `GenerationBatch` that verifies drafts.

`SpeculativeGenerationBatch` replaces the `GenerationBatch` that mlx-lm's `BatchGenerator` holds
in `_generation_batch`. Everything else stays mlx-lm's: prompt processing, chunked prefill,
`extend` when sequences join, `filter` when they leave, `extract_cache` when they finish, the
stop-token matchers, the per-row samplers and logits processors, `BatchKVCache`.

Each call to `next()` first asks every row's `RowDrafter` (drafting.py) for a draft after its
pending token (sampled by the previous step, not yet fed) and plans the pass width from the
batch's measured cost of a pass (pacing.py) and each row's acceptance. With no draft worth
trying it runs mlx-lm's own one-token step (`GenerationBatch.next`, pipelined as ever). Reading
the pending token waits for that pipeline, so the plan is first drawn as if every row found a
draft as often as it has lately: when even that is a plain step, nothing is read or looked up,
and text that never repeats pays (almost) nothing. Otherwise one forward pass feeds each row `[pending, d1..dk]` (right-padded to the
widest row) and checks the drafts position by position:

- position j's logits go through the row's logits processors with the context the row would
  have had there (cache tokens + pending + d1..dj), so penalties see exactly what a one-token
  step would have shown them;
- the row's own sampler draws the token at each position; draft d(j+1) is accepted only if it
  equals the token drawn at position j. A sampler with its own random key (a seeded request)
  is called once per emitted token, in order, and never past the first rejection, so it
  consumes its key exactly as one-token steps do: the same seed gives the same text. Greedy
  rows therefore get the same tokens; a shared unseeded sampler is called once on all of a
  row's positions (independent draws from the target's distribution at each position, which
  keeps the distribution exact);
- the emitted tokens (pending + the accepted run) go through max_tokens and the stop-token
  matcher one by one, as one-token steps would; a row that ends inside its run is cut there;
- the token drawn after the accepted run becomes the row's next pending token.

Rows with k = 0 in a wide pass still get their one token from position 0. Rows under a grammar
never draft (k = 0): a grammar processor advances its matcher on every call, so calling it on
positions that may be rejected would corrupt its state. Checking drafts against the grammar is
left for later.

Per-row rollback of the batch KV cache (the crux). `BatchKVCache` keeps one write index `_idx`
shared by all rows, each row's content right-aligned to it, `left_padding[r]` masked positions
in front, and `offset[r]` (the row's RoPE position) = real tokens. After a pass of width K+1
row r keeps `keep[r]` = 1 + accepted positions; M = max(keep). The cache is first trimmed by
K+1-M for everyone (`trim`, mlx-lm's). Row r then holds M-keep[r] rejected (or padding)
positions at its right end. They are turned into left padding with mlx-lm's own mechanism for
right-padded prompts: `_right_padding = M - keep` and `finalize()`, which rolls each row right
by its garbage count (the garbage lands past `_idx`, the unused tail lands in front, masked),
subtracts it from the row's offset and adds it to its left padding. The cache is then an
ordinary `BatchKVCache` again: every later mlx-lm operation (mask, RoPE offsets, extend,
filter, extract) is exact without knowing speculation happened. The costs: a roll copies the
cache's buffers once per pass where rows kept different counts, and the shared length grows by
the best row's count, so a row that accepts little carries more left padding (masked; trimmed
by `filter` when rows leave, as for any batch of unequal lengths). The alternative, holes
masked in place with per-row offsets, avoids the copy but needs a cache subclass whose mask,
extend, filter and extract all know the holes; the roll keeps mlx-lm's cache untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache

from mlxhost.engine.backends.mlx.drafting import PredictionAligner, RowDrafter, SpeculationConfig, plan_widths
from mlxhost.engine.backends.mlx.pacing import DraftGovernor, MeasuredCost, StepClock

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from mlxhost.engine.backends.mlx.draft_model import DraftModelRows


@dataclass(frozen=True, slots=True)
class RowPlan:
    """What the batch knows of a row before it decodes: its prompt length (the rest of its
    cache tokens are output), its prediction's aligner (the batch's own, shared), whether it
    may draft at all (not under a grammar), whether its sampler draws from its own key (must be
    called in order), and its own cap on drafts per step."""

    prompt_length: int
    prediction: PredictionAligner | None = None  # followed by the batch as the row emits
    speculate: bool = True
    sequential: bool = False
    max_draft: int | None = None  # its own cap below the batch's (an alias's setting)


class SpeculativeGenerationBatch(GenerationBatch):
    """mlx-lm's `GenerationBatch` whose `next()` verifies per-row drafts (module docstring)."""

    config: SpeculationConfig
    plans: dict[int, RowPlan]
    drafters: dict[int, RowDrafter]
    _seen: dict[int, int]
    clock: StepClock
    governor: DraftGovernor  # whether drafting pays this batch at all, by its realised rate (pacing.py)
    _plain_run: bool  # the last step was a plain one (mlx-lm's pipeline is running)
    draft_rows: DraftModelRows | None  # the draft model's side (draft_model.py), if the model has one
    row_hook: Callable[[Sequence[int]], None] | None = None  # adapters.py: each row's LoRA adapter

    @classmethod
    def start(
        cls, model: Any, sampler: Any, config: SpeculationConfig, draft_rows: DraftModelRows | None = None
    ) -> SpeculativeGenerationBatch:
        batch = cast("SpeculativeGenerationBatch", cls.empty(model, sampler))
        batch.draft_rows = draft_rows
        batch.config = config
        batch.plans = {}
        batch.drafters = {}
        batch._seen = {}
        batch.clock = StepClock(MeasuredCost(config.cost))
        batch.governor = DraftGovernor()
        batch._plain_run = False
        return batch

    def register(self, uid: int, plan: RowPlan) -> None:
        self.plans[uid] = plan

    def release(self, uid: int) -> RowDrafter | None:
        """Forget a row (finished or removed); its drafter, with its counts, if it had one."""
        self.plans.pop(uid, None)
        self._seen.pop(uid, None)
        if self.draft_rows is not None:
            self.draft_rows.forget(uid)
        return self.drafters.pop(uid, None)

    def _step(self) -> Any:
        if self.row_hook is not None:
            self.row_hook(self.uids)
        return super()._step()

    def extend(self, batch: Any) -> None:
        super().extend(batch)
        self.clock.interrupt()  # the caller just ran a prefill: not a step's cost
        self.governor.interrupt()

    @property
    def cost(self) -> Callable[[int, int], float]:
        """What plans a pass: the batch's own measured step times, or the bare table; with a
        draft model, plus the draft forwards that fill the pass."""
        cost = self.clock.cost if self.config.measure else self.config.cost
        return cost if self.draft_rows is None else self.draft_rows.cost.priced(cost)

    def next(self) -> list[Any]:
        if not self.uids:
            return []
        rows = len(self.uids)
        self.clock.step(1, rows, pipelined=self._plain_run)  # re-started below for a verify pass
        planned = self._plan() if self.governor.allowed(rows) else None
        if planned is None or not any(planned[0]):
            responses = cast("list[Any]", super().next())
            for response in responses:
                drafter = self.drafters.get(response.uid)
                if drafter is not None:
                    drafter.record(0, 0, 1)
            if self.draft_rows is not None:
                self.draft_rows.cost.drift()
            self._plain_run = True
            drafted = False
        else:
            drafts, pending = planned
            self.clock.step(1 + max(len(d) for d in drafts), rows, pipelined=False)
            self._plain_run = False
            responses = self._verify(drafts, pending)
            drafted = True
        self.governor.stepped(len(responses), drafted=drafted)
        return responses

    def _drafter(self, row: int) -> RowDrafter | None:
        uid = self.uids[row]
        plan = self.plans.get(uid)
        if plan is None or not plan.speculate:
            return None
        tokens = self.tokens[row]
        drafter = self.drafters.get(uid)
        if drafter is None:
            split = min(plan.prompt_length, len(tokens))
            drafter = RowDrafter(self.config, tokens[:split], aligner=plan.prediction)
            self.drafters[uid] = drafter
            self._seen[uid] = split
        seen = self._seen[uid]
        if seen < len(tokens):
            drafter.observe(tokens[seen:])
            self._seen[uid] = len(tokens)
        return drafter

    def _limit(self, r: int, drafter: RowDrafter | None) -> int:
        """The most row r may draft this step: the batch's cap (wider for a prediction), the
        row's own, and its room under max_tokens."""
        if drafter is None:
            return 0
        plan = self.plans[self.uids[r]]
        cap = self.config.max_draft
        if drafter.prediction is not None:
            cap = max(cap, self.config.prediction_max_draft)
        if plan.max_draft is not None:
            cap = min(cap, plan.max_draft)
        return max(0, min(cap, self.max_tokens[r] - self._num_tokens[r] - 1))

    def _plan(self) -> tuple[list[list[int]], list[int]] | None:
        """Each row's drafts for this step, with the pending tokens they follow; None or all
        drafts empty means a plain one-token step.

        None: decided before reading the pending tokens (which would wait for mlx-lm's
        pipelined step and lose its overlap): even if every row found a draft as often as it
        has lately, up to its limit, no pass would pay."""
        rows = len(self.uids)
        if self.config.max_draft <= 0 or not all(type(c) is BatchKVCache for c in self.prompt_cache):
            return None
        drafters = [self._drafter(r) for r in range(rows)]
        if not any(drafters):
            return None
        limits = [self._limit(r, d) for r, d in enumerate(drafters)]
        acceptances = [d.acceptance if d is not None else 0.0 for d in drafters]
        hits = [d.hit if d is not None else 0.0 for d in drafters]
        cost = self.cost
        cap = max(limits)
        hoped = plan_widths(cost, acceptances, limits, cap, hits)
        if not any(hoped):
            return None
        pending = self._pending()
        if self.draft_rows is not None:
            candidates = self._model_drafts(drafters, limits, pending, max(hoped))
        else:
            candidates = self._lookups(drafters, limits, pending)
        widths = plan_widths(cost, acceptances, [len(d) for d in candidates], cap)
        if self.draft_rows is not None and not any(widths):  # a plain step feeds the pending tokens
            self.draft_rows.settle({uid: [p] for uid, p in zip(self.uids, pending, strict=True)})
        return [d[:k] for d, k in zip(candidates, widths, strict=True)], pending

    def _lookups(
        self, drafters: list[RowDrafter | None], limits: list[int], pending: list[int]
    ) -> list[list[int]]:
        """Each row's draft from its prediction or its own tokens (prompt lookup)."""
        candidates: list[list[int]] = []
        for r, drafter in enumerate(drafters):
            draft = drafter.draft(limits[r], pending[r]) if drafter is not None and limits[r] else []
            if drafter is not None and limits[r]:
                drafter.looked_up(bool(draft))
            candidates.append(draft)
        return candidates

    def _model_drafts(
        self, drafters: list[RowDrafter | None], limits: list[int], pending: list[int], k: int
    ) -> list[list[int]]:
        """Each row's draft from its prediction where one aligns, else from the draft model: up
        to k tokens (the widest pass the plan hopes for), every drafting row in one batched draft
        forward per position (draft_model.py). Prompt lookup is not asked: the draft model reads
        the same prompt."""
        assert self.draft_rows is not None
        # The draft forwards are neither the plain step's time nor the verify pass's (their own
        # cost is measured apart): the clock times neither interval.
        self.clock.step(1, len(self.uids), pipelined=False)
        rows = [r for r, d in enumerate(drafters) if d is not None and limits[r]]
        processors = self.logits_processors or None
        drafted = self.draft_rows.draft(
            [self.uids[r] for r in rows],
            [self.tokens[r] for r in rows],
            [pending[r] for r in rows],
            k,
            [processors[r] for r in rows] if processors else None,
        )
        candidates: list[list[int]] = [[] for _ in drafters]
        for r, model_draft in zip(rows, drafted, strict=True):
            drafter = drafters[r]
            assert drafter is not None
            predicted = drafter.predicted(limits[r], pending[r])
            candidates[r] = predicted or model_draft[: limits[r]]
            drafter.looked_up(True)
        return candidates

    def _pending(self) -> list[int]:
        """Each row's pending token: waits for mlx-lm's pipelined step to finish."""
        return cast("list[int]", self._next_tokens.tolist())

    def _verify(self, drafts: list[list[int]], pending: list[int]) -> list[Any]:
        width = 1 + max(len(d) for d in drafts)
        rows = [[p, *d] + [0] * (width - 1 - len(d)) for p, d in zip(pending, drafts, strict=True)]
        if self.row_hook is not None:
            self.row_hook(self.uids)
        logits = self.model(mx.array(rows, dtype=mx.uint32), cache=self.prompt_cache)
        mx.eval(logits)

        keeps: list[int] = []
        emitted_rows: list[list[int]] = []
        logprob_rows: list[list[mx.array]] = []
        finishes: list[str | None] = []
        next_tokens: list[int] = []
        next_logprobs: list[mx.array] = []
        shared = self._sample_shared(logits, drafts)
        for r, draft in enumerate(drafts):
            sampled, positions = (
                shared[r] if r in shared else self._sample_row(r, logits[r], pending[r], draft)
            )
            accepted = len(sampled) - 1
            emitted = [pending[r], *draft[:accepted]]
            row_logprobs = [self._next_logprobs[r], *positions[:accepted]]
            finish = None
            for i, token in enumerate(emitted):
                self._num_tokens[r] += 1
                if self._num_tokens[r] >= self.max_tokens[r]:
                    finish = "length"
                if self._matchers[r].advance(token):
                    finish = "stop"
                if finish is not None:
                    emitted, row_logprobs = emitted[: i + 1], row_logprobs[: i + 1]
                    break
            drafter = self.drafters.get(self.uids[r])
            if drafter is not None:
                drafter.record(len(draft), len(emitted) - 1, len(emitted))
            keeps.append(len(emitted))
            emitted_rows.append(emitted)
            logprob_rows.append(row_logprobs)
            finishes.append(finish)
            next_tokens.append(sampled[-1])
            next_logprobs.append(positions[accepted])

        self._roll_back(width, keeps)
        if self.draft_rows is not None:
            self.draft_rows.settle({self.uids[r]: e for r, e in enumerate(emitted_rows)})
        for r, emitted in enumerate(emitted_rows):
            self.tokens[r].extend(emitted)
            if self.logits_processors and self.logits_processors[r]:
                self._token_context[r].update_and_fetch(mx.array(emitted, dtype=mx.int32))
        self._next_tokens = mx.array(next_tokens, dtype=mx.uint32)
        self._next_logprobs = next_logprobs
        return self._respond(emitted_rows, logprob_rows, finishes)

    def _sample_shared(
        self, logits: mx.array, drafts: list[list[int]]
    ) -> dict[int, tuple[list[int], list[mx.array]]]:
        """Rows without logits processors whose sampler is shared (not sequential), sampled a
        sampler at a time: one normalisation and one sampler call over all their positions,
        one read back. Each position is still its own draw from its own logprobs, so greedy
        rows get the same tokens and sampled rows the same distribution as row by row. The
        other rows are left to `_sample_row`."""
        groups: dict[int, tuple[Callable[[mx.array], mx.array], list[int]]] = {}
        for r in range(len(drafts)):
            if (self.logits_processors and self.logits_processors[r]) or self._sequential(r):
                continue
            sampler = self._sampler(r)
            groups.setdefault(id(sampler), (sampler, []))[1].append(r)
        out: dict[int, tuple[list[int], list[mx.array]]] = {}
        width = int(logits.shape[1])
        for sampler, rows in groups.values():
            chosen = logits if len(rows) == len(drafts) else logits[mx.array(rows)]
            logprobs = chosen - mx.logsumexp(chosen, axis=-1, keepdims=True)
            flat = sampler(logprobs.reshape(len(rows) * width, -1))
            drawn = cast("list[list[int]]", flat.reshape(len(rows), width).tolist())
            for i, r in enumerate(rows):
                draft = drafts[r]
                sampled: list[int] = []
                for j, token in enumerate(drawn[i][: len(draft) + 1]):
                    sampled.append(token)
                    if j == len(draft) or token != draft[j]:
                        break
                out[r] = sampled, [logprobs[i, j] for j in range(len(sampled))]
        return out

    def _sequential(self, r: int) -> bool:
        plan = self.plans.get(self.uids[r])
        return plan is not None and plan.sequential

    def _sample_row(
        self, r: int, logits: mx.array, pending: int, draft: list[int]
    ) -> tuple[list[int], list[mx.array]]:
        """Tokens drawn at positions 0..accepted (the last one follows the accepted run), and
        the (processed, normalised) logprobs at every position 0..len(draft)."""
        processors: Sequence[Callable[[mx.array, mx.array], mx.array]] = (
            self.logits_processors[r] if self.logits_processors else ()
        ) or ()
        context = mx.array([*self.tokens[r], pending, *draft], dtype=mx.int32)
        base = len(self.tokens[r]) + 1
        positions = []
        for j in range(len(draft) + 1):
            row = logits[j : j + 1]
            for processor in processors:
                row = processor(context[: base + j], row)
            positions.append(row - mx.logsumexp(row, axis=-1, keepdims=True))
        sampler = self._sampler(r)
        sampled: list[int] = []
        if self._sequential(r):
            for j, logprobs in enumerate(positions):  # one call per emitted token, in order
                sampled.append(cast("int", sampler(logprobs).item()))
                if j == len(draft) or sampled[-1] != draft[j]:
                    break
        else:
            drawn = cast("list[int]", sampler(mx.concatenate(positions, axis=0)).tolist())
            for j, token in enumerate(drawn):
                sampled.append(token)
                if j == len(draft) or token != draft[j]:
                    break
        return sampled, [p[0] for p in positions]

    def _sampler(self, r: int) -> Callable[[mx.array], mx.array]:
        sampler: Callable[[mx.array], mx.array] | None = self.samplers[r] if self.samplers else None
        return sampler or self.fallback_sampler

    def _roll_back(self, width: int, keeps: list[int]) -> None:
        """Keep `keeps[r]` of the `width` positions just fed to row r (module docstring)."""
        most = max(keeps)
        garbage = [most - keep for keep in keeps]
        for cache in self.prompt_cache:
            cache.trim(width - most)
            if any(garbage):
                cache._right_padding = mx.array(garbage)
                cache.finalize()
        if any(garbage):
            mx.eval([c.state for c in self.prompt_cache])

    def _respond(
        self, emitted_rows: list[list[int]], logprob_rows: list[list[mx.array]], finishes: list[str | None]
    ) -> list[Any]:
        responses = []
        keep = []
        for r, (emitted, logprobs, finish) in enumerate(
            zip(emitted_rows, logprob_rows, finishes, strict=True)
        ):
            uid = self.uids[r]
            for token, logprob in zip(emitted[:-1], logprobs[:-1], strict=True):
                responses.append(self.Response(uid, token, logprob, None, None, None))
            if finish is None:
                keep.append(r)
                responses.append(self.Response(uid, emitted[-1], logprobs[-1], None, None, None))
            else:
                cache = self.extract_cache(r)
                responses.append(self.Response(uid, emitted[-1], logprobs[-1], finish, cache, self.tokens[r]))
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses
