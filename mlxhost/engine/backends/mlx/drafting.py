"""Draft tokens for speculative decoding: prompt lookup, predictions, and how many to try.

Pure Python, no MLX: what a row drafts and how wide a verify pass should be. The batch step
that checks the drafts against the model is `speculative.py`.

- `NgramIndex` finds the last n tokens (n = `max_ngram` down to `min_ngram`) of a row earlier
  in that row's own prompt and output, and proposes the tokens that followed the most recent
  earlier occurrence. Only the row's own tokens are ever indexed: nothing crosses requests.
- `PredictionAligner` follows an explicit prediction (OpenAI Predicted Outputs): while the
  output agrees with the prediction it drafts the prediction's next tokens; after a
  divergence it re-anchors on the output's last tokens found in the prediction.
- `PassCost` is the measured cost of one forward pass by width (tokens per row) and rows.
- `plan_widths` chooses each row's k from the cost of a pass and each row's recent acceptance:
  the pass width that maximises expected tokens per unit of cost, 0 where drafting does not pay.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxhost.engine.backends.base import DraftCounts

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

# One forward pass of the demo model (SmolLM2-135M float32, 2 CPU cores, 300-token cache), ms by
# tokens per row in the pass, for 1 and 4 rows: issue 27's table (best of 7, medians within 4 %).
CPU_PASS_MS: dict[int, dict[int, float]] = {
    1: {1: 73, 2: 86, 4: 115, 8: 130, 9: 146, 16: 146},
    4: {1: 128, 2: 147, 4: 159, 8: 245, 9: 310, 16: 409},
}


# Per plain pass, how far a row's acceptance estimate moves back towards its prior: a row that
# stopped drafting probes again (one token) some 30 passes later, under 1 % of its passes.
RECOVERY = 0.001


# Weight kept by a row's hit rate (lookups that found a draft) per lookup.
HIT_DECAY = 0.9


# How far past its last agreement a diverged prediction is searched token by token before the
# n-gram index (latest occurrence anywhere) is asked: bounds the per-step cost of a long one.
REALIGN_WINDOW = 256


@dataclass(frozen=True, slots=True)
class PassCost:
    """Cost of one batched forward pass, interpolated from a measured table.

    `table[rows][width]` is the time of a pass of `rows` rows by `width` tokens each (any unit:
    only ratios matter). Widths between measured ones are interpolated linearly, rows likewise;
    past the largest measured rows the cost grows linearly with the rows.
    """

    table: dict[int, dict[int, float]] = field(default_factory=lambda: CPU_PASS_MS)

    def __call__(self, width: int, rows: int) -> float:
        counts = sorted(self.table)
        if rows <= counts[0]:
            return _interpolate(self.table[counts[0]], width)
        for low, high in itertools.pairwise(counts):
            if rows <= high:
                a, b = _interpolate(self.table[low], width), _interpolate(self.table[high], width)
                return a + (b - a) * (rows - low) / (high - low)
        if len(counts) == 1:
            return _interpolate(self.table[counts[0]], width) * rows / counts[0]
        low, high = counts[-2], counts[-1]
        a, b = _interpolate(self.table[low], width), _interpolate(self.table[high], width)
        return b + (b - a) * (rows - high) / (high - low)


def _interpolate(points: dict[int, float], width: int) -> float:
    widths = sorted(points)
    if width <= widths[0]:
        return points[widths[0]]
    if width >= widths[-1]:
        # Past the table: grows with the tokens at the last measured rate per token.
        last = widths[-1]
        return points[last] * width / last
    i = bisect_left(widths, width)
    low, high = widths[i - 1], widths[i]
    if high == width:
        return points[high]
    return points[low] + (points[high] - points[low]) * (width - low) / (high - low)


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """How a batch speculates. `max_draft` caps k per row; `cost` prices a pass; n-grams of
    `min_ngram`..`max_ngram` tokens are looked up; acceptance starts at `prior` (weight
    `prior_weight` drafted tokens) and then follows the row's own results, older ones decaying
    by `decay` per pass. A row with a prediction may draft up to `prediction_max_draft`."""

    max_draft: int = 8
    # Rows with an explicit prediction may draft up to this many (still under max_draft's
    # alias cap when one is set): a right prediction fills a 17-token pass that costs the
    # same as a 9-token one at 1 row.
    prediction_max_draft: int = 16
    min_ngram: int = 1
    max_ngram: int = 6
    cost: PassCost = field(default_factory=PassCost)
    prior: float = 0.5
    prediction_prior: float = 0.8
    prior_weight: float = 4.0
    decay: float = 0.9
    # Plan with this batch's measured step times (pacing.py), `cost` only as their seed.
    measure: bool = True


class NgramIndex:
    """Latest continuation of every n-gram (n in `min_n..max_n`) of a growing token list.

    `extend` indexes new tokens; `draft(k)` matches the list's last n tokens, longest n first,
    against their most recent earlier occurrence and returns up to k tokens that followed it.
    """

    __slots__ = ("_index", "_max_n", "_min_n", "tokens")

    def __init__(self, tokens: Sequence[int] = (), *, min_n: int = 1, max_n: int = 6) -> None:
        self.tokens: list[int] = []
        self._min_n, self._max_n = min_n, max_n
        # n-gram -> index in `tokens` of the token that followed its latest occurrence
        self._index: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the new token's index: it continues the n-grams ending before it
            for n in range(self._min_n, min(self._max_n, end) + 1):
                self._index[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def draft(self, k: int, pending: int | None = None) -> list[int]:
        """Up to k tokens after the list's end, or after the list plus `pending` (a token about
        to join it, not indexed)."""
        if k <= 0:
            return []
        tokens = self.tokens if pending is None else [*self.tokens[-self._max_n :], pending]
        end = len(tokens)
        for n in range(min(self._max_n, end), self._min_n - 1, -1):
            start = self._index.get(tuple(tokens[end - n :]))
            if start is not None:
                run = self.tokens[start : start + k]
                if pending is not None and len(run) < k and start + len(run) == len(self.tokens):
                    run.append(pending)  # the occurrence runs into the pending token itself
                return run[:k]
        return []


class PredictionAligner:
    """Drafts from an explicit prediction of the output, aligned with the output so far.

    `reproduced` counts the prediction's tokens the output reproduced in order (each at most
    once, never going back): OpenAI's `accepted_prediction_tokens`."""

    __slots__ = ("_anchor", "_index", "_max_n", "_position", "_reached", "prediction", "reproduced")

    def __init__(self, prediction: Sequence[int], *, max_n: int = 8) -> None:
        self.prediction = list(prediction)
        self._position: int | None = 0  # index in the prediction of the next output token
        self._anchor = 0  # where the last alignment ended: re-anchoring prefers what follows
        self._max_n = max_n
        self.reproduced = 0
        self._reached = 0  # the prediction's index after the last token counted in `reproduced`
        self._index = NgramIndex(self.prediction, min_n=1, max_n=max_n)

    def observe(self, output: Sequence[int], new: int) -> None:
        """`new` tokens were appended to `output` (all generated tokens so far)."""
        for token in output[len(output) - new :]:
            position = self._position
            if (
                position is not None
                and position < len(self.prediction)
                and self.prediction[position] == token
            ):
                self._position = position + 1
                self._anchor = position + 1
                if position >= self._reached:
                    self.reproduced += 1
                    self._reached = position + 1
            else:
                self._position = None
        if self._position is None:
            self._position = self._realign(output)
            if self._position is not None and self._position > self._reached:
                self.reproduced += 1  # the output's last token, found again in the prediction
                self._reached = self._position

    def _realign(self, output: Sequence[int]) -> int | None:
        prediction = self.prediction
        for n in range(min(self._max_n, len(output)), 0, -1):
            tail = list(output[len(output) - n :])
            # the first occurrence within a window after the last anchor, else the latest anywhere
            first = max(0, self._anchor - n)
            for start in range(first, min(first + REALIGN_WINDOW, len(prediction) - n + 1)):
                if prediction[start : start + n] == tail:
                    return start + n
            if n >= 2:
                found = self._index._index.get(tuple(tail))
                if found is not None:
                    return found
        return None

    def draft(self, k: int) -> list[int]:
        if self._position is None or k <= 0:
            return []
        return self.prediction[self._position : self._position + k]


