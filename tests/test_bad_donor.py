"""A donor that serves a bad state is refused, reported and not asked again (``StateSync``, with fakes for the
averager's download and the DHT's view; the state files, the checks and the trust rule are the real ones).

A bad state: a file whose bytes do not match its own header (damaged, or made up), or a file that checks out but
is another state of the epoch the donor voted for (a poisoned model with a checksum of its own). A donor that
served an older epoch is no liar (its round may have ended meanwhile): it is asked again."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_groups import view_of
from test_swarm_view import record

from swarm.averager.trickle import TooSlow
from swarm.dht.view import ResyncReason, consensus, trusted_consensus
from swarm.events import AwaitingMajority, ClaimDoubted, DonorDistrusted, DownloadFailed, StateLoaded
from swarm.manifest import AveragingSpec, OuterOptimizerSpec
from swarm.state import file as state_file
from swarm.state import sync as sync_module
from swarm.state import trust
from swarm.state.outer import OuterState
from swarm.state.store import StateStore
from swarm.state.sync import MAX_DISTRUSTED, Resynced, StateSync

RUN = "0123456789abcdef"
SHAPES = [(4, 3), (5,)]
EPOCH = 7


def state(seed: int, epoch: int = EPOCH) -> OuterState:
    generator = torch.Generator().manual_seed(seed)
    outer = OuterState([torch.randn(*s, generator=generator) for s in SHAPES], OuterOptimizerSpec(), epoch=epoch)
    for m in outer.momentum:
        m.copy_(torch.randn(m.shape, generator=generator))
    return outer


def write(path: Path, outer: OuterState, checksum: str | None = None) -> Path:
    state_file.write(path, run_id=RUN, epoch=outer.epoch, checksum=checksum or outer.checksum(),
                     params=outer.params, momentum=outer.momentum)  # fmt: skip
    return path


class Donors:
    """The averager's side: each donor serves the file it was given; every request is recorded."""

    def __init__(self, files: dict[str, Path]):
        self.files, self.asked = files, []
        self.allow_state_sharing = True

    def download_state(self, donor: str, destination: Path, **kwargs) -> dict:
        self.asked.append(donor)
        shutil.copyfile(self.files[donor], destination)
        return {}

    def note_epoch(self, epoch: int) -> None:
        pass


def make_sync(tmp_path: Path, files: dict[str, Path], good: str, extra_votes: int = 0):
    events = []
    # every donor votes for the honest state; two more honest voters that serve nothing are in ``extra_votes``
    voters = [*files, *(f"voter{i}" for i in range(extra_votes))]
    records = [record(p, EPOCH, checksums=[(EPOCH, good)]) for p in voters]
    # voters that serve nothing (client mode): never donors
    view = view_of(*(r.copy(update=dict(client_mode=r.peer_id.startswith("voter"))) for r in records))
    averaging = AveragingSpec(chunk_timeout=5.0, allreduce_timeout=30.0)  # a download bounded by its size too
    ctx = SimpleNamespace(
        manifest=SimpleNamespace(run_id=RUN, averaging=averaging),
        me="joiner",
        outer=state(99, epoch=0),
        params=[torch.zeros(*s) for s in SHAPES],
        averager=Donors(files),
        reader=SimpleNamespace(view=lambda: view),
        emit=events.append,
        set_state=lambda state, now: None,
        shield=contextlib.nullcontext,
        stop_requested=lambda: False,
    )
    checkpoints = SimpleNamespace(store=StateStore(tmp_path / "state", RUN), extra=dict)
    sync = StateSync(ctx, checkpoints, begin_round=lambda: None)
    sync.replay.missed_rounds = lambda: False  # no update files here: the whole state is downloaded
    return sync, ctx, events


