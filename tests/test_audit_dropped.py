"""A sender whose stream broke mid-way: its first parts are in its reducer's average, and they are checked too.

A sender signs a statement of the parts it sent so far with every part (``swarm.defence.statements``); the reducer
counts a part only with it, and its receipt lists, for a sender whose stream broke, how many of its parts the average
holds and the statement of those (``Receipt.counts``). Before, such a slice could not be checked (``inconclusive``):
a reducer that cut one groupmate's stream after a part could return any average unchallenged.

Pure judgements here, and three real all-reduce runners over real libp2p daemons, one sender's stream to one reducer
broken after its first part.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import NoCompression, serialize_torch_tensor
from hivemind.utils.crypto import RSAPrivateKey

from swarm.averager.allreduce import ExactAllReduceRunner, encode_average
from swarm.averager.audit_serving import AuditRound
from swarm.averager.auditing import Auditing
from swarm.averager.held import Dropped
from swarm.averager.repair import RepairFailure
from swarm.defence.audit import Verdict, auditor_of, judge, recompute
from swarm.defence.proofs import forgery_proof, proves_forgery
from swarm.defence.receipts import (
    Receipt,
    digest_of,
    digest_parts,
    open_receipt,
    part_digest,
    statement_hash,
    with_statements,
)
from swarm.defence.statements import Statement, open_statement
from swarm.manifest import Aggregation
from tests.keyed_p2p import keyed_p2ps
from tests.test_audit import CODEC_TYPES, peer_of, sender_parts

GROUP = b"d" * 20
NUMELS = [300] * 6
HANG_GUARD = 60.0  # seconds: a bound on the test, not a speed claim


@pytest.fixture(scope="module")
def keys():
    return [RSAPrivateKey() for _ in range(4)]


def dropped_round(keys, kept: int, lie=None, claimed: int | None = None):
    """A reducer (keys[0]) and senders keys[1] and keys[2]; keys[2]'s stream broke after ``kept`` parts, so the
    average holds its first ``kept`` parts only. ``claimed``: the count the receipt lists (``kept`` when honest)."""
    names = [peer_of(k) for k in keys[:3]]
    served = [sender_parts("fp16", seed, NUMELS) for seed in range(3)]
    weights = [10.0, 12.0, 8.0]
    held = [served[0], served[1], served[2][:kept]]
    exact = recompute(held, weights, NUMELS, Aggregation.centered_clip)
    output = [encode_average(v if lie is None else lie(v), CODEC_TYPES["fp16"]) for v in exact]
    counts = (len(NUMELS), len(NUMELS), kept if claimed is None else claimed)
    listed = [[part_digest(p) for p in parts[:k]] for parts, k in zip(served, counts)]
    inputs = tuple(digest_of(d) if d else b"" for d in listed)
    statements = [b""] + [
        Statement(GROUP, names[0], digest, w, k).sign(key) if k else b""
        for key, digest, w, k in zip(keys[1:3], inputs[1:], weights[1:], counts[1:])
    ]
    receipt = Receipt(GROUP, names[0], tuple(names), tuple(weights), inputs, digest_parts(output),
                      tuple(map(statement_hash, statements)), b"n" * 16, counts)  # fmt: skip
    blob = receipt.sign(keys[0])
    return names, served, output, with_statements(open_receipt(blob), statements), blob, dict(zip(names, listed))


def check(names, served, output, receipt, indices=None, listed=None, returned=None):
    """The audit as the reducer's auditor makes it: each sender's parts among those checked, as it fetched them
    (of the one whose stream broke, those the receipt counts)."""
    counts = receipt.counted(len(NUMELS))
    indices_ = range(len(NUMELS)) if indices is None else indices
    sample = {n: [parts[i] for i in indices_ if i < k] for n, parts, k in zip(names, served, counts)}
    encode = lambda v: encode_average(v, CODEC_TYPES["fp16"])  # noqa: E731
    return judge(receipt, output, sample, NUMELS, Aggregation.centered_clip, encode, indices, listed,
                 returned=returned)  # fmt: skip


@pytest.mark.parametrize("kept", [0, 1, 4])
def test_a_slice_with_a_sender_whose_stream_broke_passes_honest_and_is_caught_lying(keys, kept):
    names, served, output, receipt, _, listed = dropped_round(keys, kept)
    assert receipt.dropped(len(NUMELS)) == {names[2]}
    assert check(names, served, output, receipt) == Verdict.passed
    assert check(names, served, output, receipt, [1, 3], listed) == Verdict.passed  # a sample too
    for lie in (lambda v: -4 * v, lambda v: v * 1.5):  # before, both were "inconclusive": nothing dropped
        names, served, output, receipt, _, listed = dropped_round(keys, kept, lie)
        assert check(names, served, output, receipt) == Verdict.wrong_average
        assert check(names, served, output, receipt, [0, 5], listed) == Verdict.wrong_average


def test_a_dropped_senders_parts_that_do_not_match_its_signed_statement_leave_the_slice_unchecked(keys):
    names, served, output, receipt, _, _ = dropped_round(keys, 3)
    other = [served[0], served[1], [served[2][1], *served[2][1:]]]  # its first part served as another
    assert check(names, other, output, receipt) == Verdict.inconclusive  # it, or the reducer, lies
    missing = {n: p for n, p in zip(names, served) if n != names[2]}  # it is gone: its parts cannot be had
    encode = lambda v: encode_average(v, CODEC_TYPES["fp16"])  # noqa: E731
    assert judge(receipt, output, missing, NUMELS, Aggregation.centered_clip, encode) == Verdict.inconclusive


def test_a_receipt_whose_counts_its_statements_or_digests_do_not_fit_is_refused_or_proven_forged(keys):
    # it counts two parts of the auditor, which had three parts of its average back: withheld (its own evidence)
    names, served, output, receipt, _, _ = dropped_round(keys, 2)
    assert check(names, served, output, receipt, returned={names[2]: 3}) == Verdict.withheld
    assert check(names, served, output, receipt, returned={names[2]: 2}) == Verdict.passed  # as many as it counts
    # it counts two parts but lists the statement of three: a lie the signed pair proves to anyone
    names, served, output, receipt, blob, _ = dropped_round(keys, 2)
    three = Statement(GROUP, names[0], digest_of(part_digest(p) for p in served[2][:3]), 8.0, 3).sign(keys[2])
    forged = Receipt(**{**receipt.__dict__, "inputs": (*receipt.inputs[:2], digest_of(part_digest(p) for p in
                     served[2][:3])), "vouched": (*receipt.vouched[:2], statement_hash(three))})  # fmt: skip
    forged = with_statements(open_receipt(forged.sign(keys[0])), [*receipt.statements[:2], three])
    assert check(names, served, output, forged) == Verdict.forged
    assert proves_forgery(forgery_proof(forged.sign(keys[0]), forged)) == names[0]
    # a count past the slice, or a digest with no parts counted: its receipt cannot be checked as it stands
    names, served, output, receipt, _, _ = dropped_round(keys, 2, claimed=len(NUMELS) + 1)
    assert check(names, served, output, receipt) == Verdict.withheld
    names, served, output, receipt, _, _ = dropped_round(keys, 2)
    empty = Receipt(
        **{**receipt.__dict__, "inputs": (*receipt.inputs[:2], b""), "vouched": (*receipt.vouched[:2], b"")}
    )
    assert check(names, served, output, with_statements(empty, [*receipt.statements[:2], b""])) == Verdict.withheld
    none = Receipt(**{**receipt.__dict__, "counts": (6, 6, 0)})  # no part counted, under a digest of two
    assert check(names, served, output, with_statements(none, receipt.statements)) == Verdict.withheld
    # a digest with no statement under it: uncheckable, and proves no forgery (an empty statement hashes to b"")
    bare = Receipt(**{**receipt.__dict__, "vouched": (*receipt.vouched[:2], b"")})
    bare = with_statements(bare, [*receipt.statements[:2], b""])
    assert check(names, served, output, bare) == Verdict.withheld
    assert forgery_proof(bare.sign(keys[0]), bare) is None


def test_a_receipt_must_count_every_sender(keys):
    """A receipt without counts would read as counting every sender with a digest whole: a reducer that cut one
    after a part could then list that part's statement and leave its audit inconclusive. It is refused unread."""
    names, served, output, receipt, _, _ = dropped_round(keys, 1)
    assert open_receipt(receipt.sign(keys[0])) == receipt
    for counts in ([], [1, 2], [6, 6, -1], [6, 6, True], [6, 6, 2**21]):  # none, another length, or not a count
        bad = Receipt(**{**receipt.__dict__, "counts": tuple(counts)})
        assert open_receipt(bad.sign(keys[0])) is None, counts


