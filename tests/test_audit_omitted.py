"""A receipt that counts a sender short (its stream broke) while more of the reducer's average came back to that
sender than the receipt counts of it: the reducer counted at least as many of its parts as it returned averages of
(it returns a part's average only once it counted the part), so the receipt omits parts a sender sent, or that sender
lies. Either way the slice is dropped for the whole group, and nobody is struck on a sender's word. The averager's
requests are replaced by fakes: what is tested is the rule, over real records."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.averager.audit_serving import AuditRequest, AuditRound, AuditServing
from swarm.averager.auditing import Auditing
from swarm.defence.audit import Verdict
from swarm.defence.receipts import Receipt

GROUP = b"g" * 20
A, B, C = (PeerID(bytes([0x12, 0x20, i]) + bytes(32)) for i in (1, 2, 3))


class Served(AuditServing):
    """The serving side: a round in which our whole average from ``B`` came back (3 parts), and 1 part of ``C``'s."""

    serializer = MSGPackSerializer

    def __init__(self):
        members = [A.to_base58(), B.to_base58(), C.to_base58()]
        self.record = AuditRound(members=members, runner=SimpleNamespace(group_id=GROUP), done=True)
        self.record.returned = {B.to_base58(): 3, C.to_base58(): 1}
        self._audit_rounds, self._audit_timeout = {GROUP: self.record}, 1.0

    def _admitted(self, request, context):
        return MSGPackSerializer.loads(request.metadata)


def ask(served: Served, asker: PeerID, reducer: PeerID) -> int | None:
    fields = dict(group_id=GROUP, what=AuditRequest.returned.value, reducer=reducer.to_base58())
    request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(fields))

    async def first():
        async for message in served.rpc_audit_fetch(request, SimpleNamespace(remote_id=asker)):
            return MSGPackSerializer.loads(message.metadata)["returned"]
        return None

    return asyncio.run(first())


def test_a_groupmate_says_how_much_of_a_reducers_average_came_back_to_it():
    served = Served()
    assert ask(served, A, B) == 3
    assert ask(served, A, C) == 1
    assert ask(served, A, A) == 0  # a reducer it holds nothing of
    outsider = PeerID(bytes([0x12, 0x20, 9]) + bytes(32))
    assert ask(served, outsider, B) is None  # only groupmates of the round are answered


class Asking(Auditing):
    """The auditing side, with each sender's answer given instead of fetched."""

    def __init__(self, answers: dict, me: str = "me"):
        self.peer_id = SimpleNamespace(to_base58=lambda: me)
        self.answers, self.asked = answers, []
        self._unanswered = {}

    async def _fetch_returned(self, record, sender, reducer):
        self.asked.append(sender)
        answer = self.answers[sender]
        if isinstance(answer, Exception):
            raise answer
        return answer


def receipt(counts) -> Receipt:
    senders = ("me", "reducer", "s1", "s2")
    inputs = tuple(b"d" * 32 if k else b"" for k in counts)
    return Receipt(GROUP, "reducer", senders, (1.0,) * 4, inputs, b"o" * 32, (b"",) * 4, b"n" * 16, tuple(counts))


def says(auditing: Asking, counts) -> bool:
    record = AuditRound(members=["me", "reducer", "s1", "s2"], runner=SimpleNamespace(group_id=GROUP))
    return asyncio.run(auditing._a_sender_had_more_back(record, receipt(counts), 3, 1e12))


def test_only_senders_counted_short_are_asked_and_one_that_had_more_back_is_enough():
    auditing = Asking({"s1": 0, "s2": 3})
    assert says(auditing, [3, 3, 0, 2]) and sorted(auditing.asked) == ["s1", "s2"]  # s2: 3 back, counted for 2
    auditing = Asking({"s1": 1, "s2": 2})
    assert not says(auditing, [3, 3, 1, 2])  # as many back as counted: a real break (or a cut we cannot tell)
    auditing = Asking({"s1": 0})
    assert not says(auditing, [3, 3, 0, 3]) and auditing.asked == ["s1"]  # s2 counted whole: not asked
    auditing = Asking({"s1": ConnectionResetError("gone")})
    assert not says(auditing, [3, 3, 1, 3])  # a sender that is gone says nothing: a real drop
    assert len(auditing.asked) > 1  # asked again within the deadline before it is given up
    auditing = Asking({})
    assert not says(auditing, [0, 1, 3, 3]) and auditing.asked == []  # ourselves and the reducer: never asked