def test_bad_donors_are_refused_reported_and_not_asked_again(tmp_path, monkeypatch):
    honest = state(1)
    poisoned = state(1)
    poisoned.params[0].mul_(-4.0)  # a consistent file: its own checksum matches its bytes
    poisoned._checksum = None
    files = {
        "liar": write(tmp_path / "liar.st", poisoned),
        "damaged": write(tmp_path / "damaged.st", poisoned, checksum=honest.checksum()),  # bytes != header
        "stale": write(tmp_path / "stale.st", state(1, epoch=EPOCH - 1)),
        "honest": write(tmp_path / "honest.st", honest),
    }
    order = list(files)  # liars first
    monkeypatch.setattr(sync_module.random, "shuffle", lambda donors: donors.sort(key=order.index))
    sync, ctx, events = make_sync(tmp_path, files, honest.checksum())

    assert sync.download_consensus_state()
    assert ctx.averager.asked == ["liar", "damaged", "stale", "honest"]
    assert ctx.outer.checksum() == honest.checksum() and ctx.outer.epoch == EPOCH
    assert all(torch.equal(a, b) for a, b in zip(ctx.outer.tensors(), honest.tensors()))
    distrusted = [e for e in events if isinstance(e, DonorDistrusted)]
    assert [e.donor for e in distrusted] == ["liar", "damaged"]
    assert "not the one most peers hold" in distrusted[0].reason and "do not match" in distrusted[1].reason
    assert [e.donor for e in events if isinstance(e, DownloadFailed)] == ["stale"]  # no lie: asked again
    assert [e.donor for e in events if isinstance(e, StateLoaded)] == ["honest"]
    assert set(sync.distrusted) == {"liar", "damaged"}

    # the next re-sync (of a peer that lost that state again) skips them, and asks the stale donor again
    ctx.averager.asked.clear()
    ctx.outer = state(99, epoch=0)
    assert sync.download_consensus_state()
    assert ctx.averager.asked == ["stale", "honest"]


def test_a_donor_that_trickles_is_distrusted_and_not_asked_again(tmp_path, monkeypatch):
    """The averager gave up on it below the rate floor (``swarm.averager.trickle``): it is not asked again, so a
    trickler holds a joiner one window per join, not a download's whole bound at every try."""
    honest = state(1)
    files = {"trickler": write(tmp_path / "trickler.st", honest), "honest": write(tmp_path / "honest.st", honest)}
    order = list(files)
    monkeypatch.setattr(sync_module.random, "shuffle", lambda donors: donors.sort(key=order.index))
    sync, ctx, events = make_sync(tmp_path, files, honest.checksum())
    serve = ctx.averager.download_state

    def download_state(donor, destination, **kwargs):
        assert kwargs["min_rate"] == ctx.manifest.averaging.min_rate  # the floor reaches the download
        if donor == "trickler":
            ctx.averager.asked.append(donor)
            raise TooSlow("download from trickler: 0.01 Mbit/s over the last 60 s, below the floor of 1.00 Mbit/s")
        return serve(donor, destination, **kwargs)

    ctx.averager.download_state = download_state
    assert sync.download_consensus_state()
    assert ctx.averager.asked == ["trickler", "honest"]
    assert [e.donor for e in events if isinstance(e, DonorDistrusted)] == ["trickler"]
    ctx.averager.asked.clear()
    ctx.outer = state(99, epoch=0)
    assert sync.download_consensus_state()
    assert ctx.averager.asked == ["honest"]


def test_only_bad_donors_left_is_a_failed_download_not_a_poisoned_state(tmp_path, monkeypatch):
    honest = state(1)
    poisoned = state(2)
    files = {"liar": write(tmp_path / "liar.st", poisoned)}
    monkeypatch.setattr(sync_module.time, "sleep", lambda s: None)
    sync, ctx, events = make_sync(tmp_path, files, honest.checksum(), extra_votes=2)
    before = ctx.outer.checksum()
    assert not sync.download_consensus_state()
    assert ctx.averager.asked == ["liar"]  # once: never again in the later attempts
    assert ctx.outer.checksum() == before and ctx.outer.epoch == 0
    assert not [e for e in events if isinstance(e, StateLoaded)]


