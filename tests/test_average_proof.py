"""A wrong average proven to peers that never met the liar.

An auditor that caught a reducer averaging wrong keeps one part of its slice, the parts it was averaged from, and the
per-part digests binding them to the reducer's signed receipt, and serves them; a peer that reads its accusation
fetches them, checks every digest against the receipt, recomputes that one part, and bans the reducer only if its
signed average is not what the parts make. The accuser's word counts for nothing: any change to what it serves, or a
proof against an honest reducer, is refused.

Pure rules first; then two real libp2p daemons, one serving a proof with the averager's own code
(``proof_serving.AverageProofs``) and the other fetching and checking it; then the host's side (``Guard`` with
``ProofChecks``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.averager import served
from swarm.averager.allreduce import encode_average
from swarm.averager.bounds import admitted
from swarm.averager.proof_serving import AverageProofs
from swarm.defence import average_proof, proof_checks
from swarm.defence.audit import Verdict, _listed_as_signed
from swarm.defence.average_proof import MIN_MOVED, AverageProof, find_proof, from_wire, proves_wrong_average
from swarm.defence.bans import BAN_ROUNDS, BanList, BanReason, Guard, accusation_entry
from swarm.defence.proof_checks import CHECKS_PER_MINUTE, PER_ACCUSED, PER_ACCUSER, TRIES, Claim, ProofChecks, claims
from swarm.defence.receipts import (
    Receipt,
    digest_of,
    digest_parts,
    open_receipt,
    part_digest,
    statement_hash,
    with_statements,
)
from swarm.defence.robust import robust_mean
from swarm.defence.statements import Statement
from swarm.manifest import Aggregation
from tests.keyed_p2p import keyed_p2ps
from tests.test_audit import CODEC_TYPES, peer_of, record, sender_parts
from tests.test_audit_dropped import GROUP, NUMELS, check, dropped_round

FP16 = CODEC_TYPES["fp16"]
NONE = runtime_pb2.CompressionType.NONE
INT64 = st.integers(-(2**63), 2**63 - 1)
HANG_GUARD = 60.0  # seconds: a bound on the test, not a speed claim


@pytest.fixture(scope="module")
def keys():
    return [RSAPrivateKey() for _ in range(4)]


def encode(values: torch.Tensor) -> runtime_pb2.Tensor:
    return encode_average(values, FP16)


def decode(part: runtime_pb2.Tensor) -> torch.Tensor:
    return deserialize_torch_tensor(part).reshape(-1).float()


def fits(parts):
    numel = int(parts[0].size[0])
    return numel if numel <= max(NUMELS) and admitted(list(parts), [numel] * len(parts), FP16) else None


def shows(receipt):
    return lambda proof: proves_wrong_average(receipt, proof, Aggregation.centered_clip, encode, fits)


def proof_of(names, served, output, receipt, listed, indices=None, kept=None):
    """What an auditor that checked ``indices`` (all: None) keeps, as ``Auditing._prove`` finds it."""
    counts = receipt.counted(len(NUMELS))
    checked = range(len(NUMELS)) if indices is None else indices
    wanted = {n: [i for i in checked if i < k] for n, k in zip(names, counts)}
    sample = {n: [parts[i] for i in wanted[n]] for n, parts in zip(names, served)}
    return find_proof(receipt, output, [sample], wanted, listed, shows(receipt))


@pytest.mark.parametrize("kept", [len(NUMELS), 2])
@pytest.mark.parametrize("indices", [None, [1, 4]])
def test_a_wrong_average_is_proven_by_one_part_and_an_honest_one_never_is(keys, kept, indices):
    names, served, output, receipt, _, listed = dropped_round(keys, kept)
    assert proof_of(names, served, output, receipt, listed, indices) is None  # nothing to show of an honest one
    for lie in (lambda v: -4 * v, lambda v: v * 1.5):
        names, served, output, receipt, _, listed = dropped_round(keys, kept, lie)
        proof = proof_of(names, served, output, receipt, listed, indices)
        assert proof is not None and proof.index in (indices or range(len(NUMELS)))
        assert shows(receipt)(proof)
        # a sender whose stream broke before that part is not in it, and the proof still holds without it
        assert (proof.parts[2] is None) == (proof.index >= kept)
        # as it goes on the wire and comes back
        metadata, tensors = proof.to_wire()
        back = from_wire(receipt, metadata, tensors)
        assert back is not None and shows(receipt)(back)


def resplit(names, served, output, receipt, listed, j=1):
    """A false accuser's proof against an honest reducer: its true per-part digests cut and joined again so that
    ``digest_of`` is unchanged (b"" first), index ``j`` then naming the average's part ``j - 1``, beside each sender's
    true part ``j``: every digest would hash to what the reducer signed (found by review, fixed by requiring whole
    SHA-256 digests)."""
    outs = tuple(part_digest(p) for p in output)
    shifted = (b"", *outs)
    return AverageProof(j, shifted, tuple(tuple(listed[n]) for n in names), tuple(p[j] for p in served), output[j - 1])


def test_an_accuser_cannot_change_a_byte_of_what_it_shows(keys):
    names, served, output, receipt, _, listed = dropped_round(keys, len(NUMELS), lambda v: -4 * v)
    proof = proof_of(names, served, output, receipt, listed)
    other = serialize_torch_tensor(torch.randn(NUMELS[0]), FP16)
    changes = [
        replace(proof, output=other),  # another average than the reducer signed
        replace(proof, parts=(other, *proof.parts[1:])),  # another part than the sender sent
        replace(proof, parts=(proof.parts[0], None, proof.parts[2])),  # a sender left out
        replace(proof, outputs=proof.outputs[::-1]),  # other per-part digests under the signed one
        replace(proof, listed=(proof.listed[1], proof.listed[0], proof.listed[2])),
        replace(proof, index=(proof.index + 1) % len(NUMELS)),  # another part's index
    ]
    assert all(not shows(receipt)(change) for change in changes)
    # the bounds the averager checks before anything is decoded: a part that declares more values than a part of this
    # run holds, or parts of other sizes or codecs
    bounds = ProofPeer(None)
    assert bounds._fits([proof.output, *proof.parts]) == NUMELS[0]
    big = serialize_torch_tensor(torch.zeros(4 * max(NUMELS)), FP16)
    assert bounds._fits([big]) is None and bounds._fits([proof.output, big]) is None
    assert bounds._fits([proof.output, serialize_torch_tensor(torch.zeros(NUMELS[0]), NONE)]) is None


def test_an_honest_reducers_digests_cut_and_joined_again_prove_nothing(keys):
    names, served, output, receipt, _, listed = dropped_round(keys, len(NUMELS))
    forged = resplit(names, served, output, receipt, listed)
    assert digest_of(forged.outputs) == receipt.output  # the cut would pass the signed digest
    assert not shows(receipt)(forged)
    metadata, tensors = forged.to_wire()
    assert from_wire(receipt, metadata, tensors) is None  # refused as it comes, too
    # the same cut inside one sender's per-part digests, mixing its parts of two indices
    joined = (b"", *listed[names[1]])
    mixed = replace(
        proof_of(names, served, output, receipt, listed) or forged,
        listed=(tuple(listed[names[0]]), joined, tuple(listed[names[2]])),
    )
    assert not shows(receipt)(mixed)
    # an audit's sample whose listed digests are cut so is refused there too: a liar cannot dodge its auditor with it
    assert not _listed_as_signed(receipt, names[1], list(joined), len(joined))


def test_one_value_on_a_rounding_boundary_is_no_proof(keys):
    """A few values of a small part that another machine rounds one level apart fail ``close_enough`` (more than a
    thousandth of 300 values) and so fail an audit, but prove nothing to others: an accuser could pick such a part."""

    def flip(count):
        def lie(values):
            values = values.clone()
            for i in range(count):  # one fp16 level up
                values[i] = torch.nextafter(values[i].half(), torch.tensor(float("inf")).half()).float()
            return values

        return lie

    names, served, output, receipt, _, listed = dropped_round(keys, len(NUMELS), flip(1))
    assert check(names, served, output, receipt) == Verdict.wrong_average  # its auditor's own evidence
    assert proof_of(names, served, output, receipt, listed) is None
    names, served, output, receipt, _, listed = dropped_round(keys, len(NUMELS), flip(MIN_MOVED))
    assert proof_of(names, served, output, receipt, listed) is not None  # as many as a lie moves: a proof


def edge_round(keys, lie=None):
    """Three senders, the first one's parts on the edge of the others' (disjoint values: every cosine with it exactly
    0), so a reducer on another machine may keep it where this one leaves it out; the reducer's output is as that
    other machine makes it (the first sender kept), through ``lie`` if given."""
    names = [peer_of(k) for k in keys[:3]]
    g = torch.Generator().manual_seed(9)
    base = torch.rand(NUMELS[0] - 100, generator=g) + 0.5
    rows = [torch.cat([torch.randn(100, generator=g), torch.zeros(NUMELS[0] - 100)])]
    rows += [torch.cat([torch.zeros(100), base * (1 + 0.2 * torch.rand(NUMELS[0] - 100, generator=g))]) for _ in "ab"]
    served = [[serialize_torch_tensor(r * (1 + j), FP16) for j in range(len(NUMELS))] for r in rows]
    weights = [10.0, 12.0, 8.0]
    output = []
    for j in range(len(NUMELS)):
        values = [decode(served[i][j]) for i in range(3)]
        elsewhere = robust_mean(values, weights, Aggregation.centered_clip, keep=torch.tensor([True, True, True]))
        assert not torch.equal(elsewhere, robust_mean(values, weights, Aggregation.centered_clip))  # it matters
        output.append(encode(elsewhere if lie is None else lie(elsewhere)))
    listed = [[part_digest(p) for p in parts] for parts in served]
    inputs = tuple(digest_of(d) for d in listed)
    counts = (len(NUMELS),) * 3
    statements = [b""] + [Statement(GROUP, names[0], d, w, c).sign(k) for k, d, w, c in
                          zip(keys[1:3], inputs[1:], weights[1:], counts[1:])]  # fmt: skip
    receipt = Receipt(GROUP, names[0], tuple(names), tuple(weights), inputs, digest_parts(output),
                      tuple(map(statement_hash, statements)), b"n" * 16, counts)  # fmt: skip
    blob = receipt.sign(keys[0])
    return names, served, output, with_statements(open_receipt(blob), statements), blob, dict(zip(names, listed))


def test_a_part_on_the_edge_of_another_machines_cosines_is_judged_both_ways(keys):
    """A pairwise cosine of 0 may come out just above it on a machine whose BLAS sums in another order (a review
    showed it with ``MKL_CBWR``, on parts two senders crafted): the reducer there keeps a part this machine leaves
    out. Neither its auditor nor a reader of a proof may call that a lie; a real lie is still both."""
    names, served, output, receipt, _, listed = edge_round(keys)
    assert check(names, served, output, receipt) == Verdict.passed  # before: wrong average
    assert proof_of(names, served, output, receipt, listed) is None  # before: a proof every reader applied
    names, served, output, receipt, _, listed = edge_round(keys, lambda v: -4 * v)
    assert check(names, served, output, receipt) == Verdict.wrong_average
    assert proof_of(names, served, output, receipt, listed) is not None


def test_a_proof_shows_the_smallest_part_that_proves_the_lie():
    """A reader decodes every sender's part of the one shown: the smallest that shows the lie (here every part does)."""
    sizes, names = [500, 40, 300], ["a", "b", "c"]
    served = [sender_parts("fp16", seed, sizes) for seed in range(3)]
    output = [encode(torch.zeros(n)) for n in sizes]
    listed = [[part_digest(p) for p in parts] for parts in served]
    receipt = Receipt(GROUP, "a", tuple(names), (1.0,) * 3, tuple(digest_of(d) for d in listed),
                      digest_of([part_digest(p) for p in output]), (b"",) * 3, b"n" * 16, (3, 3, 3))  # fmt: skip
    wanted = {n: [0, 1, 2] for n in names}
    proof = find_proof(receipt, output, [dict(zip(names, served))], wanted, {}, lambda proof: True)
    assert proof is not None and proof.index == 1 and int(proof.output.size[0]) == 40


