"""A reducer that returns one groupmate another average than another (or than its receipt names) is caught by the
group in that round, and the proof it leaves, two digests of one slice under its own signature, bans it for every
peer that reads the accusation (``swarm.defence.proofs``).

Pure rules with real keys and receipts; real all-reduce runners over real libp2p daemons for the signed ``Output``
each reducer returns with its average; the averager's verdict handling with its fetches left out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tracemalloc
from types import SimpleNamespace

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from swarm.averager.allreduce import ExactAllReduceRunner, encode_average
from swarm.averager.audit_serving import AuditRound, _keep_signed_outputs
from swarm.averager.auditing import Auditing
from swarm.averager.held import Dropped
from swarm.defence.audit import Verdict
from swarm.defence.bans import BanList, BanReason, Guard, accusation_entry, proven_bans
from swarm.defence.proofs import (
    MAX_PROOF_BYTES,
    equivocation_proof,
    equivocations,
    proves_equivocation,
    signed_output,
)
from swarm.defence.receipts import digest_parts, open_receipt
from swarm.defence.statements import Output, Statement, open_output
from swarm.dht.records import Accusation
from swarm.manifest import Aggregation
from tests.keyed_p2p import keyed_p2ps
from tests.test_audit import SimpleEntry, honest_round, peer_of, receipt_for, record

GROUP = b"g" * 20
NONCE = b"n" * 16
HANG_GUARD = 60.0  # seconds: a bound on the test, not a speed claim


@pytest.fixture(scope="module")
def keys():
    return [RSAPrivateKey() for _ in range(4)]


def test_an_output_opens_only_as_its_reducers_and_is_not_a_senders_statement(keys):
    reducer, sender = peer_of(keys[0]), peer_of(keys[1])
    blob = Output(GROUP, reducer, NONCE, b"d" * 32).sign(keys[0])
    assert len(blob) < 1024
    assert open_output(blob) == Output(GROUP, reducer, NONCE, b"d" * 32)
    assert open_output(Output(GROUP, reducer, NONCE, b"d" * 32).sign(keys[1])) is None  # signed by another key
    assert open_output(blob[:-3] + b"xyz") is None
    assert open_output(Output(GROUP, reducer, NONCE, b"d" * 65).sign(keys[0])) is None  # no digest is that long
    # a sender's statement names the reducer too, but is another payload: never read as an output
    assert open_output(Statement(GROUP, reducer, b"d" * 32, 1.0, 1).sign(keys[1])) is None
    assert open_output(Statement(GROUP, sender, b"d" * 32, 1.0, 1).sign(keys[1])) is None


def test_two_digests_of_one_slice_signed_by_its_reducer_prove_it_equivocated(keys):
    liar, a, b, _ = keys
    names = [peer_of(k) for k in (liar, a, b)]
    served, weights, _, output = honest_round("fp4")
    receipt = dataclasses.replace(receipt_for(liar, names, served, weights, output), nonce=NONCE)
    signed = receipt.sign(liar)
    to_a = Output(GROUP, names[0], NONCE, receipt.output).sign(liar)  # what its receipt names, and its auditor got
    to_b = Output(GROUP, names[0], NONCE, b"x" * 32).sign(liar)  # another average, to another groupmate
    assert signed_output(signed) == (names[0], receipt.group_id, NONCE, receipt.output)
    assert signed_output(to_b) == (names[0], GROUP, NONCE, b"x" * 32)
    # agreeing signatures prove nothing; any two that differ do, and the smaller pair is kept
    assert equivocations([signed, to_a]) == {} and equivocation_proof([signed, to_a, to_a]) is None
    for pair in ([to_a, to_b], [signed, to_b], [signed, to_a, to_b]):
        proof = equivocation_proof(pair)
        assert proves_equivocation(proof) == names[0] and proves_equivocation(proof, GROUP) == names[0]
        assert len(proof) < 4096 <= MAX_PROOF_BYTES
    assert proves_equivocation(equivocation_proof([to_a, to_b]), b"h" * 20) is None  # another group's
    assert equivocations([to_a, to_b], b"h" * 20) == {} and equivocations([to_a, to_b], members=names[1:]) == {}
    # another reducer's signature, another group's, or another run's (a leader that hands the reducer a group id it
    # averaged in before: the reducer draws a new nonce) is no contradiction
    other = Output(GROUP, names[1], NONCE, b"x" * 32).sign(a)
    elsewhere = Output(b"h" * 20, names[0], NONCE, b"x" * 32).sign(liar)
    rerun = Output(GROUP, names[0], b"m" * 16, b"x" * 32).sign(liar)
    assert equivocations([to_a, other, elsewhere, rerun, signed]) == {}
    assert proves_equivocation(MSGPackSerializer.dumps([1, "equivocated", to_a, rerun])) is None
    forged = Output(GROUP, names[0], NONCE, b"y" * 32).sign(a)  # a groupmate's key cannot sign in the reducer's name
    assert equivocations([to_a, forged]) == {}
    assert proves_equivocation(MSGPackSerializer.dumps([1, "equivocated", to_a, forged])) is None
    assert proves_equivocation(MSGPackSerializer.dumps([1, "equivocated", to_a, to_a])) is None
    assert proves_equivocation(MSGPackSerializer.dumps([1, "equivocated", to_a, other])) is None
    assert proves_equivocation(MSGPackSerializer.dumps([2, "equivocated", to_a, to_b])) is None
    assert proves_equivocation(b"x" * (MAX_PROOF_BYTES + 1)) is None  # refused unread


def test_an_honest_round_checks_no_signature_and_a_receipt_of_huge_fields_is_refused(keys, monkeypatch):
    """Blobs are read before they are verified: only an all-reduce said to have two averages costs signature
    checks. A signed integer where a receipt's bytes belong is refused, not made into that many zero bytes."""
    from swarm.defence import proofs

    names = [peer_of(k) for k in keys]
    agreeing = [Output(GROUP, names[0], NONCE, b"d" * 32).sign(keys[0]) for _ in range(40)]  # PSS: each differs
    checked = []
    monkeypatch.setattr(proofs, "signed_output", lambda blob: checked.append(blob))
    assert proofs.equivocations(agreeing, GROUP, names) == {} and checked == []
    monkeypatch.undo()
    # 128 MiB of zero bytes each, had the fields been made into bytes: a size that is allocated, not refused for
    # want of memory, so the peak below tells
    payload = MSGPackSerializer.dumps([4, GROUP, names[0], [names[0]], [1.0], [2**27], 2**27, [b""], NONCE])
    huge = MSGPackSerializer.dumps([payload, keys[0].sign(payload), keys[0].get_public_key().to_bytes()])
    tracemalloc.start()
    try:
        assert open_receipt(huge) is None and signed_output(huge) is None
        assert proves_equivocation(MSGPackSerializer.dumps([1, "equivocated", huge, huge])) is None
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()