class BrokenAfterOne(ExactAllReduceRunner):
    """Its stream to the first other reducer breaks after its first part (a link that went down: the reducer hears
    nothing more from it, and leaves it out of the parts after ``sender_timeout``)."""

    async def _record_sent(self, peer_index, stream):
        count = 0
        async for message in super()._record_sent(peer_index, stream):
            if count == 1 and peer_index == next(i for i, p in enumerate(self.ordered_peer_ids) if p != self.peer_id):
                raise ConnectionResetError("the link went down")
            count += 1
            yield message


async def _run(tensors_by_peer):
    p2ps, keys = await keyed_p2ps(len(tensors_by_peer))
    peers = [p.peer_id for p in p2ps]
    runners = []
    for i, (p2p, key, tensors) in enumerate(zip(p2ps, keys, tensors_by_peer)):
        runner = (BrokenAfterOne if i == len(p2ps) - 1 else ExactAllReduceRunner)(
            p2p=p2p, servicer_type=ExactAllReduceRunner, prefix=None, group_id=GROUP,
            tensors=[t.clone() for t in tensors], ordered_peer_ids=peers, peer_fractions=(1.0,) * len(peers),
            part_size_bytes=2048, aggregation=Aggregation.centered_clip, signing_key=key,
            sender_timeout=3.0, reducer_timeout=20.0,  # a silent sender is left out of later parts after 3 s
        )  # fmt: skip
        await runner.add_p2p_handlers(p2p)
        runners.append(runner)

    async def held(runner):
        try:
            return [parts async for parts in runner]
        except Exception as e:  # the broken sender's own all-reduce may fail: only the reducer's side is checked
            return e

    try:
        results = await asyncio.wait_for(asyncio.gather(*(held(r) for r in runners)), HANG_GUARD)
    finally:
        await asyncio.gather(*(p.shutdown() for p in p2ps))
    return results, runners


