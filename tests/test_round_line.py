"""The round line a volunteer reads: what the round did, what it cost, and how late an overlapped one landed."""

from client.round_line import round_line
from swarm import RoundOutcome, RoundReport


def report(**kw) -> RoundReport:
    base = dict(epoch=7, averaged=True, group_size=3, outcome=RoundOutcome.averaged, checksum="0123456789abcdef")
    return RoundReport(**{**base, **kw})


def test_an_averaged_overlapped_round_says_its_audits_and_how_late_it_landed():
    kind, line = round_line(
        report(seconds=dict(compute=4.0, matchmaking=0.5, allreduce=7.3, audit=3.16, outer=0.02), steps_late=3), 10
    )
    assert kind == "round"
    assert line.startswith("round -> epoch 7: averaged with 3 peers; ")
    assert "all-reduce 7.3s (audits 3.2s) outer 0.02s" in line
    assert "landed 3/10 steps late checksum 0123456789" in line


def test_a_local_blocking_round_says_why_and_neither_audits_nor_lag():
    kind, line = round_line(
        report(averaged=False, group_size=1, outcome=RoundOutcome.local, fallback_reason="no group", resynced=True), 20
    )
    assert kind == "fallback"
    assert "local (no group), re-synced; " in line
    assert "audits" not in line and "landed" not in line


def test_a_round_that_took_the_swarms_average_without_ours_says_so_not_local_none():
    adopted = report(averaged=False, group_size=1, outcome=RoundOutcome.adopted, fallback_reason=None)
    kind, line = round_line(adopted, 20)
    assert kind == "fallback" and "epoch 7: the swarm's average without ours; " in line and "None" not in line
    given_up = report(averaged=False, outcome=RoundOutcome.adopted, fallback_reason="the swarm finished it")
    assert "local (the swarm finished it)" in round_line(given_up, 20)[1]