def test_a_part_averaged_from_too_few_senders_is_no_proof(keys, monkeypatch):
    names, served, output, receipt, _, listed = dropped_round(keys, 0, lambda v: -4 * v)
    proof = proof_of(names, served, output, receipt, listed)
    assert proof is not None and shows(receipt)(proof)
    seen = []
    monkeypatch.setattr(average_proof, "too_few", lambda counts, indices: seen.append(list(counts)) or True)
    assert not shows(receipt)(proof) and seen == [list(receipt.counted(len(NUMELS)))]


@settings(max_examples=200, deadline=None)
@given(
    metadata=st.one_of(
        st.binary(max_size=64),
        st.builds(
            lambda *f: MSGPackSerializer.dumps(list(f)),
            st.integers(-2, 3),
            st.one_of(st.integers(-(2**40), 2**40), st.booleans(), st.text(max_size=4)),
            st.lists(st.binary(max_size=40), max_size=8),
            st.lists(st.one_of(st.lists(st.binary(max_size=40), max_size=8), INT64), max_size=4),
        ),
    ),
    count=st.integers(0, 5),
)
def test_any_served_bytes_are_a_proof_or_refused_and_never_prove_an_honest_reducer(keys, metadata, count):
    names, served, output, receipt, _, listed = dropped_round(keys, len(NUMELS))
    tensors = [served[i % 3][i % len(NUMELS)] for i in range(count)]
    proof = from_wire(receipt, metadata, tensors)
    assert proof is None or not shows(receipt)(proof)