class RowDrafter:
    """One row's drafting: its tokens (prompt + output), an optional prediction, its acceptance.

    `observe` is told the tokens each step emitted; `draft(k)` proposes up to k next tokens
    given the row's last token; `record(drafted, accepted)` updates the acceptance estimate.
    """

    __slots__ = (
        "_accepted",
        "_drafted",
        "_follows",
        "_generated",
        "config",
        "hit",
        "index",
        "prediction",
        "stats",
    )

    def __init__(
        self,
        config: SpeculationConfig,
        tokens: Sequence[int],
        prediction: Sequence[int] | None = None,
        *,
        aligner: PredictionAligner | None = None,
    ) -> None:
        """`aligner`: a prediction's aligner that its owner keeps up with the output (the batch
        follows every row's prediction for its usage counts); it is read here, not observed
        again. Else `prediction` gets an aligner of this drafter's own."""
        self.config = config
        self.index = NgramIndex(tokens, min_n=config.min_ngram, max_n=config.max_ngram)
        self.prediction = aligner or (PredictionAligner(prediction) if prediction else None)
        self._follows = aligner is None  # observe the prediction here: nobody else does
        self._generated: list[int] = []
        prior = config.prediction_prior if self.prediction is not None else config.prior
        self._accepted = prior * config.prior_weight
        self._drafted = config.prior_weight
        self.hit = 1.0  # recent share of lookups that found a draft (see `looked_up`)
        self.stats = DraftCounts()

    @property
    def acceptance(self) -> float:
        """Estimated chance that a drafted token is accepted, given the ones before it were."""
        return self._accepted / self._drafted

    def observe(self, tokens: Sequence[int]) -> None:
        """The row fed (and emitted) `tokens` since the last call."""
        if not tokens:
            return
        self.index.extend(tokens)
        self._generated.extend(tokens)
        if self.prediction is not None and self._follows:
            self.prediction.observe(self._generated, len(tokens))

    def draft(self, k: int, pending: int) -> list[int]:
        """Up to k tokens expected after `pending`, the sampled token not yet fed."""
        if k <= 0:
            return []
        if self.prediction is not None:
            aligned = _after(self.prediction, self._generated, pending, k)
            if aligned:
                return aligned
        return self.index.draft(k, pending)

    def predicted(self, k: int, pending: int) -> list[int]:
        """Up to k tokens of the prediction after `pending`, where it aligns (no prompt lookup)."""
        if k <= 0 or self.prediction is None:
            return []
        return _after(self.prediction, self._generated, pending, k)

    def looked_up(self, found: bool) -> None:
        """A lookup (after the pending token) found a draft or not: the hit rate's mean."""
        self.hit = self.hit * HIT_DECAY + (1.0 - HIT_DECAY) * found

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        self.stats.passes += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stats.emitted += emitted
        if not drafted:
            # Not drafting teaches nothing: drift back towards the prior, so that a row whose
            # text turns repetitive later is tried again (see RECOVERY).
            prior = self.config.prediction_prior if self.prediction is not None else self.config.prior
            self._accepted += (prior * self._drafted - self._accepted) * RECOVERY
            self.hit += (1.0 - self.hit) * RECOVERY
        else:
            # Count the positions that were actually tried: the first rejection ends the run.
            tried = min(drafted, accepted + 1)
            decay = self.config.decay
            self._accepted = self._accepted * decay + accepted
            self._drafted = self._drafted * decay + tried


