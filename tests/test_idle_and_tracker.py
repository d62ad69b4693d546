"""The pure parts of the dashboard: the idle line, the peer tracker, telemetry and the health check."""

from __future__ import annotations

import json
import time

from test_swarm_view import record

from client.health import PeerStatus, check_health, write_status
from client.idle import OwnState, shown_state, why_idle
from client.swarm_watch import FADE_SECONDS, PeerTracker
from swarm import PeerState, RoundReport
from swarm.dht.records import PeerEntry
from swarm.dht.view import build_view

H, SAMPLES = 500, 8


def view_of(*records):
    return build_view([PeerEntry(r, time.time() + 60) for r in records], time.time(), H, SAMPLES)


def me(state="training", step=100, **kw):
    return OwnState(peer_id="me", state=state, epoch=3, inner_step=step, inner_steps=H, samples_per_step=SAMPLES, **kw)


def test_waiting_for_slower_peers_names_them_and_their_eta():
    view = view_of(
        record("me", 3, PeerState.matchmaking, inner_step=H),
        record("a", 3, inner_step=480, sps=4.0),  # 20 steps x 8 samples / 4 per s = 40 s
        record("b", 3, inner_step=490, sps=8.0),
    )
    assert why_idle(me("matchmaking", H), view) == f"waiting for 2 peers to reach step {H} (ETA 40 s)"


def test_downloading_state_shows_percent_and_donor():
    line = why_idle(me("downloading state", 0, download_fraction=0.42, download_donor="QmDonorPeer123"), None)
    assert line == "downloading state 42% from peer rPeer123"
    line = why_idle(me("re-syncing", 0, download_fraction=0.5), None)
    assert line == "re-syncing: downloading state 50%"


def test_no_peers_reachable_points_at_initial_peers():
    view = view_of(record("me", 3))
    assert "no peers reachable: check --initial-peers" in why_idle(me(has_initial_peers=True), view)
    assert "nobody else has joined" in why_idle(me(has_initial_peers=False), view)


def test_training_is_not_idle_and_gives_the_round_eta():
    view = view_of(record("me", 3, inner_step=100), record("a", 3, inner_step=100, sps=8.0))
    line = why_idle(me(samples_per_second=16.0), view)
    assert line == f"not idle: training step 100/{H}, round in ~200 s"


def test_an_overlapped_peer_training_while_its_round_is_in_the_air_shows_training_and_the_round():
    assert shown_state("matchmaking", round_in_background=True) == ("training", "matchmaking")
    assert shown_state("averaging", round_in_background=True) == ("training", "averaging")
    # waiting for its round (its steps are done, or the round is blocking): that is what it does
    assert shown_state("averaging", round_in_background=False) == ("averaging", None)
    assert shown_state("leaving", round_in_background=True) == ("leaving", None)
    view = view_of(record("me", 3, PeerState.averaging, inner_step=100), record("a", 3, inner_step=100, sps=8.0))
    line = why_idle(me(samples_per_second=16.0, round_in_background="averaging"), view)
    assert line == f"not idle: training step 100/{H}, round in ~200 s; the last round is averaging in the background"


def test_own_state_reads_a_landing_round_as_training_and_a_wait_for_it_as_the_round(tmp_path):
    """``client.monitoring.own_state`` on a fake trainer holding a real (unconnected) ``swarm.Peer``: the moments of
    an overlapped round as the watcher's thread sees them (a CI run caught "matchmaking" in the instant between
    the flight's end and its landing)."""
    from types import SimpleNamespace

    from client.monitoring import own_state
    from client.presets import build_manifest
    from swarm import Peer

    manifest = build_manifest("tiny")
    dht = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me"))
    peer = Peer(manifest, dht=dht, state_dir=tmp_path)
    peer._outer, peer._steps.inner_step = SimpleNamespace(epoch=3), 2  # as start() leaves them

    def seen(state, flight, landing, in_round):
        peer._flight, peer._landing, peer._in_round = flight, landing, in_round
        telemetry = SimpleNamespace(state=state, download_donor=None, tokens_per_second=0.0)
        trainer = SimpleNamespace(manifest=manifest, telemetry=telemetry, peer=peer, dht=dht)
        own = own_state(trainer, has_initial_peers=False)
        return own.state, own.round_in_background

    assert seen("averaging", flight=object(), landing=False, in_round=False) == ("training", "averaging")
    assert seen("averaging", flight=None, landing=True, in_round=False) == ("training", "averaging")  # landing
    assert seen("matchmaking", flight=object(), landing=False, in_round=True) == ("matchmaking", None)  # waits
    assert seen("matchmaking", flight=None, landing=False, in_round=True) == ("matchmaking", None)  # blocking
    assert seen("training", flight=None, landing=False, in_round=False) == ("training", None)


