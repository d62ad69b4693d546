"""client.lag: one plain line when overlapped rounds keep landing a quarter of a round late or more."""

from client.lag import WINDOW, LagWatch


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


def test_short_lags_and_blocking_rounds_say_nothing():
    watch = LagWatch(inner_steps=20)
    for late in (4, 4, 30, 1, 0, None, None):  # median 4: a fifth of a round
        watch.add(late)
    assert watch.advice() is None
    blocking = LagWatch(inner_steps=20)
    for _ in range(2 * WINDOW):
        blocking.add(None)
    assert blocking.advice() is None
