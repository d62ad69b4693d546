"""A group whose delegate this peer banned is no part of its second stage: not waited for, not in a roster it
writes. The averager refuses a banned peer's group anyway, so every round with it cost a failed try of the second
stage (30 s a round in the byzantine benchmark, the liar banned and registering as a group of one)."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.dht import groups
from swarm.dht.groups import group_record, group_tag
from swarm.round.merge import Merger
from swarm.round.no_shows import NoShows

HONEST, LIAR = "Qm" + "h" * 44, "Qm" + "l" * 44


def test_the_groups_of_banned_delegates_are_not_read_into_the_second_stage(monkeypatch):
    records = [
        group_record(3, group_tag(b"honest"), HONEST, 2, 64.0, "a" * 64, False),
        group_record(3, group_tag(b"liar"), LIAR, 1, 32.0, None, False),
    ]
    monkeypatch.setattr(groups, "read_groups", lambda dht, run_id: list(records))
    reader = SimpleNamespace(dht=None, other_records=0, banned=lambda peer: peer == LIAR)
    ctx = SimpleNamespace(reader=reader, manifest=SimpleNamespace(run_id="0" * 16))
    merger = Merger(ctx, checkpoints=None, no_shows=NoShows(lambda: 0))
    assert [r.delegate for r in merger._read_wide()] == [HONEST]
    assert reader.other_records == 2  # both were read: the DHT traffic is counted as it was
    reader.banned = lambda peer: False
    assert [r.delegate for r in merger._read_wide()] == [HONEST, LIAR]
