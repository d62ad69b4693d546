"""A sender that is gone, or serves its auditor other bytes than it signed (a lying reducer's accomplice): the audit
takes that sender's parts from the reducer itself, as they came to it, checked against the sender's signed statement.

Before, such a slice could not be checked (``inconclusive``: nothing dropped, nobody struck), so a lying reducer kept
its lie whenever one groupmate vanished after sending, or whenever a second key of its own sat in its group and served
nothing. A reducer cannot forge a sender's parts (the sender signed their digest), and an honest one holds them (it
averaged them): where it does not show them either, its slice is dropped (``unshown``), and nobody is struck, since a
sender that stalls until the deadline is the likelier cause; the request to the reducer starts early enough that an
honest reducer has time to answer however long the sender stalls.

Pure judgements here; then three real all-reduce runners over real libp2p daemons, whose rounds are audited by the
averager's own code (``Auditing._audit_one``), each groupmate's requests answered by its own serving code
(``AuditServing``) in this process, one groupmate gone or lying.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.averager.allreduce import ExactAllReduceRunner, encode_average
from swarm.averager.audit_serving import AuditRound
from swarm.averager.auditing import Auditing
from swarm.defence.audit import DROP_ONLY, Verdict, judge
from swarm.defence.average_proof import from_wire, proves_wrong_average
from swarm.defence.receipts import Receipt, open_receipt
from swarm.manifest import Aggregation
from tests.keyed_p2p import keyed_p2ps
from tests.test_audit import CODEC_TYPES
from tests.test_audit_dropped import NUMELS, dropped_round

GROUP = b"h" * 20
HANG_GUARD = 60.0  # seconds: a bound on the test, not a speed claim
AUDIT_SECONDS = 4.0  # an audit's deadline here: half of it is kept back for the reducer (``held_reserve``)
STALL = 30.0
HELD_LATENCY = 0.3  # seconds


@pytest.fixture(scope="module")
def keys():
    return [RSAPrivateKey() for _ in range(4)]


def _judge(names, served, output, receipt, held=None, indices=None, listed=None):
    encode = lambda v: encode_average(v, CODEC_TYPES["fp16"])  # noqa: E731
    indices_ = range(len(NUMELS)) if indices is None else indices
    sample = {n: [p[i] for i in indices_] for n, p in served.items()}
    held = None if held is None else {n: None if p is None else [p[i] for i in indices_] for n, p in held.items()}
    return judge(receipt, output, sample, NUMELS, Aggregation.centered_clip, encode, indices, listed, held=held)


@pytest.mark.parametrize("sample", [None, [1, 4]])
def test_a_gone_or_lying_senders_parts_are_taken_from_the_reducer_under_its_signed_statement(keys, sample):
    for lie, expected in [(None, Verdict.passed), (lambda v: -4 * v, Verdict.wrong_average)]:
        names, served, output, receipt, _, listed = dropped_round(keys, len(NUMELS), lie)
        full = dict(zip(names, served))
        gone = {n: p for n, p in full.items() if n != names[1]}
        assert _judge(names, gone, output, receipt, None, sample, listed) == Verdict.inconclusive  # as before
        assert _judge(names, gone, output, receipt, {names[1]: full[names[1]]}, sample, listed) == expected
        other = {**full, names[1]: list(reversed(full[names[1]]))}  # it serves other bytes than it signed
        assert _judge(names, other, output, receipt, {names[1]: full[names[1]]}, sample, listed) == expected


def test_a_reducer_that_cannot_show_a_senders_parts_it_signed_for_loses_its_slice(keys):
    names, served, output, receipt, _, _ = dropped_round(keys, len(NUMELS), lambda v: -4 * v)
    gone = {n: p for n, p in zip(names, served) if n != names[1]}
    assert _judge(names, gone, output, receipt, {names[1]: None}) == Verdict.unshown  # it served none
    forged = [served[2][0], *served[1][1:]]  # a part of another sender's in its place: not what names[1] signed
    assert _judge(names, gone, output, receipt, {names[1]: forged}) == Verdict.unshown
    assert Verdict.unshown in DROP_ONLY  # dropped for the group, nobody struck


# ---- real runners, audited by the averager's own code ----------------------------------------------------------


async def _run(tensors_by_peer):
    p2ps, identities = await keyed_p2ps(len(tensors_by_peer))
    peers = [p.peer_id for p in p2ps]
    runners = []
    for p2p, key, tensors in zip(p2ps, identities, tensors_by_peer):
        runner = ExactAllReduceRunner(
            p2p=p2p, servicer_type=ExactAllReduceRunner, prefix=None, group_id=GROUP,
            tensors=[t.clone() for t in tensors], ordered_peer_ids=peers, peer_fractions=(1.0,) * len(peers),
            part_size_bytes=2048, aggregation=Aggregation.centered_clip, signing_key=key,
        )  # fmt: skip
        await runner.add_p2p_handlers(p2p)
        runners.append(runner)
    try:
        results = await asyncio.wait_for(asyncio.gather(*(_held(r) for r in runners)), HANG_GUARD)
    finally:
        await asyncio.gather(*(p.shutdown() for p in p2ps))
    return results, runners, identities


async def _held(runner):
    return [parts async for parts in runner]


class Peer(Auditing):
    """One groupmate's averager, its audit requests answered by the other groupmates' own serving code here."""

    serializer = MSGPackSerializer
    aggregation = Aggregation.centered_clip

    def __init__(self, runner: ExactAllReduceRunner, members: list[str], group: dict):
        self.peer_id, self.runner, self.group = runner.peer_id, runner, group
        self._init_auditing(True, 2.0)
        self.allreduce_kwargs = dict(compression=runner.tensor_part_container.compression, part_size_bytes=2048)
        self._averaged_tensors = runner.tensor_part_container.local_tensors
        self.record = self._open_audit(runner, members)
        self.record.done = True
        self.serve_held = True

    def _admitted(self, request, context):
        fields = MSGPackSerializer.loads(request.metadata)
        if fields.get("what") == "held" and not self.group[self.peer_id.to_base58()].serve_held:
            return None  # a reducer that will not show a sender's parts it signed for
        return fields

    async def _request(self, peer: str, fields: dict):
        target = self.group[peer]
        if target is None:
            raise ConnectionResetError("that groupmate is gone")
        if fields.get("what") == "held":  # a reducer's link: it answers in 0.3 s, not at once
            await asyncio.sleep(HELD_LATENCY)
        request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(fields))
        return target.rpc_audit_fetch(request, SimpleNamespace(remote_id=self.peer_id))


class Staller(Peer):
    """Answers every audit request only after ``STALL`` seconds (past any audit's deadline here)."""

    async def _serve_audit(self, request, context):
        await asyncio.sleep(STALL)
        async for message in super()._serve_audit(request, context):
            yield message


class Accomplice(Peer):
    """Serves every auditor other bytes than it sent: each part's values reversed."""

    async def _serve_audit(self, request, context):
        async for message in super()._serve_audit(request, context):
            part = runtime_pb2.Tensor()
            part.CopyFrom(message.tensor_part)
            part.buffer = part.buffer[::-1]
            yield averaging_pb2.DownloadData(tensor_part=part)


@contextlib.contextmanager
def signed_by(key):
    original = Receipt.sign
    Receipt.sign = lambda self, _=None: original(self, key)
    try:
        yield
    finally:
        Receipt.sign = original


@pytest.fixture(scope="module")
def audited_round():
    torch.manual_seed(5)
    tensors = [[torch.randn(3000), torch.randn(40, 25)] for _ in range(3)]
    results, runners, identities = asyncio.run(_run(tensors))
    yield results, runners, identities
    for runner in runners:
        runner.sent_parts.close()
        runner.received_parts.close()


def audit(audited_round, other: str, lie: bool = False, serve_held: bool = True, audit_parts: int = 0):
    """The reducer (the first member) audited by the second, the third ``other``: "gone", "accomplice", "staller"
    or "honest"."""
    results, runners, identities = audited_round
    members = [r.peer_id.to_base58() for r in runners]
    group: dict = {}
    kinds = [Peer, Peer, {"accomplice": Accomplice, "staller": Staller}.get(other, Peer)]
    peers = [kind(r, members, group) for kind, r in zip(kinds, runners)]
    group.update(zip(members, peers))
    reducer, auditor = peers[0], peers[1]
    reducer.serve_held = serve_held
    auditor._audit_parts = audit_parts
    for peer, held in zip(peers, results):
        peer._index_slices(peer.runner, peer.record, held)
    if lie:  # what the auditor received of the reducer's slice, as the reducer signs it
        outputs = peers[1].record.outputs[members[0]]
        codec = runners[0].tensor_part_container.compression.compression_type
        lied = [encode_average(-4 * torch.ones(tuple(p.size)), codec) for p in outputs]
        peers[1].record.outputs[members[0]] = reducer.record.outputs[members[0]] = lied
    with signed_by(identities[0]):
        asyncio.run(reducer._sign_receipt(reducer.runner, reducer.record))
    if other == "gone":
        group[members[2]] = None

    async def audited():
        found = await auditor._audit_one(auditor.record, members[0], time.monotonic() + AUDIT_SECONDS)
        await asyncio.gather(*auditor._proving)  # the proof it makes beside the rest of the audit
        return found

    verdict, blob, _ = asyncio.run(audited())
    audit.proofs = {blob: proof for blob, proof in auditor._proofs.items()}  # kept to show others (``proof_serving``)
    audit.shown = [_shows(auditor, blob, *kept) for kept in auditor._proofs.values()]  # as a reader checks each
    for peer in peers:
        peer._audit_rounds.clear()  # the runners' files stay open for the next audit of this round
    return verdict


def _shows(auditor, blob, metadata, parts) -> bool:
    """Whether a reader holding the accusation's receipt ``blob`` finds the proof served as ``metadata`` and ``parts``
    to hold (``proof_serving._fetch_and_check``'s check, without the fetch)."""
    receipt = open_receipt(blob)
    proof = from_wire(receipt, metadata, parts)
    return proof is not None and proves_wrong_average(
        receipt, proof, auditor.aggregation, auditor._encoder(), auditor._fits
    )


def test_a_reducer_holds_every_senders_parts_as_they_came_and_serves_only_those_asked():
    torch.manual_seed(6)
    results, runners, _ = asyncio.run(_run([[torch.randn(3000), torch.randn(40, 25)] for _ in range(3)]))
    try:
        members = [r.peer_id.to_base58() for r in runners]
        reducer = runners[0]
        record = AuditRound(members=members, runner=reducer)
        for i, sender in enumerate(runners):
            sent = sender.sent_parts.get(sender.ordered_peer_ids.index(reducer.peer_id))
            index = reducer.sender_peer_ids.index(sender.peer_id)
            assert [p.SerializeToString() for p in reducer.received_parts.get(index)] == [
                p.SerializeToString() for p in sent
            ]
            count = len(sent)
            assert [p.SerializeToString() for p in record.held_of(members[i], [count - 1, 0])] == [
                sent[-1].SerializeToString(),
                sent[0].SerializeToString(),
            ]
            for bad in ([count], [-1], [True], [0] * (count + 1), "0", None, [0.0], [[0]]):
                assert record.held_of(members[i], bad) is None, bad
        assert record.held_of("somebody else", [0]) is None
    finally:
        for runner in runners:
            runner.sent_parts.close()
            runner.received_parts.close()


@pytest.mark.parametrize("audit_parts", [0, 2])
def test_a_lying_reducer_is_caught_though_a_sender_is_gone_stalls_or_serves_other_bytes(audited_round, audit_parts):
    assert audit(audited_round, "honest", audit_parts=audit_parts) == Verdict.passed
    for other in ("gone", "accomplice", "staller"):  # a staller: before the reviewed fix, it left the reducer 0.1 s
        assert audit(audited_round, other, audit_parts=audit_parts) == Verdict.passed, other
        assert not audit.proofs, other  # nothing to show of an honest reducer
        assert audit(audited_round, other, lie=True, audit_parts=audit_parts) == Verdict.wrong_average, other
        assert audit.shown == [True], other  # a proof any peer can check, from the parts it checked (or the reducer's)


def test_a_reducer_that_will_not_show_a_gone_senders_parts_loses_its_slice(audited_round):
    assert audit(audited_round, "gone", serve_held=False) == Verdict.unshown
    assert audit(audited_round, "staller", serve_held=False) == Verdict.unshown
    assert audit(audited_round, "honest", serve_held=False) == Verdict.passed  # never asked: its senders served


def test_an_audit_asks_a_reducer_for_a_few_senders_parts_at_a_time_under_its_limits():
    """Many senders that serve nothing (churn, or keys that never serve): an audit asks the reducer for their parts
    at most ``HELD_AT_ONCE`` at a time, under the reducer's per-requester limit (over it, it is refused at once,
    which would read as parts the reducer did not show)."""
    from swarm.averager.audit_requests import HELD_AT_ONCE
    from swarm.averager.audit_serving import AUDIT_LIMITS

    assert HELD_AT_ONCE < AUDIT_LIMITS["per_peer"]
    part = runtime_pb2.Tensor(buffer=b"x" * 8)
    senders = [f"s{i}" for i in range(20)]
    receipt = SimpleNamespace(reducer="r")
    record = SimpleNamespace(sent_to=lambda reducer: [part, part])
    open_, most = [0], [0]

    class Fetching(Auditing):
        async def _fetch_parts(self, record, peer, reducer, limit, what=None, indices=None, of=None):
            if of is None:
                return []  # a sender that serves nothing
            open_[0] += 1
            most[0] = max(most[0], open_[0])
            await asyncio.sleep(0.01)
            open_[0] -= 1
            return [part, part] if of != "s3" else []

    wanted = {s: [0, 1] for s in senders}
    served, held = asyncio.run(
        Fetching()._parts_of_senders(
            record,
            receipt,
            senders,
            wanted,
            lambda s: None,
            lambda s, p: True,
            lambda s, p: bool(p),
            1 << 20,
            time.monotonic() + 5,
        )
    )
    assert most[0] == HELD_AT_ONCE and set(held) == set(senders)
    assert held["s3"] == [] and all(held[s] == [part, part] for s in senders if s != "s3")
    assert all(served[s] == [] for s in senders)  # what each served, kept for the judge


def test_a_groupmate_rechecking_an_accusation_that_cannot_see_a_senders_parts_drops_the_slice_and_bans_nobody():
    """An accuser that also stalls its own parts to every groupmate re-checking it: before the reviewed fix, their
    checks came out ``withheld`` and, with the accusation, banned the honest reducer in its first round."""
    from tests.test_audit_omitted import Rechecking

    record = AuditRound(members=["me", "reducer", "accuser"], runner=SimpleNamespace(group_id=GROUP))
    record.verdicts["reducer"] = Verdict.wrong_average
    found = asyncio.run(Rechecking(Verdict.unshown)._recheck_accusations(record, ["reducer"], time.monotonic() + 5))
    assert found == [("reducer", Verdict.unshown, None, True, False)]


def test_a_reducer_that_sends_nothing_is_audited_from_its_senders_parts_alone(keys):
    """A reducer in AUX mode (it reduces a slice and sends none of its own): its receipt lists only the others. Before
    the reviewed fix the audit raised (``KeyError``), the auditor's whole round of audits failed, and the slice stood
    unaudited for everyone."""
    from swarm.defence.audit import recompute
    from swarm.defence.receipts import digest_of, digest_parts, part_digest, statement_hash, with_statements
    from swarm.defence.statements import Statement
    from tests.test_audit import peer_of, sender_parts

    names = [peer_of(k) for k in keys[:3]]  # the reducer, us, the other sender
    parts = {n: sender_parts("fp16", seed, NUMELS) for seed, n in enumerate(names[1:])}
    weights = (10.0, 12.0)
    codec = CODEC_TYPES["fp16"]
    for lie, expected in [(1.0, Verdict.passed), (-4.0, Verdict.wrong_average)]:
        exact = recompute([parts[n] for n in names[1:]], weights, NUMELS, Aggregation.centered_clip)
        output = [encode_average(v * lie, codec) for v in exact]
        inputs = tuple(digest_of([part_digest(p) for p in parts[n]]) for n in names[1:])
        statements = [Statement(GROUP, names[0], d, w, len(NUMELS)).sign(k)
                      for k, d, w in zip(keys[1:3], inputs, weights)]  # fmt: skip
        receipt = Receipt(GROUP, names[0], tuple(names[1:]), weights, inputs, digest_parts(output),
                          tuple(map(statement_hash, statements)), b"n" * 16, (len(NUMELS),) * 2)  # fmt: skip
        receipt = with_statements(receipt, statements)

        class Auditor(Auditing):
            serializer, aggregation = MSGPackSerializer, Aggregation.centered_clip

            signed = receipt

            async def _fetch_receipt(self, record, reducer):
                return self.signed, b"blob", {}

            async def _fetch_parts(self, record, peer, reducer, limit, what=None, indices=None, of=None):
                return parts[peer] if of is None else []

        auditor = Auditor()
        auditor.peer_id = SimpleNamespace(to_base58=lambda: names[1])
        auditor._init_auditing(True, 2.0)
        container = SimpleNamespace(compression=SimpleNamespace(compression_type=codec))
        runner = SimpleNamespace(group_id=GROUP, tensor_part_container=container, max_weight=1e9,
                                 sender_peer_ids=[SimpleNamespace(to_base58=lambda n=n: n) for n in names[1:]],
                                 sent_parts=SimpleNamespace(get=lambda index: parts[names[1]]))  # fmt: skip
        record = AuditRound(members=list(names), runner=runner)
        record.outputs[names[0]] = output
        verdict, _, _ = asyncio.run(auditor._audit_one(record, names[0], time.monotonic() + AUDIT_SECONDS))
        assert verdict == expected


@settings(max_examples=300, deadline=None)
@given(
    sender=st.one_of(st.text(max_size=60), st.sampled_from(["s0", "s1", "s2"])),
    indices=st.one_of(
        st.none(), st.booleans(), st.integers(), st.text(max_size=8), st.binary(max_size=8),
        st.lists(st.one_of(st.integers(-(2**70), 2**70), st.integers(-1, 3), st.booleans(), st.floats()), max_size=6),
        st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    ),
)  # fmt: skip
def test_a_held_request_from_another_machine_reads_only_parts_we_hold_or_nothing(sender, indices):
    """Whatever sender name and indices a groupmate's ``AuditRequest.held`` carries, it gets those of a sender's parts
    we hold (never more parts than we hold) or nothing, and nothing raises."""
    from swarm.averager.spill import SpilledParts

    spill = SpilledParts()
    sent = {0: [runtime_pb2.Tensor(buffer=bytes([i]) * 4) for i in range(3)], 2: []}
    for index, parts in sent.items():
        spill.start(index)
        for part in parts:
            spill.append(index, part)
    runner = SimpleNamespace(
        sender_peer_ids=[SimpleNamespace(to_base58=lambda n=n: n) for n in ("s0", "s1", "s2")], received_parts=spill
    )
    got = AuditRound(members=["s0", "s1", "s2"], runner=runner).held_of(sender, indices)
    if got is not None:  # read one at a time, as a stream takes them
        got = list(got)
        parts = sent[int(sender[1])]
        assert len(got) == len(indices) <= len(parts)
        assert [p.buffer for p in got] == [parts[i].buffer for i in indices]
    else:
        held = len(sent[int(sender[1])]) if sender in ("s0", "s2") else None
        assert held is None or not (
            isinstance(indices, list)
            and len(indices) <= held
            and all(type(i) is int and 0 <= i < held for i in indices)
        )
    spill.close()
