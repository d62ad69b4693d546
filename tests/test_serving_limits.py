"""A requester gets a bounded share of this peer's serving (``swarm.averager.serving_limits``)."""

from __future__ import annotations

from swarm.averager.serving_limits import ServingLimits


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_requester_cannot_hold_more_streams_or_start_more_a_minute_than_its_share():
    clock = Clock()
    limits = ServingLimits(per_peer=2, total=3, per_minute=5, clock=clock)
    assert limits.acquire("a") and limits.acquire("a") and not limits.acquire("a")  # two at once, not three
    assert limits.acquire("b") and not limits.acquire("c")  # the peer's total: three at once
    limits.release("a")
    assert limits.acquire("c")  # a slot freed
    limits.release("a")
    for _ in range(3):  # "a" started two; three more, one at a time
        clock.now += 1
        assert limits.acquire("a")
        limits.release("a")
    assert "a" not in limits.open and not limits.acquire("a")  # five started within the minute: refused
    clock.now += 61
    assert limits.acquire("a")  # a minute on: served again


def test_requesters_that_went_quiet_are_forgotten():
    clock = Clock()
    limits = ServingLimits(per_peer=1, total=2, per_minute=5, clock=clock)
    for i in range(100):
        assert limits.acquire(f"peer{i}")
        limits.release(f"peer{i}")
        clock.now += 1
    assert len(limits.started) <= 4 * limits.total + 61 and not limits.open
