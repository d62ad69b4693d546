"""Receipts bound to what was sent: each sender's signed statement of its digest and weight, the audit that checks a
receipt against them, the proof a forged receipt leaves, and the ban any peer applies on that proof alone."""

from __future__ import annotations

import dataclasses
import math

import hypothesis.strategies as st
import pytest
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import HealthCheck, given, settings

from swarm.averager.allreduce import encode_average
from swarm.defence.audit import Verdict, judge, vouching
from swarm.defence.bans import BAN_ROUNDS, BanList, BanReason, Guard, accusation_entry, proven_bans
from swarm.defence.proofs import forgery_proof, proves_forgery
from swarm.defence.receipts import digest_parts, open_receipt, with_statements
from swarm.defence.statements import MAX_STATEMENT_BYTES, Statement, open_statement, vouches
from swarm.manifest import Aggregation
from tests.test_audit import CODEC_TYPES, SimpleEntry, honest_round, peer_of, receipt_for, record, statements_for

GROUP = b"g" * 20


@pytest.fixture(scope="module")
def keys():
    return [RSAPrivateKey() for _ in range(4)]


def test_a_statement_opens_only_as_its_senders_and_vouches_for_exactly_what_it_says(keys):
    sender, reducer = peer_of(keys[1]), peer_of(keys[0])
    blob = Statement(GROUP, reducer, b"d" * 32, 12.0, 3).sign(keys[1])
    assert len(blob) < 1024
    assert open_statement(blob, sender) == Statement(GROUP, reducer, b"d" * 32, 12.0, 3)
    assert open_statement(blob, reducer) is None  # not its key
    assert vouches(blob, sender, GROUP, reducer, b"d" * 32, 12.0, 3)
    for other in [(b"h" * 20, reducer, b"d" * 32, 12.0, 3), (GROUP, sender, b"d" * 32, 12.0, 3),
                  (GROUP, reducer, b"e" * 32, 12.0, 3), (GROUP, reducer, b"d" * 32, 1000.0, 3),
                  (GROUP, reducer, b"d" * 32, 12.0, 2)]:  # fmt: skip
        assert not vouches(blob, sender, *other), other
    assert open_statement(blob[:-3] + b"xyz", sender) is None
    assert open_statement(b"x" * (MAX_STATEMENT_BYTES + 1), sender) is None  # refused unread
    nan = Statement(GROUP, reducer, b"d" * 32, math.nan, 3).sign(keys[1])
    assert open_statement(nan, sender) is None
    for count in (0, -1, 2**20 + 1, True, 1.5):  # a count of no parts, or past any slice, or not an integer
        assert open_statement(Statement(GROUP, reducer, b"d" * 32, 12.0, count).sign(keys[1]), sender) is None


FIELD = st.one_of(st.binary(max_size=600), st.integers(-(2**63), 2**64 - 1), st.text(max_size=50), st.floats())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.one_of(st.binary(max_size=8192), st.builds(MSGPackSerializer.dumps, st.lists(FIELD, max_size=6))))
def test_statements_receipts_and_proofs_from_another_machine_never_raise(blob):
    assert open_statement(blob, "Qm" + "1" * 44) is None
    assert open_receipt(blob) is None
    assert proves_forgery(blob) is None


def audit(receipt, served, weights, numels, output, names, **kwargs):
    encode = lambda v: encode_average(v, CODEC_TYPES["fp16"])  # noqa: E731
    return judge(receipt, output, dict(zip(names, served)), numels, Aggregation.centered_clip, encode, **kwargs)


def test_a_receipt_listing_a_digest_or_weight_its_sender_did_not_sign_is_forged_and_proves_it(keys):
    names = [peer_of(k) for k in keys[:3]]
    served, weights, numels, output = honest_round("fp16")
    honest = receipt_for(keys[0], names, served, weights, output)
    assert audit(honest, served, weights, numels, output, names) == Verdict.passed
    assert vouching(honest) is None and forgery_proof(honest.sign(keys[0]), honest) is None

    # a weight above what sender 1 declared (1000x its samples, as a liar reducer might count an accomplice)
    heavier = [weights[0], 1000 * weights[1], weights[2]]
    assert statements_for(names[0], names, honest.inputs, weights, GROUP)[0] == b""  # none for the reducer itself
    lying = dataclasses.replace(honest, weights=tuple(heavier))  # the same statements, under a new signature
    assert audit(lying, served, heavier, numels, output, names) == Verdict.forged
    proof = forgery_proof(lying.sign(keys[0]), lying)
    assert proof is not None and proves_forgery(proof) == names[0]
    assert len(proof) < 16384  # it fits an accusation

    # a digest its sender never signed: the reducer lists other parts for sender 2 than it was sent
    other = [served[0], served[1], served[0]]
    swapped = dataclasses.replace(honest, inputs=tuple(digest_parts(p) for p in other))
    assert audit(swapped, other, weights, numels, output, names) == Verdict.forged
    assert proves_forgery(forgery_proof(swapped.sign(keys[0]), swapped)) == names[0]

    # a weight below the capped one: its own auditor sees it, but nothing others can check without the cap
    lighter = dataclasses.replace(honest, weights=(weights[0], weights[1] / 2, weights[2]))
    assert audit(lighter, served, weights, numels, output, names) == Verdict.forged
    assert forgery_proof(lighter.sign(keys[0]), lighter) is None


