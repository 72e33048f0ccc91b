"""What a decode step really costs this batch: `PassCost`'s table, corrected by the clock.

`plan_widths` (drafting.py) prices a pass by its width and rows. The seed table was measured
once, for 1 and 4 rows, forward pass alone; a live batch also pays Python (sampling, the
stop matchers, the cache roll-back) and runs at whatever speed the machine has now. So each
`SpeculativeGenerationBatch` keeps a `MeasuredCost`: the wall time of its own steps, by
(rows, tokens per row), as an exponentially weighted mean, from one step's start to the
next's. Plain steps are timed only in a run of plain steps (mlx-lm pipelines them: the
interval is the step's real throughput cost); a verify pass from the moment its pending tokens
are known (any pipelined plain step has finished by then) to the next step's start, so it
carries its own Python and the bubble it leaves in the pipeline.

A verify pass is kept as its ratio to the plain step measured at the same rows (the load moves
both). Unmeasured entries are the table's, scaled by the nearest measured one. Verify ratios
drift back towards the table's (`DRIFT` per plain step), so a batch whose passes stopped paying
tries one again now and then, and notices when they pay again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxhost.engine.backends.mlx.drafting import PassCost

# Weight of a new measurement in the mean; a sample is clipped to CLIP times the current value
# (a prefill or a pause between two steps is not the step's cost), and a plain one under 1/CLIP
# of it is dropped (nor is a step that found its tokens already computed).
WEIGHT = 0.25
CLIP = 3.0
# Plain steps timed before a verify pass's time is read as a ratio to theirs.
PRICE_AFTER = 3
# Per plain step, how far each verify entry at those rows moves back towards the table's ratio
# (half-way in some 70 plain steps: one unlucky sample does not stop drafting for long).
DRIFT = 0.01


class MeasuredCost:
    """`PassCost`'s interface (`cost(width, rows)`, ms), learnt from this batch's own steps.

    Plain steps are kept in ms; a verify pass as its ratio to the plain step at the same rows
    measured at the time, so that the machine's load, which moves both, does not bias one
    against the other."""

    __slots__ = ("_plain", "_plain_samples", "_ratio", "_unpriced", "table")

    def __init__(self, table: PassCost) -> None:
        self.table = table
        self._plain: dict[int, float] = {}  # rows -> ms of a plain step
        self._ratio: dict[tuple[int, int], float] = {}  # (rows, width) -> verify ms / plain ms
        # Verify passes timed before PRICE_AFTER plain steps: kept in ms until then, since a ratio
        # to the table's plain time (or to one odd plain interval) would carry the machine's load
        # as if it were the pass's own cost.
        self._unpriced: dict[tuple[int, int], float] = {}
        self._plain_samples = 0

    def __call__(self, width: int, rows: int) -> float:
        plain = self._plain.get(rows)
        if plain is None:
            plain = self.table(1, rows) * self._plain_scale(rows)
        if width == 1:
            return plain
        ratio = self._ratio.get((rows, width))
        if ratio is None:
            ratio = self._table_ratio(width, rows) * self._ratio_scale(width, rows)
        return plain * ratio

    def _table_ratio(self, width: int, rows: int) -> float:
        return self.table(width, rows) / self.table(1, rows)

    def _plain_scale(self, rows: int) -> float:
        if not self._plain:
            return 1.0
        nearest = min(self._plain, key=lambda r: abs(r - rows))
        return self._plain[nearest] / self.table(1, nearest)

    def _ratio_scale(self, width: int, rows: int) -> float:
        best: tuple[int, int] | None = None
        scale = 1.0
        for (r, w), ratio in self._ratio.items():
            distance = (abs(r - rows), abs(w - width))
            if best is None or distance < best:
                best, scale = distance, ratio / self._table_ratio(w, r)
        return scale

    def record(self, width: int, rows: int, seconds: float) -> None:
        ms = seconds * 1000.0
        if width == 1:
            old = self._plain.get(rows)
            current = self(1, rows) if old is None else old
            if ms < current / CLIP:
                return  # a step whose tokens were already computed: no step's cost
            ms = min(ms, current * CLIP)
            self._plain[rows] = ms if old is None else old + (ms - old) * WEIGHT
            for (r, w), ratio in self._ratio.items():
                if r == rows:
                    self._ratio[(r, w)] = ratio + (self._table_ratio(w, r) - ratio) * DRIFT
            self._plain_samples += 1
            if self._plain_samples == PRICE_AFTER:
                unpriced, self._unpriced = self._unpriced, {}
                for (r, w), verify_ms in unpriced.items():
                    self._verified((r, w), verify_ms / self(1, r))
            return
        if self._plain_samples < PRICE_AFTER:
            self._unpriced[(rows, width)] = ms
            return
        self._verified((rows, width), ms / self(1, rows))

    def _verified(self, key: tuple[int, int], ratio: float) -> None:
        old_ratio = self._ratio.get(key)
        if old_ratio is None:
            self._ratio[key] = ratio
        else:
            self._ratio[key] = old_ratio + (min(ratio, old_ratio * CLIP) - old_ratio) * WEIGHT


class StepClock:
    """Times a batch's steps for a `MeasuredCost` (module docstring)."""

    __slots__ = ("_kind", "_since", "cost")

    def __init__(self, cost: MeasuredCost) -> None:
        self.cost = cost
        self._since: float | None = None
        self._kind: tuple[int, int] | None = None  # (width, rows) of the step being timed

    def step(self, width: int, rows: int, *, pipelined: bool) -> None:
        """A step of `width` tokens per row over `rows` rows starts now (for a verify pass: its
        pending tokens are known). `pipelined`: a plain step following a plain step."""
        now = time.perf_counter()
        if self._since is not None and self._kind is not None:
            self.cost.record(self._kind[0], self._kind[1], now - self._since)
        self._since = now
        self._kind = (width, rows) if width > 1 or pipelined else None

    def interrupt(self) -> None:
        """Rows joined or the caller did other work: the running interval is not a step's cost."""
        self._since, self._kind = None, None


