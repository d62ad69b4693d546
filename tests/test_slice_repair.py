"""A reducer's average that reached us in part is fetched again from it, whole, and kept only if it is what the
reducer signed and agrees with every part we did receive; else the slice is dropped as before.

The averager's fetches are replaced by fakes that serve real signed receipts and real wire parts: what is tested
is the rule that decides, not the network (tests/test_engine_overlap.py runs the averager for real).
"""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import NoCompression, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm.averager.audit_requests import FETCH_ATTEMPTS
from swarm.averager.audit_serving import AuditRequest, AuditRound, kept_for
from swarm.averager.auditing import Auditing
from swarm.averager.held import Dropped
from swarm.averager.repair import UNANSWERED_STRIKES, RepairFailure, restore_slice, slices_to_repair
from swarm.defence.audit import FALSE_ACCUSATION, Verdict, auditor_of
from swarm.defence.receipts import Receipt, digest_parts
from swarm.dht.identity import peer_id_of_owner

GROUP = b"g" * 20


def part(seed: int, size: int) -> runtime_pb2.Tensor:
    return serialize_torch_tensor(torch.randn(size, generator=torch.Generator().manual_seed(seed)))


class FakeFetches(Auditing):
    """The averager's side of a repair, with the reducer's answers given instead of fetched over libp2p."""

    def __init__(self, receipt: Receipt | None, served: list[runtime_pb2.Tensor], fail: float = 0, cut: int = 0):
        self._receipt, self._served = receipt, served
        self._fail = fail  # receipt requests that break before one is answered (inf: the reducer is gone)
        self._cut = cut  # fetches of the average that break before one is served whole
        self.requests = 0

    async def _fetch_receipt(self, record, reducer):
        self.requests += 1
        if self._fail > 0:
            self._fail -= 1
            raise ConnectionResetError("the stream was cut")
        return self._receipt, b"", {}

    async def _fetch_parts(self, record, sender, reducer, limit, what=AuditRequest.parts, indices=None):
        assert what is AuditRequest.output and sender == reducer and indices is None
        self.requests += 1
        if self._cut > 0:  # its stream breaks again, on a loaded host or link
            self._cut -= 1
            raise ConnectionResetError("the stream was cut")
        return list(self._served)


@pytest.fixture(scope="module")
def reducer() -> str:
    key = RSAPrivateKey()
    return peer_id_of_owner(b"[owner:" + key.get_public_key().to_bytes() + b"]")


def partial_copy(reducer: str, whole: list[runtime_pb2.Tensor]) -> tuple[AuditRound, list[list], dict]:
    """Our copy of ``reducer``'s slice (three parts of tensor 0) with its last part missing, as held."""
    mine = part(99, 300)
    held = [[mine, whole[0], whole[1], Dropped(whole[2].size[0])]]
    owner = {(0, 0): "us", (0, 1): reducer, (0, 2): reducer, (0, 3): reducer}
    # the round's runner: only its codec is read (a repair's parts are admitted in the run's codec)
    runner = SimpleNamespace(tensor_part_container=SimpleNamespace(compression=NoCompression()))
    record = AuditRound(members=["us", reducer], runner=runner)
    record.outputs[reducer] = [held[0][1], held[0][2], held[0][3]]
    return record, held, owner


def repair(auditing: Auditing, record: AuditRound, reducer: str):
    return asyncio.run(auditing._repair_slice(record, reducer, time.monotonic() + 5))


def test_a_slice_that_came_in_part_is_restored_from_the_reducers_signed_average(reducer):
    whole = [part(1, 200), part(2, 200), part(3, 150)]
    receipt = Receipt(GROUP, reducer, ("us", reducer), (1.0, 1.0), (b"", b""), digest_parts(whole))
    record, held, owner = partial_copy(reducer, whole)
    parts = repair(FakeFetches(receipt, whole), record, reducer)
    assert not isinstance(parts, RepairFailure), parts
    assert restore_slice(held, owner, reducer, parts) == 150  # the missing part's values
    assert [p.SerializeToString() for p in held[0][1:]] == [p.SerializeToString() for p in whole]
    assert held[0][0] is not None and not isinstance(held[0][0], Dropped)  # our own part is untouched


