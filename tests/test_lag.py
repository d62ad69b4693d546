"""client.lag: one plain line when overlapped rounds keep landing a quarter of a round late or more."""

from client.lag import BEHIND_ROUNDS, WINDOW, BehindWatch, LagWatch
from swarm.dht.view import ResyncReason
from swarm.events import RoundOutcome, RoundReport


def test_it_speaks_once_when_the_median_lag_is_a_quarter_of_a_round_or_more():
    watch = LagWatch(inner_steps=20)
    for late in (9, 2, 6, 7):
        watch.add(late)
        assert watch.advice() is None  # too few rounds to say
    watch.add(5)  # median of 9, 2, 6, 7, 5: 6 of 20
    line = watch.advice()
    assert line is not None and "median 6 of 20" in line
    watch.add(20)
    assert watch.advice() is None  # said once


def test_the_line_names_the_damping_only_to_a_run_that_does_not_damp_yet():
    lines = []
    for kept in (1.0, 0.5):
        watch = LagWatch(inner_steps=10, steps_kept=kept)
        for _ in range(WINDOW):
            watch.add(5)
        lines.append(watch.advice())
    assert "in_flight_steps_kept=0.5" in lines[0] and "13% at half a round" in lines[0]
    # a damping run (the default) is told the damped cost, not the undamped one
    assert lines[1] is not None and "in_flight_steps_kept" not in lines[1] and "2% at half a round" in lines[1]


def test_short_lags_and_blocking_rounds_say_nothing():
    watch = LagWatch(inner_steps=20)
    for late in (4, 4, 30, 1, 0, None, None):  # median 4: a fifth of a round
        watch.add(late)
    assert watch.advice() is None
    blocking = LagWatch(inner_steps=20)
    for _ in range(2 * WINDOW):
        blocking.add(None)
    assert blocking.advice() is None


def _report(epoch: int, reason: ResyncReason | None) -> RoundReport:
    outcome = RoundOutcome.resynced if reason is not None else RoundOutcome.averaged
    return RoundReport(
        epoch=epoch,
        averaged=reason is None,
        group_size=1,
        outcome=outcome,
        resynced=reason is not None,
        resync_reason=reason,
    )


def test_it_speaks_once_when_the_swarm_finishes_rounds_without_us_several_times_in_a_row():
    watch = BehindWatch()
    for epoch in range(1, BEHIND_ROUNDS):
        watch.add(_report(2 * epoch, ResyncReason.behind))
        assert watch.advice() is None
    watch.add(_report(2 * BEHIND_ROUNDS, ResyncReason.behind))
    line = watch.advice()
    assert line is not None and f"last {BEHIND_ROUNDS} rounds" in line and "epochs 2, 4, 6" in line
    watch.add(_report(8, ResyncReason.behind))
    assert watch.advice() is None  # said once


def test_a_round_taken_part_in_or_another_reason_starts_the_count_again():
    watch = BehindWatch()
    reasons = [ResyncReason.behind, ResyncReason.behind, None, ResyncReason.behind, ResyncReason.disagreed]
    reasons += [ResyncReason.behind, ResyncReason.behind, ResyncReason.ran_ahead]
    for epoch, reason in enumerate(reasons, start=1):
        watch.add(_report(epoch, reason))
        assert watch.advice() is None, (epoch, reason)