# ---- two real daemons: one serves, the other fetches and checks ---------------------------------------------------


class ProofPeer(AverageProofs, ServicerBase):
    """The proof side of a peer's averager, over a real libp2p daemon."""

    serializer = MSGPackSerializer
    aggregation = Aggregation.centered_clip
    prefix = "test-proofs"
    _secret = None

    def __init__(self, p2p):
        self._p2p = p2p
        self._init_proofs()
        self.allreduce_kwargs = dict(compression=SimpleNamespace(compression_type=FP16), part_size_bytes=1 << 19)
        self._averaged_tensors = [torch.zeros(max(NUMELS))]

    def _admitted(self, request, context):
        return MSGPackSerializer.loads(request.metadata)

    def _max_values(self) -> int:
        return max(NUMELS)


async def _served_and_checked(keys, keep: dict, ask: list[bytes]) -> list[bool]:
    p2ps, _ = await keyed_p2ps(2)
    try:
        accuser, reader = ProofPeer(p2ps[0]), ProofPeer(p2ps[1])
        await accuser.add_p2p_handlers(p2ps[0], namespace=accuser.prefix)
        for blob, proof in keep.items():
            accuser._keep_proof(blob, proof)
        checks = (reader._fetch_and_check(p2ps[0].peer_id.to_base58(), blob) for blob in ask)
        return await asyncio.wait_for(asyncio.gather(*checks), HANG_GUARD)
    finally:
        await asyncio.gather(*(p.shutdown() for p in p2ps))