def test_an_accusation_with_two_signed_digests_bans_for_every_reader(tmp_path, keys):
    liar, a, b, _ = keys
    names = [peer_of(k) for k in (liar, a, b)]
    to_a, to_b = (Output(GROUP, names[0], NONCE, d * 32).sign(liar) for d in (b"a", b"b"))
    proof = equivocation_proof([to_a, to_b])
    entry = accusation_entry(dict(peer=names[0], verdict=Verdict.equivocated.value, banned=True, receipt=proof), 5)
    Accusation(**entry)  # fits a progress record
    bans = proven_bans([record(a, [entry])])
    assert set(bans) == {names[0]} and bans[names[0]].reason == BanReason.equivocated
    assert bans[names[0]].by == (names[1],)
    # the accused's own record, a proof that does not hold, a plain receipt, or the proof under another reason or
    # against another peer ban nobody
    served, weights, _, output = honest_round("fp4")
    receipt = receipt_for(liar, names, served, weights, output).sign(liar)
    for bad in (
        dict(entry, receipt=equivocation_proof([to_a, to_a]) or b""),
        dict(entry, receipt=receipt),
        dict(entry, receipt=proof[:-5]),
        dict(entry, verdict=Verdict.wrong_average.value),
        dict(entry, accused=names[2]),
    ):
        assert proven_bans([record(a, [bad])]) == {}, bad
    assert proven_bans([record(liar, [entry])]) == {}
    refused = []
    guard = Guard(BanList(tmp_path / "bans.json"), names[2], publish=print, refuse=refused.append, announce=print)
    kept = guard.filter([SimpleEntry(record(a, [entry])), SimpleEntry(record(liar))])
    assert [e.record.peer_id for e in kept] == [names[1]] and refused[-1] == [names[0]]