@pytest.mark.parametrize(
    ("lie", "failure"),
    [
        ("unsigned", RepairFailure.not_signed),
        ("other-than-received", RepairFailure.disagrees),
        ("wrong-size", RepairFailure.disagrees),
        ("no-receipt", RepairFailure.no_receipt),
        ("unreachable", RepairFailure.unreachable),
    ],
)
def test_a_repair_that_is_not_the_signed_average_or_disagrees_with_what_came_is_refused(reducer, lie, failure):
    whole = [part(1, 200), part(2, 200), part(3, 150)]
    served, signed = list(whole), list(whole)
    if lie == "unsigned":  # another average than the one in the receipt its auditor checked
        served[2] = part(4, 150)
    elif lie == "other-than-received":  # signed, but not what it streamed to us the first time
        served[0] = signed[0] = part(5, 200)
    elif lie == "wrong-size":
        served[2] = signed[2] = part(3, 151)
    receipt = Receipt(GROUP, reducer, ("us", reducer), (1.0, 1.0), (b"", b""), digest_parts(signed))
    record, held, owner = partial_copy(reducer, whole)
    fetches = FakeFetches(None if lie == "no-receipt" else receipt, served, fail=math.inf * (lie == "unreachable"))
    assert repair(fetches, record, reducer) is failure  # the reason, as the round's report carries it
    assert isinstance(held[0][3], Dropped)  # nothing changed: the caller drops the slice whole


@pytest.mark.parametrize(("fail", "cut"), [(1, 0), (0, 1), (1, 1), (0, FETCH_ATTEMPTS - 1)])
def test_a_request_whose_stream_breaks_is_made_again_before_the_slice_is_given_up(reducer, fail, cut):
    """One broken stream is not a reducer that is gone: without a second try the slice was dropped, this peer's
    state left the group's and it re-synced (or, in an audit, an honest reducer got a strike)."""
    whole = [part(1, 200), part(2, 200), part(3, 150)]
    receipt = Receipt(GROUP, reducer, ("us", reducer), (1.0, 1.0), (b"", b""), digest_parts(whole))
    record, held, owner = partial_copy(reducer, whole)
    fetches = FakeFetches(receipt, whole, fail=fail, cut=cut)
    parts = repair(fetches, record, reducer)
    assert not isinstance(parts, RepairFailure), parts
    assert restore_slice(held, owner, reducer, parts) == 150
    assert fetches.requests == 2 + fail + cut


def test_a_reducer_that_is_gone_is_asked_a_bounded_number_of_times(reducer):
    whole = [part(1, 200), part(2, 200), part(3, 150)]
    receipt = Receipt(GROUP, reducer, ("us", reducer), (1.0, 1.0), (b"", b""), digest_parts(whole))
    record, _, _ = partial_copy(reducer, whole)
    gone = FakeFetches(receipt, whole, fail=math.inf)
    assert repair(gone, record, reducer) is RepairFailure.unreachable
    assert gone.requests == FETCH_ATTEMPTS
    # it hands over its receipt (it is alive, and signed for the round), then never its average: withheld, a strike
    keeps = FakeFetches(receipt, whole, cut=math.inf)
    assert repair(keeps, record, reducer) is RepairFailure.withheld
    assert keeps.requests == 1 + FETCH_ATTEMPTS
    late = FakeFetches(receipt, whole, fail=math.inf)  # the deadline has passed: one try, none again
    assert asyncio.run(late._repair_slice(record, reducer, time.monotonic())) is RepairFailure.unreachable
    assert late.requests == 1


def test_a_round_is_kept_for_a_groupmate_repairing_at_its_latest():
    """A groupmate waits up to ``audit_timeout`` for its auditors' verdicts, then repairs for up to another: the
    round it asks about must still be kept then (it was let go after one timeout: ``no_receipt``, a dropped slice
    and a re-sync for that groupmate)."""
    for audit_timeout in (5.0, 30.0):
        assert kept_for(audit_timeout) > 2 * audit_timeout