def test_a_reader_fetches_the_proof_from_its_accuser_and_checks_it(keys):
    names, served, output, receipt, blob, listed = dropped_round(keys, len(NUMELS), lambda v: -4 * v)
    proof = proof_of(names, served, output, receipt, listed)
    *_, honest, honest_blob, _ = dropped_round(keys, len(NUMELS))
    h_names, h_served, h_output, _, _, h_listed = dropped_round(keys, len(NUMELS))
    lying = resplit(h_names, h_served, h_output, honest, h_listed)  # a false accuser's, against an honest reducer
    other = dropped_round(keys, 3, lambda v: -2 * v)[4]  # a liar's receipt whose proof this accuser does not keep
    results = asyncio.run(_served_and_checked(keys, {blob: proof, honest_blob: lying}, [blob, honest_blob, other]))
    assert results == [True, False, None]  # None: it served nothing, asked again later


async def _stalled_then_asked_again(parts: int) -> tuple[dict, int, int]:
    """A reader that takes the proof's first message and stops reading: the accuser's slots once the stream had a
    stall's time and more, the messages the reader still gets, then how many a second request gets."""
    p2ps, _ = await keyed_p2ps(2)
    try:
        accuser, reader = ProofPeer(p2ps[0]), ProofPeer(p2ps[1])
        await accuser.add_p2p_handlers(p2ps[0], namespace=accuser.prefix)
        key = bytes(32)
        accuser._proofs[key] = (b"metadata", [runtime_pb2.Tensor(buffer=bytes(1 << 20)) for _ in range(parts)])
        stub = reader.get_stub(p2ps[1], p2ps[0].peer_id, namespace=reader.prefix)
        ask = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(dict(receipt=key)))
        stream = await stub.rpc_audit_proof(ask)
        await asyncio.wait_for(stream.__anext__(), HANG_GUARD)
        await asyncio.sleep(served.STALL + 3.0)  # the reader's buffers fill long before: the accuser waits to send
        slots = dict(accuser._proof_limits.open)
        rest = [m async for m in aiter_with_timeout(stream, timeout=10.0)]  # raises if the stream is still open
        again = await stub.rpc_audit_proof(ask)
        whole = [m async for m in aiter_with_timeout(again, timeout=HANG_GUARD)]
        return slots, len(rest), len(whole)
    finally:
        await asyncio.gather(*(p.shutdown() for p in p2ps))


