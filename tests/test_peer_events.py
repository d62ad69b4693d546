"""The volunteer's line for each of the peer's events (client/peer_events.py): pure, checked in process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from client.peer_events import describe
from swarm.defence.bans import BAN_ROUNDS, Ban, BanReason
from swarm.dht.records import PeerState
from swarm.events import (
    EVENT_TYPES,
    AveragingFailed,
    Banned,
    CheckpointUnusable,
    ClaimDoubted,
    DonorDistrusted,
    Left,
    PeerEvent,
    Replayed,
    ReplayFailed,
    RoundFinished,
    RoundReport,
    StateChanged,
    StateLoaded,
    StateSaved,
)

DONOR = "QmSomeDonorPeerIdAbCdEfGh12345678"
VALUES = dict(  # a value for every field any event has, by its name
    reason="behind the swarm",
    epoch=3,
    target=6,
    donor=DONOR,
    eta=12.0,
    expected=40.0,
    path=Path("/w/checkpoints/state-000003.safetensors"),
    checksum="ab" * 32,
    ban=Ban("QmLiarPeerIdAbCdEfGh12345678", BanReason.wrong_average, 4, ("self",), 0.0),
    state=PeerState.training,
    checkpoint_written=True,
    report=RoundReport(epoch=3, averaged=True, group_size=2),
    kept_steps=False,
    bytes=1000,
    seconds=0.5,
    peers=2,
    rounds=3,
)
SILENT = {StateChanged, Left, RoundFinished, StateSaved}  # the loop's state, not lines


def event_of(kind: type[PeerEvent]) -> PeerEvent:
    return kind(**{f.name: VALUES[f.name] for f in dataclasses.fields(kind)})


@pytest.mark.parametrize("kind", EVENT_TYPES, ids=lambda kind: kind.__name__)
def test_every_event_is_a_line_or_deliberately_silent(kind: type[PeerEvent]):
    line = describe(event_of(kind))
    if kind in SILENT:
        assert line is None
        return
    assert line is not None
    log_kind, text = line
    assert log_kind in {
        "resync",
        "download",
        "state_loaded",
        "download_failed",
        "initialized",
        "log",
        "banned",
        "bad_donor",
        "doubted",
    }
    assert text and "\n" not in text and "{" not in text


def test_lines_name_what_the_volunteer_needs():
    assert describe(event_of(Replayed)) == ("state_loaded", "caught up to epoch 6 by replaying 3 rounds")
    assert describe(event_of(StateLoaded))[1] == f"state of epoch 3 (checksum abababab) loaded from {DONOR[-8:]}"
    assert describe(event_of(DonorDistrusted)) == (
        "bad_donor",
        f"peer {DONOR[-8:]} served a bad state (behind the swarm); not asking it again",
    )
    assert describe(event_of(ClaimDoubted)) == (
        "doubted",
        "2 peer(s) vouch for a state of epoch 3 that none of them served: not believed until 3 rounds past it; "
        "this peer's round goes on",
    )
    assert "state-000003.safetensors is unusable" in describe(event_of(CheckpointUnusable))[1]
    assert "this round is local" in describe(event_of(AveragingFailed))[1]
    assert describe(event_of(Banned)) == (
        "banned",
        f"banned peer 12345678 until epoch {4 + BAN_ROUNDS}: wrong average (caught by our audit)",
    )
    proven = Banned(ban=dataclasses.replace(VALUES["ban"], by=("QmAccuserPeerIdAbCdEf87654321",)))
    assert describe(proven)[1].endswith("wrong average (caught by the proof in 87654321's accusation)")
    assert describe(event_of(ReplayFailed))[0] == "download_failed"


def test_every_event_type_keeps_its_recorded_name():
    """--log-json and older listeners see the same names as before, one per type."""
    names = [kind.kind for kind in EVENT_TYPES]
    assert len(EVENT_TYPES) == 20 and len(set(names)) == len(names) and all(names)
    assert {"download_started", "replayed", "state", "round", "banned", "averaging_error"} <= set(names)