def test_the_memory_of_bad_donors_is_bounded(tmp_path):
    sync, _, events = make_sync(tmp_path, {}, "a" * 64)
    for i in range(MAX_DISTRUSTED + 10):
        sync._distrust(f"key{i}", "made up")
    assert len(sync.distrusted) == MAX_DISTRUSTED and "key0" not in sync.distrusted
    assert f"key{MAX_DISTRUSTED + 9}" in sync.distrusted and len(events) == MAX_DISTRUSTED + 10


def test_a_lie_is_a_holders_other_state_of_the_wanted_epoch():
    good, bad = "a" * 64, "b" * 64
    view = view_of(record("p1", 5, checksums=[(5, good)]), record("p2", 5, checksums=[(5, good)]))
    wanted = trusted_consensus(view.peers, 5)
    assert trust.served_a_lie("p1", 5, bad, wanted)
    assert not trust.served_a_lie("p1", 5, good, wanted)
    assert not trust.served_a_lie("p1", 4, bad, wanted)  # an older round's file: its round moved on
    assert not trust.served_a_lie("p1", 6, bad, wanted)  # a later one: checked as the swarm's next epoch
    assert not trust.served_a_lie("p3", 5, bad, wanted)  # not a holder: it never said it held the wanted state


def test_the_benchmarks_bad_donor_is_caught_by_this_rule(tmp_path, monkeypatch):
    """``benchmarks.liar_records``' bad donor: the file it streams passes every check of its own (header, sha256,
    CRC) and is of the epoch it voted for; only the swarm's vote tells it apart, and the joiner distrusts it."""
    import asyncio

    from hivemind.utils.serializer import MSGPackSerializer

    from benchmarks import liar_records
    from swarm.averager.transfer import FileTransfer

    monkeypatch.setattr(FileTransfer, "_stream_file", FileTransfer._stream_file)  # restored after the test
    liar_records.install_bad_donor(-4.0)
    honest = state(1)
    served = write(tmp_path / "served.st", honest)

    async def stream() -> bytes:
        donor = SimpleNamespace(serializer=MSGPackSerializer)
        return b"".join([m.tensor_part.buffer async for m in FileTransfer._stream_file(donor, served, EPOCH)])

    poisoned = tmp_path / "poisoned.st"
    poisoned.write_bytes(asyncio.run(stream()))
    header = state_file.check(poisoned, run_id=RUN, shapes=SHAPES)
    assert header.epoch == EPOCH and header.checksum != honest.checksum()
    assert not (tmp_path / "served.st.poisoned").exists()  # the liar's scratch file is gone

    monkeypatch.setattr(sync_module.random, "shuffle", lambda donors: donors.sort(key=["liar", "honest"].index))
    sync, ctx, events = make_sync(tmp_path, {"liar": poisoned, "honest": served}, honest.checksum())
    assert sync.download_consensus_state() and ctx.outer.checksum() == honest.checksum()
    assert [e.donor for e in events if isinstance(e, DonorDistrusted)] == ["liar"]


def test_the_benchmarks_lying_records_are_records_a_reader_parses():
    """The votes ``benchmarks.liar_records`` publishes are well-formed records (so the benchmark tests the vote
    rules, not the parser): two epochs ahead, the made-up checksum for every epoch listed."""
    from benchmarks.liar_records import AHEAD, BAD, _initial_peers, _lie_in
    from swarm.dht.records import ProgressRecord

    fields = record("Qmx", 5, checksums=[(5, "a" * 64)]).dict()
    lie = ProgressRecord(**_lie_in(fields, 5))
    assert lie.epoch == 5 + AHEAD and {c.checksum for c in lie.checksums} == {BAD}
    assert lie.checksum_at(5) == BAD and lie.checksum_at(5 + AHEAD) == BAD
    argv = ["join", "--initial-peers", "/ip4/1/tcp/2/p2p/Qm1", "/ip4/3/tcp/4/p2p/Qm2", "--run", "ab"]
    assert _initial_peers(argv) == argv[2:4] and _initial_peers(["join"]) == []


