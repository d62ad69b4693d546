"""A donor's state file is accepted for the epoch the joiner chose from the swarm's view, held by enough peers
(``swarm.state.trust``): not for whatever epoch and checksum the donor wrote into its header."""

from __future__ import annotations

from test_groups import view_of
from test_swarm_view import record

from swarm.dht.view import consensus
from swarm.state.trust import MIN_HOLDERS, refusal

GOOD, BAD, NEXT = "a" * 64, "b" * 64, "c" * 64
ME = "joiner"


def test_a_state_held_by_two_peers_at_the_wanted_epoch_is_accepted():
    view = view_of(record("p1", 5, checksums=[(5, GOOD)]), record("p2", 5, checksums=[(5, GOOD)]))
    wanted = consensus(view.peers, 5)
    assert MIN_HOLDERS == 2 and refusal(view, 5, GOOD, wanted, ME) is None
    assert "not the one" in refusal(view, 5, BAD, wanted, ME)


def test_a_donor_cannot_choose_the_epoch_it_is_checked_against():
    honest = [record(f"p{i}", 5, checksums=[(5, GOOD)]) for i in range(3)]
    # the donor publishes a checksum of its own poisoned file for epoch 6, which nobody else has reached
    donor = record("donor", 5, checksums=[(5, GOOD), (6, BAD)])
    view = view_of(*honest, donor)
    wanted = consensus(view.peers, 5)
    assert "not reached" in refusal(view, 6, BAD, wanted, ME)
    assert "older" in refusal(view, 4, GOOD, wanted, ME)
    # the swarm really moved on during the download: epoch 6 is checked as the wanted one was; one vote for the
    # donor's own file is not enough where two peers voted
    moved = view_of(
        *[record(f"p{i}", 6, checksums=[(6, NEXT)]) for i in range(2)], record("donor", 6, checksums=[(6, BAD)])
    )
    assert refusal(moved, 6, NEXT, wanted, ME) is None
    assert refusal(moved, 6, BAD, wanted, ME) is not None


def test_one_holder_is_not_enough_where_others_voted_and_is_where_it_is_the_only_voter():
    view = view_of(record("donor", 5, checksums=[(5, BAD)]), record("p1", 5, checksums=[(5, GOOD)]))
    wanted = consensus(view.peers, 5)  # a tie of one vote each: the lower peer id wins, here the donor's
    assert wanted.checksum == BAD and "1 peer(s), 2 needed" in refusal(view, 5, BAD, wanted, ME)
    alone = view_of(record("p1", 5, checksums=[(5, GOOD)]))  # the run's only other peer: nobody to compare with
    assert refusal(alone, 5, GOOD, consensus(alone.peers, 5), ME) is None
    # our own vote never counts for the file we are checking
    ours = view_of(record("p1", 5, checksums=[(5, GOOD)]), record(ME, 5, checksums=[(5, GOOD)]))
    assert refusal(ours, 5, GOOD, consensus(ours.peers, 5), ME) is None  # p1 is the one other voter
    three = view_of(record("p1", 5, checksums=[(5, GOOD)]), record("p2", 5, checksums=[(5, BAD)]),
                    record(ME, 5, checksums=[(5, GOOD)]))  # fmt: skip
    assert "1 peer(s), 2 needed" in refusal(three, 5, GOOD, consensus(three.peers, 5), ME)