def test_tracker_reports_joins_departures_and_fades_them_out():
    tracker = PeerTracker(self_id="me")
    now = time.time()
    assert tracker.update([PeerEntry(record("me"), now + 15)], now) == []
    events = tracker.update([PeerEntry(record("me"), now + 15), PeerEntry(record("a"), now + 15)], now + 1)
    assert [kind for kind, _ in events] == ["joined"]
    leaving = record("a", state=PeerState.left)
    events = tracker.update([PeerEntry(record("me"), now + 15), PeerEntry(leaving, now + 15)], now + 2)
    assert [kind for kind, _ in events] == ["left"] and tracker.peers["a"].gone_reason == "left"
    tracker.update([PeerEntry(record("me"), now + 15), PeerEntry(record("b"), now + 15)], now + 3)
    events = tracker.update([PeerEntry(record("me"), now + 15)], now + 4)
    assert events == [("left", events[0][1])] and "vanished" in events[0][1]
    assert [p.record.peer_id for p in tracker.rows()] == ["me", "b", "a"]  # live first, then most recently gone
    tracker.update([PeerEntry(record("me"), now + 15)], now + 5 + FADE_SECONDS)
    assert [p.record.peer_id for p in tracker.rows()] == ["me"]


def test_telemetry_log_json_has_steps_rounds_and_events(tmp_path):
    from client.telemetry import Telemetry

    path = tmp_path / "log.jsonl"
    tel = Telemetry(path)
    tel.step(loss=3.0, seconds=0.5, lr=1e-3, tokens=1024, epoch=0, inner_step=1)
    report = RoundReport(epoch=1, averaged=True, group_size=3, seconds={"compute": 0.5, "allreduce": 0.1})
    report.bytes_sent = 1000
    tel.round(report)
    tel.event("resync", "re-syncing: test")
    tel.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["type"] for r in records] == ["step", "round", "event"]
    assert records[0]["tokens_per_second"] == 2048 and records[1]["bytes_sent"] == 1000
    assert records[1]["seconds"]["allreduce"] == 0.1 and records[1]["group_size"] == 3
    assert 0 < tel.utilization() <= 1


def test_health_check_live_stale_stuck_and_missing(tmp_path):
    now = time.time()
    base = dict(pid=1, peer_id="QmPeer", run_id="r", state="training", epoch=1, inner_step=2, stuck_after=300)
    assert check_health(tmp_path)[0] is False  # no file
    write_status(tmp_path, PeerStatus(updated_at=now, progress_at=now - 10, **base))
    assert check_health(tmp_path, now=now)[0] is True
    ok, why = check_health(tmp_path, max_age=60, now=now + 120)
    assert not ok and "refreshed" in why
    write_status(tmp_path, PeerStatus(updated_at=now, progress_at=now - 400, **base))
    ok, why = check_health(tmp_path, now=now)
    assert not ok and "no progress for 400 s" in why
    (tmp_path / "status.json").write_text("{not json")
    assert check_health(tmp_path, now=now)[0] is False


def test_the_dashboards_own_row_says_what_the_status_file_says_and_others_rows_what_they_publish():
    """An overlapped peer's record says matchmaking while it trains: its own row in the peers table shows the state
    its status file shows (training, with the round's stage), and every other row shows the published state."""
    from client.dashboard import peer_row
    from client.swarm_watch import TrackedPeer

    now = time.time()
    mine = TrackedPeer(record("me", 3, PeerState.matchmaking, inner_step=4), now)
    theirs = TrackedPeer(record("a", 3, PeerState.matchmaking, inner_step=9), now)
    own = me(state="training", round_in_background="matchmaking")
    assert peer_row(mine, own, now)[0] == "me (you)" and peer_row(mine, own, now)[6] == "training (round matchmaking)"
    assert peer_row(theirs, own, now)[6] == "matchmaking"
    waiting = me(state="matchmaking")  # blocking, or waiting for its round: what it does is what it says
    assert peer_row(mine, waiting, now)[6] == "matchmaking"
    assert peer_row(mine, None, now)[0] == "me" and peer_row(mine, None, now)[6] == "matchmaking"  # an observer
