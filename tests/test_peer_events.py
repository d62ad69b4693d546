"""The volunteer's line for each of the peer's events (client/peer_events.py): pure, checked in process."""

from __future__ import annotations

import pytest

from client.peer_events import describe
from swarm import PeerEvent
from swarm.defence.bans import Ban, BanReason

DONOR = "QmSomeDonorPeerIdAbCdEfGh12345678"
DATA = dict(
    reason="behind the swarm",
    epoch=3,
    target=6,
    donor=DONOR,
    eta=12.0,
    expected=40.0,
    path="/w/checkpoints/state-000003.safetensors",
    checksum="ab" * 32,
    ban=Ban("QmLiarPeerIdAbCdEfGh12345678", BanReason.wrong_average, 4, ("self",), 0.0),
)
SILENT = {PeerEvent.state, PeerEvent.left, PeerEvent.round, PeerEvent.state_saved}  # the loop's state, not lines


@pytest.mark.parametrize("kind", list(PeerEvent))
def test_every_event_is_a_line_or_deliberately_silent(kind: PeerEvent):
    line = describe(kind, DATA)
    if kind in SILENT:
        assert line is None
        return
    assert line is not None
    log_kind, text = line
    assert log_kind in {"resync", "download", "state_loaded", "download_failed", "initialized", "log", "banned"}
    assert text and "\n" not in text and "{" not in text


def test_lines_name_what_the_volunteer_needs():
    assert describe(PeerEvent.replayed, DATA) == ("state_loaded", "caught up to epoch 6 by replaying 3 rounds")
    assert DONOR[-8:] in describe(PeerEvent.state_loaded, DATA)[1]
    assert "state-000003.safetensors is unusable" in describe(PeerEvent.checkpoint_unusable, DATA)[1]
    assert "this round is local" in describe(PeerEvent.averaging_error, DATA)[1]
    assert describe(PeerEvent.banned, DATA) == (
        "banned",
        "banned peer 12345678 for the rest of the run: wrong average (caught by our audit)",
    )
    assert describe(PeerEvent.replay_failed, DATA)[0] == "download_failed"


def test_events_compare_equal_to_their_recorded_names():
    """--log-json and older listeners see the same names as before."""
    assert PeerEvent.download_started == "download_started" and str(PeerEvent.replayed) == "replayed"