def test_a_reader_that_stops_reading_loses_its_stream_and_its_slot(monkeypatch):
    """An accuser serves one stream per requester: one that asks and never reads would hold it (and a few keys every
    slot) for as long as its connection lives. A stream whose message waits ``STALL`` s to be taken is ended."""
    monkeypatch.setattr(served, "STALL", 2.0)
    parts = 64  # 64 MiB: more than the daemons and sockets between the two buffer
    slots, rest, whole = asyncio.run(_stalled_then_asked_again(parts))
    assert slots == {}, "the stalled stream still holds its slot"
    assert rest < parts, "the stalled stream was sent whole"
    assert whole == parts + 1, "the same reader, asking again, was not served"


# ---- the host: claims worth a fetch, one fetch each, a ban only on a proof that holds --------------------------------


def _accusation(keys, lie, epoch=3):
    names, served, output, receipt, blob, listed = dropped_round(keys, len(NUMELS), lie)
    entry = accusation_entry(dict(peer=names[0], verdict="wrong average", banned=True, receipt=blob), epoch)
    return names, blob, entry


def test_only_accusations_of_live_peers_by_their_groupmates_with_the_accuseds_receipt_are_fetched(keys):
    reducer, sender, other, outsider = keys
    names, blob, entry = _accusation(keys, lambda v: -4 * v)
    records = [record(sender, [entry]), record(reducer)]
    found = claims(records, "us", set())
    assert [(c.accuser, c.accused, c.receipt) for c in found] == [(names[1], names[0], blob)]
    assert claims(records, "us", {names[0]}) == []  # banned already
    assert claims(records, names[0], set()) == []  # an accusation of ourselves: we know our own average
    assert claims([record(sender, [entry])], "us", set()) == []  # the accused is gone: nothing to ban
    assert claims([record(outsider, [entry]), record(reducer)], "us", set()) == []  # not a sender in that receipt
    for reason in (BanReason.withheld, BanReason.unanswered, BanReason.malformed, BanReason.false_accusation):
        assert claims([record(sender, [dict(entry, verdict=reason.value)]), record(reducer)], "us", set()) == []
    forged = dict(entry, receipt=dropped_round(keys, len(NUMELS))[3].sign(sender))  # not signed by the accused
    assert claims([record(sender, [forged]), record(reducer)], "us", set()) == []


def _entries(*records):
    return [SimpleNamespace(record=r, expiration=time.time() + 60) for r in records]


def _until(condition, timeout=HANG_GUARD):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_peer_bans_on_a_proof_it_checked_and_never_on_one_that_fails(tmp_path, keys):
    reducer, sender, _, _ = keys
    names, blob, entry = _accusation(keys, lambda v: -4 * v)
    asked = []

    def check(accuser, receipt):
        asked.append((accuser, receipt))
        return verdicts.pop(0)

    verdicts = []
    for proven in (False, True):
        verdicts.append(proven)
        refused = []
        path = tmp_path / f"bans-{proven}.json"
        guard = Guard(BanList(path), "us", publish=print, refuse=refused.append, announce=print, check=check)
        guard.on_findings([], 4)
        for _ in range(3):  # the records are read again and again: one fetch
            kept = guard.filter(_entries(record(sender, [entry]), record(reducer)))
        assert _until(lambda: not verdicts)
        assert _until(lambda g=guard, p=proven, r=refused: (names[0] in g.bans) == p == bool(r))  # a failing one never
        assert asked[-1] == (names[1], blob) and len([a for a in asked if a == asked[-1]]) == (2 if proven else 1)
        assert (names[0] in guard.bans) == proven
        if proven:
            ban = guard.bans.bans[names[0]]
            assert ban.reason == BanReason.wrong_average and ban.by == (names[1],) and ban.epoch == 3
            assert refused == [[names[0]]]
            assert names[0] not in [e.record.peer_id for e in guard.filter(_entries(record(reducer)))]
        else:
            assert refused == [] and names[0] in [e.record.peer_id for e in kept]


