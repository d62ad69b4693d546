"""Overlapped rounds under faults, and catching up by replay: real peer processes on 127.0.0.1."""

from __future__ import annotations

from diloco_helpers import tiny_manifest
from swarm_harness import wait_for
from test_engine_faults import assert_consistent, assert_rounds_bounded


def events_of(swarm, rank: int, kind: str) -> list[dict]:
    return [e for e in swarm.events(rank) if e["kind"] == kind]


def events_since_restart(swarm, rank: int, kind: str) -> list[dict]:
    """The events file is appended to across a restart: keep what the second life logged."""
    events = swarm.events(rank)
    first_left = next(i for i, e in enumerate(events) if e["kind"] == "left")
    return [e for e in events[first_left + 1 :] if e["kind"] == kind]


def test_a_peer_killed_during_a_background_allreduce_leaves_the_survivors_consistent(make_swarm):
    # a 20M-float ballast makes each all-reduce last long enough to be interrupted while the next round trains.
    # A group of three forms as soon as all three are there; a window of 8 s (not 2) lets a victim that is a few
    # seconds behind join: on a loaded machine it once came 1.6-2 s after the other two had paired, in every
    # round (each time adopting their average, which kept it as far behind), and never averaged before 180 s
    manifest = tiny_manifest(
        compression="fp4",
        matchmaking_time=8.0,
        matchmaking_timeout=15.0,
        allreduce_timeout=15.0,
        overlap=True,
        target_group_size=3,
    )
    swarm = make_swarm(manifest)
    epochs = 5
    for rank in range(3):
        swarm.start(rank, epochs, extra_params=20_000_000, wait_ready=rank == 0)
    (epoch,) = wait_for(
        lambda: [e for e in range(epochs) if swarm.marker(2, "averaging", e).exists()][:1],
        180,
        "the victim to start a background all-reduce",
        poll=0.005,
    )
    swarm.kill(2)
    for rank in (0, 1):
        assert swarm.wait_exit(rank, 240) == 0, swarm.log(rank)
        assert_rounds_bounded(swarm.reports(rank), manifest, extra_params=20_000_000)
    assert_consistent(swarm, (0, 1), epochs)
    after = [r for rank in (0, 1) for r in swarm.reports(rank) if r["epoch"] > epoch]
    assert any(r["averaged"] and r["group_size"] == 2 for r in after), after  # the two went on together
    # the 20M-float ballast's all-reduce takes seconds: averages landed steps into the next round, not at once
    assert any(r["averaged"] and r["steps_late"] >= 1 for r in after), after


def test_a_joiner_arriving_while_an_overlapped_round_is_in_flight_catches_up_and_averages(make_swarm):
    # H=4: the pair's next round begins ~0.4 s after each landing, sooner than a joiner can catch up by
    # re-syncing (it was then a round behind every round and never averaged); it adopts the round in flight
    # instead and keeps its steps (5 runs here: adopted or re-synced at epoch 6, then averaged with 3 in 7-10)
    manifest = tiny_manifest(compression="fp4", matchmaking_timeout=15.0, overlap=True)
    swarm = make_swarm(manifest)
    epochs = 10
    # the two hold before epoch 5's steps until the joiner is up: on a slow machine it once came at epoch 7, was
    # re-synced twice, and the run ended before it could average with them
    joined = swarm.out(2) / "maddrs.txt"
    # they start together, and any round in flight before the hold will do: in CI peer 0 never averaged at epoch 2
    # (peer 1 had read peer 0's addresses file empty and trained alone: engine_worker.write_whole) and the pair held
    # at epoch 5 for a joiner never started
    hold = ("--hold-at-epoch", "5", "--hold-for", str(joined), "--start-with", "2")
    swarm.start(0, epochs, extra_args=hold)
    swarm.start(1, epochs, extra_args=hold)

    def in_flight() -> list[int]:
        return [e for e in range(2, 5) if swarm.marker(0, "averaging", e).exists()]

    try:
        wait_for(in_flight, 180, "a round in flight at epoch 2, 3 or 4", poll=0.05)
    except AssertionError as e:  # what a failure needs: why the pair's rounds found no group
        raise AssertionError(f"{e}\npeer 0:\n{swarm.story(0)}\npeer 1:\n{swarm.story(1)}") from None
    swarm.start(2, epochs)
    for rank in range(3):
        assert swarm.wait_exit(rank, 240) == 0, swarm.log(rank)
    # a fresh joiner starts from the run's seeded init, so it may catch up by replaying the rounds' averages
    # (when it is at most replay_rounds behind, as on a fast machine) or by downloading the state
    assert events_of(swarm, 2, "replayed") or events_of(swarm, 2, "state_loaded"), swarm.events(2)
    rounds = swarm.reports(2)
    assert sum(r["averaged"] and r["group_size"] == 3 for r in rounds) >= len(rounds) // 2, rounds  # in phase
    assert_consistent(swarm, range(3), epochs)