def split_swarm_states(monkeypatch):
    """The states of a split swarm: the one of epoch 6 it held as one, two groups' states of 7 (h1, h2), and an
    attacker's poisoned state of 7, a file that checks out on its own. Downloads neither sleep nor shuffle."""
    monkeypatch.setattr(sync_module.time, "sleep", lambda s: None)
    monkeypatch.setattr(sync_module.random, "shuffle", lambda donors: donors.sort())
    before, h1, h2 = state(1, epoch=EPOCH - 1), state(2), state(3)
    poisoned = state(2)
    poisoned.params[0].mul_(-4.0)
    poisoned._checksum = None
    return before, h1, h2, poisoned


def test_a_third_of_the_keys_serving_the_state_they_vote_for_never_reaches_a_joiner(tmp_path, monkeypatch):
    """A split swarm (four honest peers whose round of epoch 7 ended in two groups, from one state of epoch 6, two
    of them still at 6) and two attacker keys, a third of six, with the lowest ids: they vote for a poisoned state
    of epoch 7 and serve it, a file that checks out on its own. Their vote is the plurality (the rule before took
    it); the joiner takes the epoch before, which four of six hold, and never loads the poison."""
    before, h1, h2, poisoned = split_swarm_states(monkeypatch)
    files = {
        "0liar0": write(tmp_path / "poison.st", poisoned),
        "0liar1": write(tmp_path / "poison.st", poisoned),
        "a": write(tmp_path / "h1.st", h1),
        "b": write(tmp_path / "before-b.st", before),
        "c": write(tmp_path / "h2.st", h2),
        "d": write(tmp_path / "before-d.st", before),
    }
    old = (EPOCH - 1, before.checksum())
    records = [record(k, EPOCH, checksums=[old, (EPOCH, poisoned.checksum())]) for k in ("0liar0", "0liar1")]
    records += [record("a", EPOCH, checksums=[old, (EPOCH, h1.checksum())]), record("b", EPOCH - 1, checksums=[old])]
    records += [record("c", EPOCH, checksums=[old, (EPOCH, h2.checksum())]), record("d", EPOCH - 1, checksums=[old])]
    sync, ctx, events = make_sync(tmp_path, files, before.checksum())
    view = view_of(*records)
    ctx.reader = SimpleNamespace(view=lambda: view)
    assert view.global_epoch == EPOCH and consensus(view.peers, EPOCH).checksum == poisoned.checksum()
    sync.catch_up(resumed=False, expect_others=False)
    loaded = [(e.donor, e.epoch) for e in events if isinstance(e, StateLoaded)]
    assert loaded == [("b", EPOCH - 1)] and ctx.outer.checksum() == before.checksum()
    assert "0liar0" not in ctx.averager.asked and "0liar1" not in ctx.averager.asked