def test_only_slices_that_came_in_part_from_a_reducer_we_did_not_refuse_are_fetched_again():
    whole, cut = [part(1, 8), part(2, 8)], [part(1, 8), Dropped(8)]
    outputs = {"me": cut, "honest": whole, "cut-short": cut, "refused": [Dropped(8), Dropped(8)]}
    assert slices_to_repair(outputs, "me", refused={"refused"}) == ["cut-short"]
    assert slices_to_repair(outputs, "me", refused=set()) == ["cut-short", "refused"]


def test_a_reducer_that_signs_then_keeps_its_average_from_us_is_struck_and_then_banned(reducer):
    """A reducer alive enough to hand over its receipt that then never serves the average it signed (or serves
    another) gets a strike for each round, as an audit it would not let us make; ``UNANSWERED_STRIKES`` in a row
    ban it. One that is plainly gone (no receipt) is not struck: a vanished peer is not a liar."""
    whole = [part(1, 200), part(2, 200), part(3, 150)]
    receipt = Receipt(GROUP, reducer, ("us", reducer), (1.0, 1.0), (b"", b""), digest_parts(whole))
    runner = SimpleNamespace(refused_senders=set())
    for fetches, struck in ((FakeFetches(receipt, whole, cut=math.inf), True), (FakeFetches(None, whole), False)):
        fetches.peer_id, fetches._unanswered = SimpleNamespace(to_base58=lambda: "us"), {}
        found = []
        for _ in range(UNANSWERED_STRIKES):
            record, held, owner = partial_copy(reducer, whole)
            dropped, failures, restored, withheld = asyncio.run(
                fetches._repair_partial_slices(runner, record, held, owner, time.monotonic() + 5)
            )
            assert dropped > 0 and restored == [] and len(failures) == 1 and isinstance(held[0][3], Dropped)
            found += withheld
        if struck:
            assert [(f[0], f[1], f[4]) for f in found] == [
                (reducer, Verdict.withheld, False), (reducer, Verdict.withheld, True)
            ]  # fmt: skip
        else:
            assert found == []


def test_a_reducer_bans_the_auditor_that_says_it_lied():
    """We know our own average: an auditor's word that it was wrong is a false accusation, which we ban as every
    groupmate whose check of us passed does; a verdict that passed us, or one we never signed a receipt for,
    bans nobody."""
    members = ["us", "a", "b"]
    runner = SimpleNamespace(group_id=GROUP)
    auditing = Auditing.__new__(Auditing)
    auditing.peer_id = SimpleNamespace(to_base58=lambda: "us")
    accuser = auditor_of(members, GROUP, "us")
    for verdict, signed, banned in [
        (Verdict.wrong_average, True, [accuser]), (Verdict.equivocated, True, [accuser]),
        (Verdict.passed, True, []), (Verdict.inconclusive, True, []), (Verdict.wrong_average, False, []),
    ]:  # fmt: skip
        record = AuditRound(members=members, runner=runner, receipt=b"signed" if signed else None)
        record.verdicts["us"] = verdict
        found = auditing._accusations_of_us(record)
        assert [f[0] for f in found if f[1] == FALSE_ACCUSATION and f[4]] == banned, verdict


def test_a_reducer_waits_for_its_own_auditors_verdict_while_that_auditor_is_with_us():
    """Heard late, an accusation of us went unanswered: we kept grouping with the liar our groupmates had banned,
    and the two sides of the group ended apart (the byzantine benchmark's ``accuse``, 2 runs of 3)."""
    members = ["us", "a", "b"]
    auditing = Auditing.__new__(Auditing)
    auditing.peer_id = SimpleNamespace(to_base58=lambda: "us")
    record = AuditRound(members=members, runner=SimpleNamespace(group_id=GROUP))
    ours = auditor_of(members, GROUP, "us")
    assert auditing._our_auditor_present(record, members) == ["us"]
    assert auditing._our_auditor_present(record, [m for m in members if m != ours]) == []  # our auditor is gone
    assert auditing._our_auditor_present(record, [m for m in members if m != "us"]) == []  # we reduced nothing
