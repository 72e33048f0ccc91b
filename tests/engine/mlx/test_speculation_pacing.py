"""Speculation that does not pay costs nothing (issue 27): the no-sync plain step, measured costs.

A plain step whose plan is decided before the pending tokens are read keeps mlx-lm's pipeline
(the next forward pass queued while Python handles the last one); reading them (`_pending`)
waits for it. The batch's measured step times replace the seed table where they disagree.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxhost.engine import ModelSpec, SamplingParams
from mlxhost.engine.backends.mlx.backend import MlxBackend, MlxModel
from mlxhost.engine.backends.mlx.batch import MlxBatch
from mlxhost.engine.backends.mlx.drafting import PassCost, SpeculationConfig, plan_widths
from mlxhost.engine.backends.mlx.pacing import RETRY_AFTER, WINDOW, DraftGovernor, MeasuredCost
from mlxhost.engine.backends.mlx.speculative import SpeculativeGenerationBatch

pytestmark = pytest.mark.timeout(300)

COPY = "the baker opened the shop and the baker opened the shop and the baker opened the "
# A wider pass costs 50 times a plain one: no acceptance makes drafting pay.
DEAR = SpeculationConfig(cost=PassCost({1: {1: 1.0, 2: 50.0, 64: 3200.0}}), measure=False)
FLAT = SpeculationConfig(cost=PassCost({1: {1: 1.0, 64: 1.0}}), measure=False)


@pytest.fixture(scope="module")
def backend(tiny_model_dir) -> MlxModel:
    return MlxBackend().load(ModelSpec(1, str(tiny_model_dir), "f" * 64), lambda *_: None)


def generate(backend: MlxModel, config: SpeculationConfig | None, monkeypatch: Any) -> tuple[list[int], int]:
    """Two greedy rows of the copy prompt to the end; (row 0's tokens, pending-token reads)."""
    reads = 0
    pending = SpeculativeGenerationBatch._pending

    def counting(self: SpeculativeGenerationBatch) -> list[int]:
        nonlocal reads
        reads += 1
        return pending(self)

    monkeypatch.setattr(SpeculativeGenerationBatch, "_pending", counting)
    batch = MlxBatch(backend._model, backend._tokenizer, 2, speculation=config)
    sampling = SamplingParams(temperature=0.0, max_tokens=40)
    handles = [batch.insert(backend.encode(COPY * 2), sampling, None, 0) for _ in range(2)]
    tokens: dict[int, list[int]] = {h: [] for h in handles}
    ended: set[int] = set()
    while len(ended) < len(handles):
        for step in batch.step():
            if step.token_id is not None:
                tokens[step.handle].append(step.token_id)
            if step.finish_reason is not None:
                ended.add(step.handle)
    batch.close()
    return tokens[handles[0]], reads


def test_rows_that_cannot_pay_never_read_the_pending_token(backend, monkeypatch):
    """Where no pass could pay, every step is mlx-lm's pipelined one: the pending tokens are
    never read ahead of it, and the text is the same. The flat table, where drafting always
    pays, reads them (the spy sees reads when there are any)."""
    off, _ = generate(backend, None, monkeypatch)
    dear, dear_reads = generate(backend, DEAR, monkeypatch)
    flat, flat_reads = generate(backend, FLAT, monkeypatch)
    assert dear == off == flat
    assert dear_reads == 0
    assert flat_reads > 0


def test_measured_verify_passes_that_do_not_pay_stop_drafting():
    """The table says a 5-token pass at 8 rows pays for well-accepted drafts; once such passes
    are measured at 3 times a plain step, the same rows plan plain steps."""
    table = PassCost()
    cost = MeasuredCost(table)
    rows, acceptances, available = 8, [0.6] * 8, [8] * 8
    assert max(plan_widths(cost, acceptances, available, 8)) > 0
    for _ in range(3):
        cost.record(1, rows, 0.100)
        for width in range(2, 10):
            cost.record(width, rows, 0.300 + 0.01 * width)
    assert max(plan_widths(cost, acceptances, available, 8)) == 0
    # Unmeasured rows counts scale from the nearest measured ones.
    assert cost(5, 7) > 2 * cost(1, 7)


def test_measured_verify_costs_drift_back_so_the_batch_probes_again():
    cost = MeasuredCost(PassCost())
    for _ in range(3):
        cost.record(1, 8, 0.100)
    cost.record(3, 8, 0.400)
    before = cost(3, 8)
    for _ in range(600):
        cost.record(1, 8, 0.100)
    after = cost(3, 8)
    assert after < before
    assert after == pytest.approx(100 * PassCost()(3, 8) / PassCost()(1, 8), rel=0.05)


def test_hit_rates_weigh_the_optimistic_plan():
    """Planned before the drafts are known, a row that rarely finds one counts for little."""
    table = PassCost()
    assert max(plan_widths(table, [0.7] * 4, [8] * 4, 8)) > 0
    assert max(plan_widths(table, [0.7] * 4, [8] * 4, 8, hits=[0.05] * 4)) == 0


def test_a_verify_pass_timed_before_any_plain_step_is_priced_against_the_measured_one():
    """On a loaded machine every step takes twice the table's time. A verify pass timed before
    any plain step is not read as twice the table's ratio: it waits for the plain step's time,
    and its ratio is to that."""
    table = PassCost()
    cost = MeasuredCost(table)
    plain_ms = 2 * table(1, 4)
    cost.record(2, 4, 1.3 * plain_ms / 1000)
    assert cost(2, 4) / cost(1, 4) == pytest.approx(table(2, 4) / table(1, 4))  # not priced yet
    for _ in range(3):
        cost.record(1, 4, plain_ms / 1000)
    assert cost(1, 4) == pytest.approx(plain_ms)
    assert cost(2, 4) / cost(1, 4) == pytest.approx(1.3)


def test_one_odd_interval_moves_a_plain_estimate_but_never_makes_it():
    """A first plain interval of almost nothing (a step whose tokens were already computed) is
    not taken as the plain step's cost, and the verify ratios are not priced against it."""
    table = PassCost()
    cost = MeasuredCost(table)
    cost.record(3, 4, 2 * table(3, 4) / 1000)
    cost.record(1, 4, 0.0002)  # 0.2 ms
    assert cost(1, 4) == table(1, 4)
    for _ in range(3):
        cost.record(1, 4, 2 * table(1, 4) / 1000)
    assert cost(1, 4) == pytest.approx(2 * table(1, 4))
    assert cost(3, 4) / cost(1, 4) == pytest.approx(table(3, 4) / table(1, 4))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_windows(governor, clock: FakeClock, rows: int, windows: int, rate: dict[bool, float]) -> list[bool]:
    """Steps of one token per row, each taking rows / rate[mode] seconds; the mode of each step."""
    modes = []
    for _ in range(windows * (WINDOW + 1)):
        allowed = governor.allowed(rows)
        modes.append(allowed)
        clock.now += rows / rate[allowed]
        governor.stepped(rows, drafted=allowed)
    return modes


def test_the_governor_stops_drafting_where_the_realised_rate_is_lower_and_retries_it():
    """Drafting allowed first; once its windows realise fewer tokens per second than plain ones,
    plain steps run, and drafting gets one window again after RETRY_AFTER."""
    clock = FakeClock()
    governor = DraftGovernor(clock)
    modes = run_windows(governor, clock, 4, 40, {True: 20.0, False: 30.0})
    assert modes[0] is True
    tail = modes[len(modes) // 2 :]
    share = sum(tail) / len(tail)
    assert 0 < share <= 1.5 / (RETRY_AFTER + 1)  # drafting only in its retry windows


def test_the_governor_keeps_drafting_where_it_pays_and_learns_per_rows():
    clock = FakeClock()
    governor = DraftGovernor(clock)
    modes = run_windows(governor, clock, 1, 40, {True: 25.0, False: 12.0})
    tail = modes[len(modes) // 2 :]
    assert sum(tail) / len(tail) >= 1 - 1.5 / (RETRY_AFTER + 1)
    # At 4 rows nothing is known yet: drafting is tried first there too.
    assert governor.allowed(4) is True


def test_a_prefill_or_a_rows_change_is_not_counted_in_a_window():
    """A window interrupted by a prefill (or rows joining or leaving) restarts: its long step
    never makes drafting look slow."""
    clock = FakeClock()
    governor = DraftGovernor(clock)
    for step in range(3 * WINDOW):
        assert governor.allowed(2) is True
        clock.now += 0.1
        if step % (WINDOW // 2) == 0:
            clock.now += 30.0  # a prefill, then the batch says so
            governor.interrupt()
        governor.stepped(2, drafted=True)
    assert governor._rates == {}


def test_windows_where_the_plan_drafted_nothing_count_as_plain_ones():
    """Drafting allowed, but no pass drafted (rows that never draft): those windows are plain
    ones, and drafting stays allowed until a window with a verify pass says what it gives."""
    clock = FakeClock()
    governor = DraftGovernor(clock)
    for _ in range(5 * (WINDOW + 1)):
        assert governor.allowed(3) is True
        clock.now += 0.1
        governor.stepped(3, drafted=False)
    assert set(governor._rates) == {(3, False)}
