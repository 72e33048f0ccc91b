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

Unmeasured entries are the table's, scaled by the measured/table ratio of the nearest
measured width at the same rows (else of the nearest rows). Verify entries drift back
towards the table's ratio to the measured plain step (`DRIFT` per plain step), so a batch
whose passes stopped paying tries one again now and then, and notices when they pay again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxhost.engine.backends.mlx.drafting import PassCost

# Weight of a new measurement in the mean; a sample is clipped to CLIP times the current value
# (a prefill or a pause between two steps is not the step's cost).
WEIGHT = 0.25
CLIP = 3.0
# Per plain step, how far each verify entry at those rows moves back towards the table's ratio.
DRIFT = 0.003


class MeasuredCost:
    """`PassCost`'s interface (`cost(width, rows)`, ms), learnt from this batch's own steps."""

    __slots__ = ("_seen", "table")

    def __init__(self, table: PassCost) -> None:
        self.table = table
        self._seen: dict[tuple[int, int], float] = {}  # (rows, width) -> ms

    def __call__(self, width: int, rows: int) -> float:
        seen = self._seen.get((rows, width))
        if seen is not None:
            return seen
        return self.table(width, rows) * self._scale(width, rows)

    def _scale(self, width: int, rows: int) -> float:
        best: tuple[int, int] | None = None
        scale = 1.0
        for (r, w), ms in self._seen.items():
            distance = (abs(r - rows), abs(w - width))
            if best is None or distance < best:
                best, scale = distance, ms / self.table(w, r)
        return scale

    def record(self, width: int, rows: int, seconds: float) -> None:
        ms = seconds * 1000.0
        key = (rows, width)
        old = self._seen.get(key)
        if old is None:
            self._seen[key] = ms
            return
        ms = min(ms, old * CLIP)
        self._seen[key] = old + (ms - old) * WEIGHT
        if width == 1:
            plain = self._seen[key]
            base = self.table(1, rows)
            for (r, w), value in self._seen.items():
                if r == rows and w > 1:
                    target = plain * self.table(w, rows) / base
                    self._seen[(r, w)] = value + (target - value) * DRIFT


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