class Rechecking(Auditing):
    """A groupmate told by an auditor that a reducer omitted a sender: its own check, given."""

    def __init__(self, own: Verdict):
        self.peer_id = SimpleNamespace(to_base58=lambda: "me")
        self.own, self._unanswered = own, {}

    async def _audit_one(self, record, reducer, deadline, also=()):
        return self.own, None, []


def test_a_groupmate_told_of_an_omission_drops_the_slice_if_it_finds_it_too_and_strikes_nobody():
    members = ["me", "reducer", "s1"]
    for own, found in [(Verdict.omitted, [("reducer", Verdict.omitted, None, True, False)]), (Verdict.passed, [])]:
        record = AuditRound(members=members, runner=SimpleNamespace(group_id=GROUP))
        record.verdicts["reducer"] = Verdict.omitted
        assert asyncio.run(Rechecking(own)._recheck_accusations(record, ["reducer"], 1e12)) == found, own


def test_a_reducer_that_counts_its_auditor_short_and_leaves_us_unable_to_check_loses_its_slice_for_all():
    """Its auditor says it withheld (its receipt counts the auditor's stream as broken, while the auditor's whole
    average came back); our own check cannot tell (inconclusive): one of them lies, so the slice goes for everyone,
    and nobody is struck on the auditor's word. A receipt that counts the auditor whole leaves the slice as it is."""
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.defence.audit import auditor_of
    from tests.test_audit import peer_of

    keys = [RSAPrivateKey() for _ in range(3)]
    members = [peer_of(k) for k in keys]
    me, reducer = members[0], members[1]
    group = next(bytes([i]) * 20 for i in range(256) if auditor_of(members, bytes([i]) * 20, reducer) != me)
    auditor = auditor_of(members, group, reducer)
    for auditor_count, found in [(1, [(reducer, Verdict.withheld, None, True, False)]), (3, [])]:
        counts = tuple(auditor_count if m == auditor else 3 for m in members)
        receipt = Receipt(group, reducer, tuple(members), (1.0,) * 3, (b"d" * 32,) * 3, b"o" * 32, (b"v" * 32,) * 3,
                          b"n" * 16, counts)  # fmt: skip
        blob = receipt.sign(keys[1])
        checker = Rechecking(Verdict.inconclusive)
        checker.peer_id = SimpleNamespace(to_base58=lambda: me)
        checker._audit_one = lambda *args, blob=blob, **kwargs: _said(Verdict.inconclusive, blob)
        record = AuditRound(members=members, runner=SimpleNamespace(group_id=group))
        record.outputs[reducer] = [None] * 3
        record.verdicts[reducer] = Verdict.withheld
        assert asyncio.run(checker._recheck_accusations(record, [reducer], 1e12)) == found, auditor_count


async def _said(verdict, blob):
    return verdict, blob, []


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=256), st.builds(MSGPackSerializer.dumps, st.dictionaries(
    st.sampled_from(["returned", "completed", "x"]),
    st.one_of(st.integers(-(2**63), 2**64 - 1), st.booleans(), st.floats(), st.binary(max_size=8), st.none()),
))))  # fmt: skip
def test_a_returned_count_from_another_machine_is_a_small_count_or_zero_and_never_raises(metadata):
    from swarm.averager.audit_requests import returned_count

    count = returned_count(metadata)
    assert isinstance(count, int) and not isinstance(count, bool) and 0 <= count < 2**31
    assert returned_count(MSGPackSerializer.dumps(dict(returned=7))) == 7