def _auditing(me: str) -> Auditing:
    auditing = Auditing.__new__(Auditing)
    auditing.peer_id = SimpleNamespace(to_base58=lambda: me)
    return auditing


def test_every_groupmate_that_heard_the_same_verdicts_drops_a_split_slice(keys):
    """Each verdict carries its teller's signed outputs and the receipt it audited: the auditor that got the average
    the receipt names, and the groupmate that got another, both find the split and drop the same slice."""
    liar, auditor, other, _ = keys
    names = [peer_of(k) for k in (liar, auditor, other)]
    served, weights, _, output = honest_round("fp4")
    receipt = dataclasses.replace(receipt_for(liar, names, served, weights, output), group_id=GROUP, nonce=NONCE)
    signed = receipt.sign(liar)
    honest_output = Output(GROUP, names[0], NONCE, receipt.output).sign(liar)
    lie = Output(GROUP, names[0], NONCE, b"x" * 32).sign(liar)
    runner = lambda own: SimpleNamespace(group_id=GROUP, output_statements={names[0]: own})  # noqa: E731

    # the auditor: its own output agrees with the receipt; the other groupmate's verdict carries the lie
    at_auditor = AuditRound(members=names, runner=runner(honest_output))
    at_auditor.receipts[(names[1], names[0])] = signed
    _keep_signed_outputs(at_auditor, names[2], dict(outputs={names[0]: lie}, reducer=names[1], receipt=b"r"))
    # the other groupmate: it got the lie; the auditor's verdict carries the receipt and the honest output
    at_other = AuditRound(members=names, runner=runner(lie))
    fields = dict(outputs={names[0]: honest_output}, reducer=names[0], receipt=signed, verdict="passed")
    _keep_signed_outputs(at_other, names[1], fields)
    assert at_other.receipts == {(names[1], names[0]): signed}
    for me, at in ((names[1], at_auditor), (names[2], at_other)):
        ours = [(names[0], Verdict.passed, None, False, False)] if me == names[1] else []  # the auditor's check passed
        found = asyncio.run(_auditing(me)._split_averages(at, ours))
        assert [(f[0], f[1], f[3], f[4]) for f in found] == [(names[0], Verdict.equivocated, True, True)], me
        assert proves_equivocation(found[0][2], GROUP) == names[0]
        proven = [(names[0], Verdict.equivocated, found[0][2], True, True)]
        assert asyncio.run(_auditing(me)._split_averages(at, proven)) == []  # found already (its own audit)

    # nothing is kept from a verdict too large, or a receipt from a groupmate that is not the reducer's auditor
    at = AuditRound(members=names, runner=runner(honest_output))
    _keep_signed_outputs(at, names[2], dict(outputs={names[0]: b"x" * 5000}, reducer=names[0], receipt=signed))
    _keep_signed_outputs(at, names[2], dict(outputs={f"n{i}": lie for i in range(4)}, reducer=names[0]))
    assert at.heard_outputs == {} and at.receipts == {}
    assert asyncio.run(_auditing(names[1])._split_averages(at, [])) == []  # one digest: nothing to prove