def test_a_third_of_the_keys_serving_the_state_they_vote_for_never_reaches_a_running_peer(tmp_path, monkeypatch):
    """A split swarm from a running peer's side: "c" holds its group's state of epoch 7 (h2, with "f"), "a" and "e"
    another group's (h1), two peers are still at 6, and two attacker keys with the lowest ids vote for a poisoned
    state of 7 and serve it: the plurality (a tie of two, the lowest ids). Before, "c" re-synced to the poison. Now
    it takes the most common state that it or a recent groupmate holds (``running_consensus``): with no groupmate
    it keeps its own; with "a" among its groupmates of earlier rounds it loads h1 (the lower ids of a tie) from
    "a" and never asks the attacker's keys; only a liar that averaged with it makes the poison a candidate."""
    before, h1, h2, poisoned = split_swarm_states(monkeypatch)
    files = {
        "0liar0": write(tmp_path / "poison.st", poisoned),
        "0liar1": write(tmp_path / "poison.st", poisoned),
        "a": write(tmp_path / "h1.st", h1),
        "e": write(tmp_path / "h1.st", h1),
        "d": write(tmp_path / "before-d.st", before),
    }
    old = (EPOCH - 1, before.checksum())
    records = [record(k, EPOCH, checksums=[old, (EPOCH, poisoned.checksum())]) for k in ("0liar0", "0liar1")]
    records += [record(k, EPOCH, checksums=[old, (EPOCH, h1.checksum())]) for k in ("a", "e")]
    records += [record(k, EPOCH, checksums=[old, (EPOCH, h2.checksum())]) for k in ("c", "f")]
    records += [record(k, EPOCH - 1, checksums=[old]) for k in ("b", "d")]
    sync, ctx, events = make_sync(tmp_path, files, before.checksum())
    ctx.me, ctx.outer = "c", h2
    sync.checkpoints.announce = lambda inner_step: None
    view = view_of(*records)
    ctx.reader = SimpleNamespace(view=lambda: view)
    assert consensus(view.peers, EPOCH).checksum == poisoned.checksum()  # what a running peer took before
    assert sync.resync_needed(EPOCH, last_round_local=False) is None  # nobody it met holds another state
    sync.groupmates.note(["a", "c", "b"], "c")  # an earlier round's group
    assert sync.resync_needed(EPOCH, last_round_local=False).reason == ResyncReason.disagreed
    assert sync.resync("disagreed") == Resynced.taken
    assert [(e.donor, e.epoch) for e in events if isinstance(e, StateLoaded)] == [("a", EPOCH)]
    assert ctx.outer.checksum() == h1.checksum() and ctx.averager.asked == ["a"]
    # a liar that averaged with it lately: the poison is a candidate again (the limit, docs/security.md)
    sync.groupmates.note(["0liar1"], "c")
    assert sync.resync_needed(EPOCH, last_round_local=False).reason == ResyncReason.disagreed
    # until it is caught: banned keys are no evidence
    sync.groupmates.forget(["0liar1"])
    assert sync.resync_needed(EPOCH, last_round_local=False) is None


def test_a_joiner_waits_for_half_of_the_keys_while_a_round_ended_apart_and_doubts_nobody(tmp_path, monkeypatch):
    """Six honest peers at epoch 7 in three groups of two that ended apart (nobody still at 6 to serve the state the
    whole swarm held): the joiner waits instead of taking one group's state or doubting anyone; once the running
    peers re-synced to the plurality (four of six), it loads that."""
    monkeypatch.setattr(sync_module.time, "sleep", lambda s: None)
    before, states = state(1, epoch=EPOCH - 1), [state(2), state(3), state(4)]
    files = {f"p{i}": write(tmp_path / f"p{i}.st", states[i // 2]) for i in range(6)}
    old = (EPOCH - 1, before.checksum())
    apart = view_of(*(record(f"p{i}", EPOCH, checksums=[old, (EPOCH, states[i // 2].checksum())]) for i in range(6)))
    mended = view_of(*(record(f"p{i}", EPOCH, checksums=[old, (EPOCH, states[min(i // 2, 1)].checksum())])
                       for i in range(6)))  # fmt: skip
    sync, ctx, events = make_sync(tmp_path, files, before.checksum())
    reads = iter([apart] * 5)
    ctx.reader = SimpleNamespace(view=lambda: next(reads, mended))
    files.update({f"p{i}": write(tmp_path / f"mended{i}.st", states[1]) for i in range(4, 6)})
    assert trust.wanted(apart).epoch == EPOCH - 1 and not trust.servable(apart, trust.wanted(apart), "joiner")
    sync.catch_up(resumed=False, expect_others=False)
    assert [e.epoch for e in events if isinstance(e, AwaitingMajority)] == [EPOCH]
    assert [e.epoch for e in events if isinstance(e, StateLoaded)] == [EPOCH]
    assert ctx.outer.checksum() == states[1].checksum()
    assert not [e for e in events if isinstance(e, ClaimDoubted)]

    # a swarm that stays apart: the joiner gives up after its wait, with the usual message, and doubts nobody
    from swarm.errors import StateDownloadError

    sync, ctx, events = make_sync(tmp_path / "again", files, before.checksum())
    ctx.reader = SimpleNamespace(view=lambda: apart)
    with pytest.raises(StateDownloadError):
        sync.catch_up(resumed=False, expect_others=False)
    assert not [e for e in events if isinstance(e, (ClaimDoubted, StateLoaded))]
