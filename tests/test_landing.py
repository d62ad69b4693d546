"""swarm.round.landing.share_kept: which share of the steps taken while an average was in flight stays at landing."""

import pytest

from swarm.round.landing import DAMP_FROM_STEPS, share_kept


@pytest.mark.parametrize("kept", [0.0, 0.5, 0.9])
def test_steps_are_damped_only_from_two_steps_late(kept):
    assert DAMP_FROM_STEPS == 2  # the simulator: damping cost 1.0% at 1 step late, and gained from 2 on
    assert share_kept(kept, 0) == share_kept(kept, 1) == 1.0
    assert share_kept(kept, 2) == share_kept(kept, 5) == share_kept(kept, 100) == kept


def test_keeping_every_step_is_the_same_at_any_lag():
    assert {share_kept(1.0, late) for late in range(12)} == {1.0}