def test_a_reducer_counts_the_parts_of_a_broken_stream_it_averaged_and_keeps_their_signed_statement():
    torch.manual_seed(3)
    tensors = [[torch.randn(3000), torch.randn(40, 25)] for _ in range(3)]
    results, runners = asyncio.run(_run(tensors))
    broken = runners[-1]
    reducer = next(r for r in runners if r.peer_id != broken.peer_id and r.peer_id == broken.ordered_peer_ids[
        next(i for i, p in enumerate(broken.ordered_peer_ids) if p != broken.peer_id)])  # fmt: skip
    assert not isinstance(results[runners.index(reducer)], BaseException)
    index = reducer.sender_peer_ids.index(broken.peer_id)
    counts = reducer.counted_parts()
    full = reducer.tensor_part_reducer.num_parts
    assert counts[index] == 1 and all(k == full for i, k in enumerate(counts) if i != index)
    # the statement of those parts, signed by the sender, vouches for exactly the digest of the one part counted
    statement = reducer.statement_of(index, counts[index])
    opened = open_statement(statement, broken.peer_id.to_base58())
    assert opened is not None and opened.count == 1
    assert opened.digest == digest_of(reducer.input_digests[index][:1])
    # its receipt, as ``Auditing._sign_receipt`` makes it, and an audit from the parts each sender recorded sending:
    # the average holds the broken sender's first part and none after it
    senders = [p.to_base58() for p in reducer.sender_peer_ids]
    statements = [b"" if p == reducer.peer_id else reducer.statement_of(i, k)
                  for i, (p, k) in enumerate(zip(reducer.sender_peer_ids, counts))]  # fmt: skip
    output = [reducer._encoded[i].result() for i in range(full)]
    inputs = tuple(digest_of(d[:k]) if k else b"" for d, k in zip(reducer.input_digests, counts))
    receipt = Receipt(GROUP, senders[reducer.sender_peer_ids.index(reducer.peer_id)], tuple(senders),
                      tuple(reducer.input_weights), inputs, digest_parts(output),
                      tuple(map(statement_hash, statements)), reducer.nonce, tuple(counts))  # fmt: skip
    receipt = with_statements(receipt, statements)
    where = {r.peer_id.to_base58(): r.sent_parts.get(r.ordered_peer_ids.index(reducer.peer_id)) for r in runners}
    served = {s: where[s][:k] for s, k in zip(senders, counts)}
    numels = [p.numel() for p in reducer.parts_for_local_averaging]
    codec = reducer.tensor_part_container.compression.compression_type
    verdict = judge(receipt, output, served, numels, Aggregation.centered_clip, lambda v: encode_average(v, codec))
    assert verdict == Verdict.passed
    lying = [encode_average(-4 * torch.ones(n), codec) for n in numels]
    lied = with_statements(Receipt(**{**receipt.__dict__, "output": digest_parts(lying)}), statements)
    assert judge(lied, lying, served, numels, Aggregation.centered_clip, lambda v: encode_average(v, codec)) == (
        Verdict.wrong_average
    )