def split(runner: ExactAllReduceRunner) -> None:
    """It returns the first other groupmate the true average and the rest twice it, signing what it sent each."""
    returned = runner._returned

    async def lying(sender_index, part_index, averaged):
        first = next(i for i, p in enumerate(runner.sender_peer_ids) if p != runner.peer_id)
        if sender_index == first or runner.sender_peer_ids[sender_index] == runner.peer_id:
            return await returned(sender_index, part_index, averaged)
        return encode_average(averaged * 2, runner.tensor_part_container.compression.compression_type)

    runner._returned = lying


def unsigned(runner: ExactAllReduceRunner) -> None:
    """It returns its average without its signed ``Output`` of it."""
    stream = runner._accumulate_parts_streaming

    async def unsigned_stream(inputs, sender_index):
        async for message in stream(inputs, sender_index):
            message.peer_id = b""
            yield message

    runner._accumulate_parts_streaming = unsigned_stream


async def _run(lie) -> tuple[list, list]:
    p2ps, keys = await keyed_p2ps(3)
    peers = [p.peer_id for p in p2ps]
    runners = []
    torch.manual_seed(2)
    for i, (p2p, key) in enumerate(zip(p2ps, keys)):
        runner = ExactAllReduceRunner(
            p2p=p2p, servicer_type=ExactAllReduceRunner, prefix=None, group_id=GROUP,
            tensors=[torch.randn(3000), torch.randn(40, 25)], ordered_peer_ids=peers, peer_fractions=(1.0,) * 3,
            part_size_bytes=2048, aggregation=Aggregation.mean, signing_key=key,
        )  # fmt: skip
        if i == 0:  # the liar: its handlers keep the stock names, as a patched client's do
            lie(runner)
        await runner.add_p2p_handlers(p2p)
        runners.append(runner)

    async def held(runner):
        return [parts async for parts in runner]

    try:
        outputs = await asyncio.wait_for(asyncio.gather(*(held(r) for r in runners)), HANG_GUARD)
    finally:
        await asyncio.gather(*(p.shutdown() for p in p2ps))
    return outputs, runners


def _slice_of(runner: ExactAllReduceRunner, held: list, reducer_index: int) -> list:
    """The held parts ``reducer_index`` reduced, in order."""
    flat = [p for parts in held for p in parts]
    counts = runner.tensor_part_container.num_parts_by_peer
    start = sum(counts[:reducer_index])
    return flat[start : start + counts[reducer_index]]


def test_each_reducer_signs_the_average_it_returned_and_a_split_one_proves_itself():
    outputs, runners = asyncio.run(_run(split))
    liar = runners[0].peer_id.to_base58()
    digests = []
    for runner, held in zip(runners[1:], outputs[1:]):
        # every other reducer's Output is kept, and names exactly the bytes we received of its slice
        assert set(runner.output_statements) == {r.peer_id.to_base58() for r in runners if r is not runner}
        for index, other in enumerate(runners):
            if other is runner:
                continue
            parts = _slice_of(runner, held, index)
            assert not any(isinstance(p, Dropped) for p in parts)
            signed = open_output(runner.output_statements[other.peer_id.to_base58()])
            assert signed == Output(GROUP, other.peer_id.to_base58(), other.nonce, digest_parts(parts))
        digests.append(open_output(runner.output_statements[liar]).digest)
    # an honest reducer returned the bytes it holds of its own slice (what its receipt signs); the liar did not
    for reducer, member in ((1, 2), (2, 1)):
        own = digest_parts(_slice_of(runners[reducer], outputs[reducer], reducer))
        assert open_output(runners[member].output_statements[runners[reducer].peer_id.to_base58()]).digest == own
    assert digests[0] != digests[1]
    blobs = [r.output_statements[liar] for r in runners[1:]]
    assert set(equivocations(blobs, GROUP)) == {liar}
    assert proves_equivocation(equivocation_proof(blobs), GROUP) == liar