def test_statements_served_beside_a_receipt_must_be_the_ones_it_signed_for(keys):
    names = [peer_of(k) for k in keys[:3]]
    served, weights, numels, output = honest_round("fp16")
    honest = receipt_for(keys[0], names, served, weights, output)
    for statements in ([], list(honest.statements[:2]), [honest.statements[0], honest.statements[2], b"x"]):
        hidden = dataclasses.replace(honest, statements=tuple(statements))
        assert audit(hidden, served, weights, numels, output, names) == Verdict.withheld
    # a proof whose statement is not the one the receipt signed for proves nothing
    fake = Statement(GROUP, names[0], b"z" * 32, 1.0, 2).sign(keys[1])
    blob = honest.sign(keys[0])
    assert proves_forgery(MSGPackSerializer.dumps([1, blob, 1, fake])) is None
    assert proves_forgery(MSGPackSerializer.dumps([1, blob, 1, honest.statements[1]])) is None  # it vouches
    assert proves_forgery(MSGPackSerializer.dumps([1, blob, 0, b""])) is None  # the reducer's own entry


def test_a_sender_left_without_a_digest_is_checked_as_counted_for_no_part(keys):
    names = [peer_of(k) for k in keys[:3]]
    served, weights, numels, output = honest_round("fp16")
    honest = receipt_for(keys[0], names, served, weights, output)
    omitted = dataclasses.replace(
        honest, inputs=(honest.inputs[0], b"", honest.inputs[2]), vouched=(b"", b"", honest.vouched[2]),
        counts=(honest.counts[0], 0, honest.counts[2]),
    )  # fmt: skip
    omitted = with_statements(omitted, [b"", b"", honest.statements[2]])
    # its receipt says the average holds none of that sender's parts (``Receipt.counts``): recomputed without them,
    # it is not the average the reducer returned (before the counts, this was "inconclusive": nothing was dropped)
    assert audit(omitted, served, weights, numels, output, names) == Verdict.wrong_average
    # the sender itself had every part's average back from the reducer, so the reducer held every part
    assert audit(omitted, served, weights, numels, output, names, returned={names[1]: 2}) == Verdict.withheld
    # with its digest listed but counted for no part, or counted without a digest: uncheckable as it stands
    for counts in [(2, 2, 2), (2, 0, 2)]:
        odd = dataclasses.replace(honest if counts[1] == 0 else omitted, counts=counts)
        assert audit(odd, served, weights, numels, output, names) == Verdict.withheld, counts


def test_one_accusation_with_its_proof_bans_for_every_reader_and_others_do_not(tmp_path, keys):
    reducer, a, b, _ = keys
    names = [peer_of(k) for k in (reducer, a, b)]
    served, weights, _, output = honest_round("fp16")
    honest = receipt_for(reducer, names, served, weights, output)
    lying = dataclasses.replace(honest, weights=(weights[0], 1e6, weights[2]))
    proof = forgery_proof(lying.sign(reducer), lying)
    entry = accusation_entry(dict(peer=names[0], verdict=Verdict.forged.value, banned=True, receipt=proof), 7)
    bans = proven_bans([record(a, [entry])])
    assert set(bans) == {names[0]} and bans[names[0]].reason == BanReason.forged and bans[names[0]].by == (names[1],)
    # the same claim with the honest receipt, or without its statement, or about itself, bans nobody
    for receipt in (honest.sign(reducer), lying.sign(reducer), forgery_proof(lying.sign(reducer), lying)[:-4]):
        assert proven_bans([record(a, [dict(entry, receipt=receipt)])]) == {}
    assert proven_bans([record(reducer, [entry])]) == {}

    refused = []
    guard = Guard(BanList(tmp_path / "bans.json"), names[2], publish=print, refuse=refused.append, announce=print)
    guard.on_findings([], 10)
    kept = guard.filter([SimpleEntry(record(a, [entry])), SimpleEntry(record(reducer))])
    assert [e.record.peer_id for e in kept] == [names[1]] and refused[-1] == [names[0]]
    assert guard.bans.bans[names[0]].epoch == 7
    guard.on_findings([], 7 + BAN_ROUNDS)  # lifted after its rounds, though its accuser still shows the proof
    assert names[0] not in guard.bans
    kept = guard.filter([SimpleEntry(record(a, [entry])), SimpleEntry(record(reducer))])
    assert names[0] not in guard.bans and len(kept) == 2
