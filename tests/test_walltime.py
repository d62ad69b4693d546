"""benchmarks.walltime: convergence curves read at the tokens each mode gets through in the same wall time."""

import pytest

from benchmarks.walltime import equal_time_ratio, link_figures, loss_at, summarize

CURVE = {0: 6.0, 100: 4.0, 200: 3.0, 300: 2.5}


def test_the_loss_between_two_points_is_read_on_the_line_between_them():
    assert loss_at(CURVE, 100) == 4.0
    assert loss_at(CURVE, 150) == pytest.approx(3.5)
    assert loss_at(CURVE, 275) == pytest.approx(2.625)
    with pytest.raises(ValueError):
        loss_at(CURVE, 301)


def test_the_slower_mode_is_read_at_its_share_of_the_faster_ones_tokens():
    faster = {t: v - 0.1 for t, v in CURVE.items()}
    ratio, t_over, t_block = equal_time_ratio(faster, CURVE, u_overlapped=0.9, u_blocking=0.3)
    assert (t_over, t_block) == (300, pytest.approx(100))
    assert ratio == pytest.approx(2.4 / 4.0)
    # blocking the faster: the overlapped run is the one cut short
    ratio, t_over, t_block = equal_time_ratio(faster, CURVE, u_overlapped=0.5, u_blocking=0.75)
    assert (t_over, t_block) == (pytest.approx(200), 300)
    assert ratio == pytest.approx(2.9 / 2.5)
    # equal speed: equal tokens
    assert equal_time_ratio(faster, CURVE, 0.6, 0.6)[0] == pytest.approx(2.4 / 2.5)


def wan(rate, u_over, u_block, steps_late=None):
    over = dict(rate_mbit=rate, utilization=u_over, steps_late=steps_late)
    return over, dict(rate_mbit=rate, utilization=u_block)


def test_a_wan_run_gives_each_links_utilizations_and_how_late_the_average_landed():
    fast, slow, unpaired = wan(100.0, 0.95, 0.66, 3.1), wan(10.0, 0.96, 0.28), wan(50.0, 0.9, 0.5)
    figures = {"fp4-overlap": [fast[0], slow[0], unpaired[0]], "fp16": [fast[1], slow[1]]}
    links = link_figures(dict(figures=figures), "fp4-overlap", "fp16")
    assert [(x["rate_mbit"], x["u_overlapped"], x["u_blocking"]) for x in links] == [
        (100.0, 0.95, 0.66),
        (10.0, 0.96, 0.28),
    ]
    # as the rounds reported it; a run from before rounds reported it says nothing rather than guess
    assert [x["steps_late"] for x in links] == [3.1, None]


def test_each_seed_is_paired_with_its_own_blocking_run_and_the_seeds_averaged():
    over = "diloco-h10-fp4-eager5"
    seeds = {
        0: {"diloco-h10-fp32": CURVE, over: {t: v * 1.1 for t, v in CURVE.items()}},
        1: {"diloco-h10-fp32": {t: v * 2 for t, v in CURVE.items()}, over: {t: v * 2.2 for t, v in CURVE.items()}},
        2: {over: CURVE},  # no blocking run of its own: left out
    }
    links = [dict(rate_mbit=None, u_overlapped=0.5, u_blocking=0.5, steps_late=1.0)]
    (row,) = summarize(seeds, [over], links)[over]
    assert sorted(row["per_seed"]) == [0, 1]
    assert row["mean_ratio"] == pytest.approx(1.1)