class Group(Auditing):
    """One round's audits in the averager, its requests given: the order in which it repairs, audits, tells and
    re-checks is what is tested. ``liar``'s slice came to us in part; every audit of it finds a wrong average."""

    def __init__(self, me: str, liar: str, heard: dict):
        self.peer_id = SimpleNamespace(to_base58=lambda: me)
        self._init_auditing(True, 0.3)
        self._banned, self.liar, self.heard, self.calls = set(), liar, heard, []

    async def _sign_receipt(self, runner, record):
        self.calls.append(("sign",))

    async def _repair_slice(self, record, reducer, deadline):
        self.calls.append(("repair", reducer))
        return [part(7, 300), part(8, 300)]

    async def _audit_one(self, record, reducer, deadline, also=()):
        self.calls.append(("audit", reducer))
        return (Verdict.wrong_average if reducer == self.liar else Verdict.passed), b"receipt", []

    async def _tell_group(self, record, reducer, verdict, checked, deadline, receipt=None):
        self.calls.append(("tell", reducer, verdict))

    async def _hear_verdicts(self, record, waiting, deadline):
        self.calls.append(("hear", tuple(sorted(waiting))))
        record.verdicts.update(self.heard)


def group_round(me: str, liar: str, heard: dict, counted=(2, 2, 2)) -> tuple[Group, list, list]:
    """Three members, each reducing a slice of two parts; our copy of ``liar``'s slice lost its last part. ``counted``:
    the parts of each sender our own average holds."""
    members = ["a", "b", "c"]
    held = [[part(i, 300) for i in range(6)]]
    held[0][2 * members.index(liar) + 1] = Dropped(300)
    container = SimpleNamespace(num_parts_by_peer=[2, 2, 2], compression=NoCompression())
    runner = SimpleNamespace(group_id=GROUP_OF[(me, liar)], tensor_part_container=container, refused_senders=set(),
                             output_statements={}, counted_parts=lambda: list(counted))  # fmt: skip
    auditing = Group(me, liar, heard)
    record = AuditRound(members=members, runner=runner)
    auditing._audit_rounds[runner.group_id] = record
    result = asyncio.run(auditing._audit_group(runner, record, held))
    return auditing, result[0], result[2]


def part(seed: int, size: int):
    return serialize_torch_tensor(torch.randn(size, generator=torch.Generator().manual_seed(seed)))


# group ids under which the second member is (or is not) the liar's auditor
GROUP_OF = {
    ("b", "c"): next(bytes([i]) * 20 for i in range(256) if auditor_of(["a", "b", "c"], bytes([i]) * 20, "c") == "b"),
    ("a", "c"): next(bytes([i]) * 20 for i in range(256) if auditor_of(["a", "b", "c"], bytes([i]) * 20, "c") == "b"),
}


def test_an_auditor_whose_copy_came_in_part_fetches_it_again_audits_it_and_tells_the_group():
    """The liar cut its stream to its own auditor: before, that auditor did not audit it at all (its copy came in
    part) and the others waited out the audit timeout for a verdict that never came, then kept the lie."""
    auditing, held, findings = group_round("b", "c", {})
    calls = auditing.calls
    assert (
        calls.index(("repair", "c")) < calls.index(("audit", "c")) < calls.index(("tell", "c", Verdict.wrong_average))
    )
    assert [(f["peer"], f["banned"], f["discarded"]) for f in findings] == [("c", True, True)]
    assert all(isinstance(p, Dropped) for p in held[0][4:]) and not any(isinstance(p, Dropped) for p in held[0][:4])


def test_a_groupmate_whose_copy_came_in_part_hears_the_verdict_and_rechecks_once_it_holds_the_slice():
    """The liar cut the stream of a groupmate that is not its auditor: before, that groupmate fetched the slice again
    after the verdicts, never heard the accusation, and applied the lie (then re-synced the honest auditor to it)."""
    auditing, held, findings = group_round("a", "c", {"c": Verdict.wrong_average})
    calls = auditing.calls
    hear = next(c for c in calls if c[0] == "hear")
    assert "c" in hear[1]  # its auditor's verdict on it is waited for
    assert calls.index(hear) < calls.index(("repair", "c")) < calls.index(("audit", "c"))
    assert [(f["peer"], f["banned"], f["discarded"]) for f in findings] == [("c", True, True)]
    assert all(isinstance(p, Dropped) for p in held[0][4:])
    # told nothing against it, the repaired slice is kept and nobody is re-checked
    auditing, held, findings = group_round("a", "c", {})
    assert ("audit", "c") not in auditing.calls and findings == []
    assert not any(isinstance(p, Dropped) for p in held[0])