def _after(aligner: PredictionAligner, generated: list[int], pending: int, k: int) -> list[int]:
    """The prediction's tokens after `generated + [pending]`, without committing `pending`."""
    position = aligner._position
    if (
        position is not None
        and position < len(aligner.prediction)
        and aligner.prediction[position] == pending
    ):
        return aligner.prediction[position + 1 : position + 1 + k]
    probe = PredictionAligner.__new__(PredictionAligner)
    probe.prediction, probe._anchor, probe._max_n, probe._index = (
        aligner.prediction,
        aligner._anchor,
        aligner._max_n,
        aligner._index,
    )
    found = probe._realign([*generated, pending])
    return [] if found is None else aligner.prediction[found : found + k]


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a pass yields for a row drafting k with per-token acceptance `acceptance`: the
    accepted run plus the model's own next token, 1 + a + a^2 + ... + a^k."""
    return sum(acceptance**i for i in range(k + 1))


def plan_widths(
    cost: Callable[[int, int], float],
    acceptances: Sequence[float],
    available: Sequence[int],
    cap: int,
    hits: Sequence[float] | None = None,
) -> list[int]:
    """Drafts per row for the next pass: each row's k, 0 where drafting does not pay.

    `acceptances[r]` is row r's acceptance estimate, `available[r]` how many tokens it could
    draft (its draft's length, already capped by its remaining max_tokens). Every row of a
    pass pays for its widest row, so the pass width K is chosen for the whole batch: the K
    maximising expected tokens per cost, with row r drafting min(K, available[r], its own best
    k alone). K = 0 (a plain one-token step) unless some K beats it; as rows grow a wide pass
    costs more, so K shrinks. `hits[r]` (default 1) is the chance that row r has a draft at
    all: planning before the drafts are known (`available` = each row's limit) weighs each
    row's gain by it.
    """
    rows = len(available)
    if rows == 0:
        return []
    chances = hits if hits is not None else [1.0] * rows
    own = [
        _best_alone(cost, a, min(n, cap), h) for a, n, h in zip(acceptances, available, chances, strict=True)
    ]
    best_width, best_rate = 0, rows / cost(1, rows)
    for width in range(1, max(own, default=0) + 1):
        gain = sum(
            1 + h * (expected_tokens(a, min(width, k)) - 1)
            for a, k, h in zip(acceptances, own, chances, strict=True)
        )
        rate = gain / cost(width + 1, rows)
        if rate > best_rate * 1.0001:
            best_width, best_rate = width, rate
    return [min(best_width, k) for k in own]


def _best_alone(cost: Callable[[int, int], float], acceptance: float, limit: int, hit: float = 1.0) -> int:
    best, best_rate = 0, 1 / cost(1, 1)
    for k in range(1, limit + 1):
        rate = (1 + hit * (expected_tokens(acceptance, k) - 1)) / cost(k + 1, 1)
        if rate > best_rate * 1.0001:
            best, best_rate = k, rate
    return best