def test_a_restarted_peer_replays_the_rounds_it_missed_even_when_its_donor_dies_mid_replay(make_swarm):
    """Peer 2 leaves at epoch 2 and comes back a few rounds later from its checkpoint: it catches up by
    replaying the rounds' averages (not the whole state). The first donor it asks is killed as the replay
    starts; it must still end on the swarm's state, by replaying from the other or by downloading."""
    # a round lasts ~2 s here: allow the longest replay, so timing cannot force a download
    manifest = tiny_manifest(
        compression="fp4", matchmaking_timeout=15.0, allreduce_timeout=15.0, overlap=True, replay_rounds=7
    )
    swarm = make_swarm(manifest)
    epochs = 14
    for rank in range(3):
        swarm.start(rank, 2 if rank == 2 else epochs, wait_ready=rank == 0)
    assert swarm.wait_exit(2, 180) == 0, swarm.log(2)
    # two rounds on: a restart is quick (the workers fork from a warm server), so it must not be what puts it behind
    wait_for(lambda: swarm.marker(0, "training", 4).exists(), 180, "the swarm to reach epoch 4")
    (swarm.out(2) / "maddrs.txt").unlink()
    swarm.start(2, epochs, extra_args=("--resume",))
    started = wait_for(lambda: events_since_restart(swarm, 2, "replay_started"), 120, "the replay to start", poll=0.005)
    assert started[0]["target"] - started[0]["epoch"] >= 2, started
    swarm.kill(0)
    assert swarm.wait_exit(1, 300) == 0, swarm.log(1)
    assert swarm.wait_exit(2, 300) == 0, swarm.log(2)
    assert events_since_restart(swarm, 2, "replayed") or events_since_restart(swarm, 2, "state_loaded"), swarm.events(2)
    assert_consistent(swarm, (1, 2), epochs)


def test_replay_is_used_instead_of_a_download_when_nothing_goes_wrong(make_swarm):
    manifest = tiny_manifest(compression="fp4", matchmaking_timeout=15.0, overlap=True, replay_rounds=7)
    swarm = make_swarm(manifest)
    epochs = 10
    # a round takes ~2 s here, a restart on a loaded machine can take longer than the 7 left: the two that stay
    # wait before epoch 5 until the restarted peer is back, or they may finish (and close their ports) first
    back = swarm.root / "peer1-back"
    for rank in range(3):  # peers 0 and 2 keep averaging while peer 1 is away, so every round has an update
        hold = () if rank == 1 else ("--hold-at-epoch", "5", "--hold-for", str(back))
        swarm.start(rank, 2 if rank == 1 else epochs, wait_ready=rank == 0, extra_args=hold)
    assert swarm.wait_exit(1, 180) == 0, swarm.log(1)
    wait_for(lambda: swarm.marker(0, "training", 4).exists(), 180, "the swarm to reach epoch 4")  # two rounds on
    (swarm.out(1) / "maddrs.txt").unlink()
    swarm.start(1, epochs, extra_args=("--resume",))
    back.touch()
    for rank in range(3):
        assert swarm.wait_exit(rank, 240) == 0, swarm.log(rank)
    replayed = events_since_restart(swarm, 1, "replayed")
    assert replayed and replayed[0]["target"] - replayed[0]["epoch"] >= 2, swarm.events(1)
    assert not events_since_restart(swarm, 1, "state_loaded"), "a replayed peer downloads nothing"
    # caught up, it averages with both others: it does not stay a round behind (the swarm's next round is under
    # way by the time it has trained for the one it replayed to; it adopts that round's average and keeps its steps)
    rounds = [e["report"] for e in events_since_restart(swarm, 1, "round")]
    assert any(r["averaged"] and r["group_size"] == 3 for r in rounds), rounds
    assert_consistent(swarm, range(3), epochs)


def test_a_local_round_is_replayed_like_an_averaged_one(make_swarm):
    """Peer 1 leaves at epoch 2; peer 0, alone, makes local rounds (no group) until it is back. Restarted from
    its checkpoint, peer 1 replays those local rounds' steps instead of downloading the whole state again: the
    case of every joiner to a lone donor that makes a round while the joiner's first one runs. Blocking fp16 (the
    defaults until overlapped fp4 rounds): the local step is rounded to fp16, as a group's average is, so the
    replay gives its checksum."""
    manifest = tiny_manifest(compression="fp16", matchmaking_timeout=15.0, replay_rounds=7)
    swarm = make_swarm(manifest)
    epochs = 7
    back = swarm.root / "peer1-back"
    swarm.start(0, epochs, extra_args=("--hold-at-epoch", "5", "--hold-for", str(back)))
    swarm.start(1, 2)
    assert swarm.wait_exit(1, 180) == 0, swarm.log(1)
    wait_for(lambda: swarm.marker(0, "training", 5).exists(), 180, "peer 0 to make its local rounds to epoch 5")
    (swarm.out(1) / "maddrs.txt").unlink()
    swarm.start(1, epochs, extra_args=("--resume",))
    back.touch()
    for rank in range(2):
        assert swarm.wait_exit(rank, 240) == 0, swarm.log(rank)
    alone = [r for r in swarm.reports(0) if 3 <= r["epoch"] <= 5]  # its rounds from epochs 2-4
    assert len(alone) == 3 and not any(r["averaged"] for r in alone), alone
    replayed = events_since_restart(swarm, 1, "replayed")
    assert replayed and replayed[0]["epoch"] == 2 and replayed[0]["target"] >= 5, swarm.events(1)
    assert not events_since_restart(swarm, 1, "state_loaded"), "a replayed peer downloads nothing"
    rounds = [e["report"] for e in events_since_restart(swarm, 1, "round")]
    assert any(r["averaged"] and r["group_size"] == 2 for r in rounds), rounds  # caught up, it averaged
    assert_consistent(swarm, range(2), epochs)