# `DraftGovernor`: steps per window, the weight of a window's rate in its mode's mean, and how
# many windows pass before the mode that lost is tried again for one window.
WINDOW = 16
RATE_WEIGHT = 0.3
RETRY_AFTER = 8


class DraftGovernor:
    """Whether this batch may draft at all: what its own steps realised decides, not the plan.

    `MeasuredCost` prices the passes the plan compares, but not everything drafting costs: the
    pending-token read that empties mlx-lm's pipeline, the next plain step that runs without it,
    the cache roll-back evaluated in a later step. So the batch's steps are also counted in windows
    of WINDOW steps at one rows count, tokens emitted per second of wall time, with a verify pass
    in the window or none, each kind kept as a weighted mean per rows count. The better mode
    runs; the other gets one window again after RETRY_AFTER (the text, the load and the rows
    change what pays). A change of rows or a prefill starts a new window: neither is a step's cost.
    """

    __slots__ = (
        "_allowed",
        "_clock",
        "_drafted",
        "_rates",
        "_rows",
        "_since",
        "_steps",
        "_tokens",
        "_windows",
    )

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._rates: dict[tuple[int, bool], float] = {}  # (rows, a verify pass in the window) -> tokens/s
        self._rows = 0
        self._allowed = True
        self._since: float | None = None
        self._steps = 0
        self._tokens = 0
        self._drafted = False  # a verify pass ran in this window: it counts as a drafting one
        self._windows = 0  # windows run since the losing mode was last tried

    def allowed(self, rows: int) -> bool:
        """Whether the next step, over `rows` rows, may draft."""
        if rows != self._rows:
            self._rows = rows
            self.interrupt()
            self._allowed = self._choice()
        return self._allowed

    def stepped(self, tokens: int, *, drafted: bool) -> None:
        """The step just run emitted `tokens` (over every row); `drafted`: it was a verify pass.
        A window with drafting allowed but no verify pass (the plan found nothing worth it) is a
        plain one."""
        now = self._clock()
        if self._since is None:  # the window's clock starts at the end of its first step
            self._since = now
            return
        self._steps += 1
        self._tokens += tokens
        self._drafted = self._drafted or drafted
        if self._steps < WINDOW:
            return
        rate = self._tokens / max(now - self._since, 1e-9)
        key = (self._rows, self._drafted)
        old = self._rates.get(key)
        self._rates[key] = rate if old is None else old + (rate - old) * RATE_WEIGHT
        self._windows += 1
        self._allowed = self._choice()
        self._since, self._steps, self._tokens, self._drafted = now, 0, 0, False

    def interrupt(self) -> None:
        """Rows joined (a prefill ran) or left: the running window is not the steps' cost."""
        self._since, self._steps, self._tokens, self._drafted = None, 0, 0, False

    def _choice(self) -> bool:
        drafting, plain = self._rates.get((self._rows, True)), self._rates.get((self._rows, False))
        if drafting is None:
            return True  # drafting allowed until a window with a verify pass says what it gives
        if plain is None:
            return False
        best = drafting >= plain
        if self._windows >= RETRY_AFTER:
            self._windows = 0
            return not best
        return best