def test_checks_are_paced_each_claim_is_fetched_once_and_no_accuser_fills_the_queue(keys):
    started = []
    checks = ProofChecks(lambda accuser, receipt: started.append(accuser) or False, lambda claim: None)
    names, blob, entry = _accusation(keys, lambda v: -4 * v)
    found = claims([record(keys[1], [entry]), record(keys[0])], "us", set())
    flood = [found[0]] + [replace(found[0], receipt=found[0].receipt + bytes([i])) for i in range(20)]  # one key's
    many = [replace(found[0], accuser=f"accuser-{i}", accused=f"accused-{i}") for i in range(CHECKS_PER_MINUTE + 2)]
    against_one = [replace(found[0], accuser=f"other-{i}", receipt=bytes([i])) for i in range(10)]
    checks.offer(flood + many + against_one)  # in one call: the thread takes none until it returns
    accepted = [c for c in flood + many + against_one if c.key in checks.seen]
    # the flooding key had two places, the claims against one accused four, every other accuser its own
    assert sum(c.accuser == found[0].accuser for c in accepted) == PER_ACCUSER
    assert sum(c.accused == found[0].accused for c in accepted) == PER_ACCUSED
    assert all(c in accepted for c in many)
    checks.offer(accepted)  # offered again: not fetched again
    assert _until(lambda: len(started) >= CHECKS_PER_MINUTE)
    time.sleep(0.5)
    assert len(started) == CHECKS_PER_MINUTE  # the rest wait for the minute to pass
    assert claims([record(keys[1], [entry]), record(keys[0])], "us", set(), checks.seen) == []  # not read again


def test_a_claim_whose_accuser_served_nothing_is_asked_again_and_a_failing_ban_stops_nothing(keys, monkeypatch):
    monkeypatch.setattr(proof_checks, "RETRY_AFTER", 0.05)
    monkeypatch.setattr(proof_checks, "CHECKS_PER_MINUTE", 100)
    answers, asked, proven = {"a": [None] * TRIES, "b": [None, True], "c": [True]}, [], []

    def check(accuser, receipt):
        asked.append(accuser)
        return answers[accuser].pop(0)

    def ban(claim):
        proven.append(claim.accuser)
        if claim.accuser == "b":
            raise RuntimeError("the averager is gone")

    checks = ProofChecks(check, ban)
    claim = Claim("a", "liar", b"receipt", 3)
    checks.offer([claim, replace(claim, accuser="b", receipt=b"r2")])
    assert _until(lambda: proven == ["b"])
    checks.offer([replace(claim, accuser="c", receipt=b"r3")])  # the thread lived through the failed ban
    assert _until(lambda: proven == ["b", "c"] and asked.count("a") == TRIES)
    time.sleep(0.3)
    assert asked.count("a") == TRIES and asked.count("b") == 2  # asked again while it served nothing, then given up


def test_bans_from_many_threads_keep_the_file_and_the_averagers_list_whole(tmp_path):
    refused = []
    guard = Guard(BanList(tmp_path / "bans.json"), "us", publish=print, refuse=refused.append, announce=print)
    guard.on_findings([], 10)

    def prove(start):
        for i in range(start, start + 50):
            guard._on_proof(Claim(f"accuser-{i}", f"peer-{i}", b"r", 10))

    threads = [threading.Thread(target=prove, args=(k * 50,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for epoch in range(10, 10 + BAN_ROUNDS + 5, 7):  # lifts, beside the bans
        guard.on_findings([], epoch)
    for thread in threads:
        thread.join(HANG_GUARD)
    assert refused[-1] == list(guard.bans.bans)  # the averager's last word is the bans as they stand
    assert set(BanList(tmp_path / "bans.json").bans) == set(guard.bans.bans)  # the file holds what is in memory