def test_an_average_returned_without_its_signed_output_comes_in_part():
    """Its last part is not taken: the slice is fetched again as its receipt signs it, or dropped
    (``swarm.averager.repair``), as a slice cut short is."""
    outputs, runners = asyncio.run(_run(unsigned))
    liar = runners[0].peer_id.to_base58()
    for runner, held in zip(runners[1:], outputs[1:]):
        assert liar not in runner.output_statements
        parts = _slice_of(runner, held, 0)
        assert isinstance(parts[-1], Dropped) and not any(isinstance(p, Dropped) for p in parts[:-1])
        assert runner.tensor_part_container.failed_size == parts[-1].numel


def test_a_group_id_we_averaged_in_is_refused_and_a_rounds_record_is_never_forgotten_for_a_later_one():
    """A leader could hand an honest reducer the id of a group it averaged in before: its signatures then carry a new
    nonce (no proof pairs them, above), the group is refused while that round's record is kept, and the old round's
    timer never takes a later round's record with it."""
    from hivemind.averaging.allreduce import AllreduceException

    from swarm.averager.audit_serving import AuditServing
    from swarm.averager.refusals import Refusals

    refusals = Refusals.__new__(Refusals)
    refusals._banned, refusals._running_groups = set(), {}
    refusals._audit_rounds = {GROUP: object()}
    with pytest.raises(AllreduceException, match="averaged in"):
        refusals._check_group(["a", "b"], GROUP)
    refusals._check_group(["a", "b"], b"h" * 20)  # a new one is ours

    serving = AuditServing.__new__(AuditServing)
    closed = []
    spill = lambda name: SimpleNamespace(close=lambda: closed.append(name))  # noqa: E731
    runner = lambda: SimpleNamespace(sent_parts=spill("sent"), received_parts=spill("received"))  # noqa: E731
    old, new = AuditRound(members=["a"], runner=runner()), AuditRound(members=["a"], runner=runner())
    serving._audit_rounds = {GROUP: new}
    serving._forget_round(GROUP, old)
    assert serving._audit_rounds == {GROUP: new} and closed == []
    serving._forget_round(GROUP, new)
    assert serving._audit_rounds == {} and closed == ["sent", "received"]  # both files go with the round


def test_one_finding_a_groupmate_keeps_the_proof_and_any_drop():
    from swarm.averager.findings import one_a_peer

    found = [
        ("liar", Verdict.passed, None, False, False),  # our audit passed it: we hold the average its receipt names
        ("other", Verdict.withheld, None, True, False),
        ("liar", Verdict.equivocated, b"proof", True, True),  # then the verdicts showed two signed averages
        ("other", Verdict.withheld, None, False, True),  # and a repair's strike banned it
    ]
    assert one_a_peer(found) == [
        ("liar", Verdict.equivocated, b"proof", True, True),
        ("other", Verdict.withheld, None, True, True),
    ]
    assert one_a_peer([]) == []


def test_a_peer_of_another_wire_version_never_groups_with_us():
    """Its receipts and outputs would not open here: its audits would read as unanswered, and it would be banned."""
    from swarm.averager.allreduce import WIRE_VERSION
    from swarm.averager.fixed_group import fixed_group_id
    from swarm.averager.process import wire_schema_hash

    plain = b"s" * 32
    assert wire_schema_hash(plain) != plain  # a leader compares the whole hash: hivemind's own is refused
    assert wire_schema_hash(plain) != wire_schema_hash(plain, b"swarm-allreduce/1")
    assert wire_schema_hash(plain) == wire_schema_hash(plain, WIRE_VERSION) != wire_schema_hash(b"t" * 32)
    # nor in a second stage: its delegates compute another group id, and our streams to them find no such group
    assert fixed_group_id("run/3/merge/w/0", ["a", "b"]) == fixed_group_id("run/3/merge/w/0", ["b", "a"])
    assert len(fixed_group_id("run/3/merge/w/0", ["a", "b"])) == 20
    old = __import__("hashlib").sha256(b"run/3/merge/w/0/a/b").digest()[:20]  # what the version before computed
    assert fixed_group_id("run/3/merge/w/0", ["a", "b"]) != old
