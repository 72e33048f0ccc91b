"""Drafting for speculative decoding (issue 27): n-gram lookup, predictions, and the width plan."""

from __future__ import annotations

from mlxhost.engine.backends.mlx.drafting import (
    CPU_PASS_MS,
    NgramIndex,
    PassCost,
    PredictionAligner,
    RowDrafter,
    SpeculationConfig,
    expected_tokens,
    plan_widths,
)


def test_the_latest_longest_match_drafts_what_followed_it():
    index = NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3], min_n=1, max_n=4)
    assert index.draft(3) == [5, 6, 2]  # "2 3" last followed by 5 (the latest occurrence)
    assert index.draft(0) == []
    index = NgramIndex([1, 2, 3, 4, 1, 2], max_n=4)
    assert index.draft(5) == [3, 4, 1, 2]  # runs up to the list's end


def test_a_pending_token_is_looked_up_without_being_indexed():
    index = NgramIndex([7, 8, 9, 7], max_n=3)
    assert index.draft(2, pending=8) == [9, 7]  # "7 8" occurred before
    assert index.tokens == [7, 8, 9, 7]
    assert NgramIndex([5, 6], max_n=3).draft(2, pending=1) == []


def test_nothing_matches_in_text_that_never_repeats():
    assert NgramIndex(list(range(50))).draft(4) == []


def test_a_prediction_drafts_ahead_and_realigns_after_a_divergence():
    aligner = PredictionAligner([10, 11, 12, 13, 14, 15, 16])
    assert aligner.draft(3) == [10, 11, 12]
    output = [10, 11]
    aligner.observe(output, 2)
    assert aligner.draft(2) == [12, 13]
    output += [99, 14]  # the model replaced 12 13 by 99, then rejoined at 14
    aligner.observe(output, 2)
    assert aligner.draft(2) == [15, 16]


def test_a_row_drafts_from_its_prediction_first_then_from_its_own_tokens():
    config = SpeculationConfig()
    drafter = RowDrafter(config, [1, 2, 3, 1, 2], prediction=[3, 4, 5])
    assert drafter.draft(4, pending=3) == [4, 5]
    plain = RowDrafter(config, [1, 2, 3, 1, 2])
    assert plain.draft(4, pending=3) == [1, 2, 3]  # "2 3" -> 1 2, then the pending 3 itself


def test_acceptance_follows_results_and_stats_count_them():
    drafter = RowDrafter(SpeculationConfig(), [1, 2])
    start = drafter.acceptance
    drafter.record(4, 4, 5)
    assert drafter.acceptance > start
    for _ in range(6):  # a rejection at the first position tries one position only
        drafter.record(4, 0, 1)
    assert drafter.acceptance < start
    assert (drafter.stats.drafted, drafter.stats.accepted, drafter.stats.passes) == (28, 4, 7)
    assert drafter.stats.tokens_per_pass == 11 / 7


def test_the_cost_table_interpolates_and_extrapolates():
    cost = PassCost()
    assert cost(1, 1) == CPU_PASS_MS[1][1]
    assert cost(9, 4) == CPU_PASS_MS[4][9]
    assert CPU_PASS_MS[1][4] < cost(6, 1) < CPU_PASS_MS[1][8]
    assert cost(1, 1) < cost(1, 2) < cost(1, 4) < cost(1, 8)


def test_the_width_is_zero_where_drafting_does_not_pay_and_shrinks_with_rows():
    cost = PassCost()
    assert plan_widths(cost, [0.05], [8], 8) == [0]  # rarely accepted: not worth a wider pass
    assert plan_widths(cost, [0.95], [0], 8) == [0]  # nothing to draft
    one = plan_widths(cost, [0.7], [8], 8)[0]
    assert one > 0
    assert max(plan_widths(cost, [0.7] * 8, [8] * 8, 8)) < one  # more rows, a narrower pass
    assert plan_widths(cost, [0.99, 0.0], [8, 8], 8)[1] == 0  # per row: the failing row drafts nothing
    assert expected_tokens(0.5, 2) == 1.75


def test_the_aligner_counts_the_prediction_tokens_the_output_reproduced_in_order():
    """OpenAI's accepted_prediction_tokens: prediction tokens that appeared in the output, each
    once, in order, however they were drafted; never the drafts themselves."""
    exact = PredictionAligner([1, 2, 3, 4])
    output: list[int] = []
    for token in [1, 2, 3, 4, 0]:  # the prediction, then an end token it never had
        output.append(token)
        exact.observe(output, 1)
    assert exact.reproduced == 4

    unrelated = PredictionAligner([1, 2, 3, 4])
    output = []
    for token in [7, 8, 9]:
        output.append(token)
        unrelated.observe(output, 1)
    assert unrelated.reproduced == 0

    # A detour and a repeat: realigning after the detour counts on; going back counts nothing twice.
    detour = PredictionAligner([1, 2, 3, 4, 5])
    output = []
    for token in [1, 2, 9, 3, 4, 1, 2]:
        output.append(token)
        detour.observe(output, 1)
    assert detour.reproduced == 4