def test_a_part_averaged_from_no_more_than_half_the_group_is_too_few_to_check(keys):
    """A reducer that counts every other sender short (say none of their parts came) makes its average its own
    part, which a recomputation from its receipt agrees with: no lie shows, so the slice is not taken (dropped for
    the group, nobody struck). Two senders of three are a majority: the average of an honest break stands."""
    names, served, output, receipt, blob, _ = dropped_round(keys, 0)
    assert check(names, served, output, receipt) == Verdict.passed  # two of three counted in every part
    own = [encode_average(check_values, CODEC_TYPES["fp16"]) for check_values in _values(served[0])]
    alone = Receipt(**{**receipt.__dict__, "counts": (6, 0, 0), "output": digest_parts(own),
                       "inputs": (receipt.inputs[0], b"", b""), "vouched": (b"", b"", b"")})  # fmt: skip
    alone = with_statements(alone, [b"", b"", b""])
    assert check(names, served, own, alone) == Verdict.too_few
    assert check(names, served, own, alone, [2]) == Verdict.too_few  # a sample too


def _values(parts):
    from swarm.defence.audit import _decode

    return [_decode(p) for p in parts]


class FailingRepair(Group):
    async def _repair_slice(self, record, reducer, deadline):
        self.calls.append(("repair", reducer))
        return RepairFailure.withheld


def test_a_slice_we_audit_that_cannot_be_had_again_is_tried_once_struck_once_and_told():
    """A repair that fails for a reducer we audit is not tried again later in the round: one strike a round (two in
    a row ban), and the group hears at once that it withheld its average."""
    auditing = FailingRepair("b", "c", {})
    members = ["a", "b", "c"]
    held = [[part(i, 300) for i in range(6)]]
    held[0][5] = Dropped(300)
    container = SimpleNamespace(num_parts_by_peer=[2, 2, 2], compression=NoCompression())
    runner = SimpleNamespace(group_id=GROUP_OF[("b", "c")], tensor_part_container=container, refused_senders=set(),
                             output_statements={}, counted_parts=lambda: [2, 2, 2])  # fmt: skip
    record = AuditRound(members=members, runner=runner)
    _, _, findings, failures = asyncio.run(auditing._audit_group(runner, record, held))
    assert auditing.calls.count(("repair", "c")) == 1 and ("audit", "c") not in auditing.calls
    assert ("tell", "c", Verdict.withheld) in auditing.calls
    assert auditing._unanswered == {"c": 1} and [f["peer"] for f in failures] == ["c"]
    assert [(f["peer"], f["banned"], f["discarded"]) for f in findings] == []  # struck, not banned: the slice drops
    assert all(isinstance(p, Dropped) for p in held[0][4:])


def test_a_reducer_whose_average_holds_too_few_senders_drops_its_own_slice_as_its_auditor_will():
    """An honest reducer whose groupmates' streams broke early holds a slice its auditor cannot check (``too_few``):
    the group drops it, so the reducer drops it too rather than end the round apart from them."""
    _, held, _ = group_round("a", "c", {}, counted=(2, 0, 1))  # "a" reduces parts 0-1: only its own part in them
    assert all(isinstance(p, Dropped) for p in held[0][:2])
    _, held, _ = group_round("a", "c", {}, counted=(2, 2, 1))  # two of three in every part: kept
    assert not any(isinstance(p, Dropped) for p in held[0][:4])


def test_a_reducer_we_audit_whose_parts_we_refused_is_left_to_each_groupmates_own_check():
    """We refused its parts as their reducer, so its slice is dropped on purpose here and we never audit it; the group
    is told at once that it could not be checked by us, so each groupmate audits it itself instead of waiting out our
    verdict and keeping whatever it returned (a liar could send only its auditor bad parts, and lie to the rest)."""
    auditing = Group("b", "c", {})
    members = ["a", "b", "c"]
    held = [[part(i, 300) for i in range(6)]]
    held[0][4:] = [Dropped(300), Dropped(300)]  # cancelled when we refused its parts
    container = SimpleNamespace(num_parts_by_peer=[2, 2, 2], compression=NoCompression())
    runner = SimpleNamespace(group_id=GROUP_OF[("b", "c")], tensor_part_container=container,
                             refused_senders=[SimpleNamespace(to_base58=lambda: "c")], output_statements={},
                             counted_parts=lambda: [2, 2, 2])  # fmt: skip
    record = AuditRound(members=members, runner=runner)
    asyncio.run(auditing._audit_group(runner, record, held))
    assert ("tell", "c", Verdict.withheld) in auditing.calls
    assert ("repair", "c") not in auditing.calls and ("audit", "c") not in auditing.calls
