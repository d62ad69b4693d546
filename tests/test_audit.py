"""Checked reducers and bans as pure rules: receipts, the auditor's choice, the judgement, the quorum."""

from __future__ import annotations

import time

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm.averager.allreduce import encode_average
from swarm.averager.codecs import CODECS, apply_error_feedback
from swarm.defence.audit import Verdict, auditor_of, judge, recompute, sample_parts, suspect_parts
from swarm.defence.bans import (
    BAN_ROUNDS,
    QUORUM,
    Ban,
    BanList,
    BanReason,
    Guard,
    accusation_entry,
    quorum_bans,
)
from swarm.defence.proofs import equivocation_proof
from swarm.defence.receipts import (
    Receipt,
    digest_parts,
    lists_every_sender,
    open_receipt,
    part_digest,
    statement_hash,
    with_statements,
)
from swarm.defence.statements import Output, Statement
from swarm.dht.identity import peer_id_of_owner
from swarm.dht.records import Accusation, ProgressRecord
from swarm.manifest import Aggregation

CODEC_TYPES = {
    "none": runtime_pb2.CompressionType.NONE,
    "fp16": runtime_pb2.CompressionType.FLOAT16,
    "fp4": CODECS["fp4"].compression_type,
    "sparse": CODECS["sparse"].compression_type,
}


KEY_OF: dict[str, RSAPrivateKey] = {}  # each test key by the peer id it gives, to sign senders' statements


def peer_of(key: RSAPrivateKey) -> str:
    name = peer_id_of_owner(b"[owner:" + key.get_public_key().to_bytes() + b"]")
    KEY_OF[name] = key
    return name


def statements_for(reducer: str, names, inputs, weights, group_id: bytes, counts=None) -> tuple[bytes, ...]:
    """Each sender's signed statement of what it sent ``reducer`` (``counts`` parts each; 2 if not given), as honest
    senders make them (none for itself)."""
    counts = counts or [2] * len(names)
    return tuple(
        b"" if name == reducer or name not in KEY_OF else Statement(group_id, reducer, digest, w, k).sign(KEY_OF[name])
        for name, digest, w, k in zip(names, inputs, weights, counts)
    )


@pytest.fixture(scope="module")
def keys():
    return [RSAPrivateKey() for _ in range(4)]


def sender_parts(codec: str, seed: int, sizes=(1 << 16, 5000)) -> list[runtime_pb2.Tensor]:
    """One sender's parts for a reducer, as the wire carries them (on the codec's grid first, as the host does)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for size in sizes:
        values = torch.randn(size, generator=g) * 1e-3
        if codec in ("fp4", "sparse"):
            apply_error_feedback([values], [torch.zeros_like(values)], codec)
        parts.append(serialize_torch_tensor(values, CODEC_TYPES[codec]))
    return parts


def honest_round(codec: str, senders: int = 3, lie=None):
    """Each sender's parts, and the reducer's average of them as it would send it (``lie`` changes the values)."""
    served = [sender_parts(codec, seed) for seed in range(senders)]
    weights = [10.0, 12.0, 8.0][:senders]
    numels = [1 << 16, 5000]
    exact = recompute(served, weights, numels, Aggregation.centered_clip)
    values = [v if lie is None else lie(v) for v in exact]
    output = [encode_average(v, CODEC_TYPES[codec]) for v in values]
    return served, weights, numels, output


def receipt_for(key, names, served, weights, output, group_id=b"g" * 20) -> Receipt:
    inputs = tuple(digest_parts(parts) for parts in served)
    reducer = peer_of(key)
    counts = tuple(len(parts) for parts in served)
    statements = statements_for(reducer, names, inputs, weights, group_id, counts)
    vouched = tuple(map(statement_hash, statements))
    receipt = Receipt(
        group_id, reducer, tuple(names), tuple(weights), inputs, digest_parts(output), vouched, b"", counts
    )
    return with_statements(receipt, list(statements))  # served beside it, as the reducer serves them


def run_judge(codec, served, weights, numels, output, receipt, names):
    return judge(
        receipt,
        output,
        dict(zip(names, served)),
        numels,
        Aggregation.centered_clip,
        lambda v: encode_average(v, CODEC_TYPES[codec]),
    )


@pytest.mark.parametrize("codec", ["none", "fp16", "fp4", "sparse"])
def test_an_honest_reducer_passes_and_a_lying_one_is_caught(keys, codec):
    names = [peer_of(k) for k in keys[:3]]
    served, weights, numels, output = honest_round(codec)
    receipt = receipt_for(keys[0], names, served, weights, output)
    assert run_judge(codec, served, weights, numels, output, receipt, names) == Verdict.passed

    for lie in (lambda v: -4 * v, lambda v: v * 1.5, lambda v: v + 1e-4):
        served, weights, numels, output = honest_round(codec, lie=lie)
        receipt = receipt_for(keys[0], names, served, weights, output)
        assert run_judge(codec, served, weights, numels, output, receipt, names) == Verdict.wrong_average


def test_a_receipt_that_counts_a_sender_for_more_than_a_rounds_samples_is_a_wrong_average(keys):
    # the reducer's arithmetic is right for the weights it lists, but it listed a sender past the round's cap
    names = [peer_of(k) for k in keys[:3]]
    served, weights, numels, output = honest_round("fp16")
    receipt = receipt_for(keys[0], names, served, weights, output)
    encode = lambda v: encode_average(v, CODEC_TYPES["fp16"])  # noqa: E731
    served_by = dict(zip(names, served))
    args = (receipt, output, served_by, numels, Aggregation.centered_clip, encode)
    assert judge(*args, max_weight=max(weights)) == Verdict.passed
    assert judge(*args, max_weight=max(weights) - 1) == Verdict.wrong_average


def test_a_receipt_must_name_exactly_the_groups_senders(keys):
    names = [peer_of(k) for k in keys[:3]]
    served, weights, _, output = honest_round("fp16")
    assert lists_every_sender(receipt_for(keys[0], names, served, weights, output), names[::-1])
    # only itself, or all but one: the recomputation would use the parts it chose, and pass
    assert not lists_every_sender(receipt_for(keys[0], names[:1], served[:1], weights[:1], output), names)
    assert not lists_every_sender(receipt_for(keys[0], names[:2], served[:2], weights[:2], output), names)
    twice = [names[0], names[0], names[1]]  # a sender listed twice, another left out
    assert not lists_every_sender(receipt_for(keys[0], twice, served, weights, output), names)


def test_a_few_values_moved_far_are_caught_and_rounding_flips_are_not(keys):
    names = [peer_of(k) for k in keys[:3]]

    def spike(v):  # one value in a million, far off: under the moved-fraction limit, over the error bound
        v = v.clone()
        v[7] = 10.0
        return v

    served, weights, numels, output = honest_round("fp16", lie=spike)
    receipt = receipt_for(keys[0], names, served, weights, output)
    assert run_judge("fp16", served, weights, numels, output, receipt, names) == Verdict.wrong_average

    def nudge(v):  # a value a hair off, as another machine's summation order may leave it: same rounding class
        v = v.clone()
        v[7] = torch.nextafter(v[7], torch.tensor(1.0))
        return v

    served, weights, numels, output = honest_round("fp16", lie=nudge)
    receipt = receipt_for(keys[0], names, served, weights, output)
    assert run_judge("fp16", served, weights, numels, output, receipt, names) == Verdict.passed


def test_an_average_other_than_the_signed_one_is_equivocation_and_bad_inputs_are_inconclusive(keys):
    names = [peer_of(k) for k in keys[:3]]
    served, weights, numels, output = honest_round("fp4")
    receipt = receipt_for(keys[0], names, served, weights, output)
    other = [encode_average(torch.zeros(n), CODEC_TYPES["fp4"]) for n in numels]
    assert run_judge("fp4", served, weights, numels, other, receipt, names) == Verdict.equivocated

    tampered = [served[0], sender_parts("fp4", 99), served[2]]  # a sender serves other bytes than it sent
    assert run_judge("fp4", tampered, weights, numels, output, receipt, names) == Verdict.inconclusive
    # the reducer's own part not served as it signed for (it is alive: it signed): the slice cannot be checked
    receipt = receipt_for(keys[2], names, served, weights, output)
    assert run_judge("fp4", tampered[:1] + [served[1], tampered[1]], weights, numels, output, receipt, names) == (
        Verdict.withheld
    )


def test_an_audit_of_a_sample_checks_its_parts_against_the_digests_listed_under_the_receipt(keys):
    """averaging.audit_parts: the auditor draws some parts of the slice after the receipt is signed, fetches only
    those, and checks each against the per-part digest the reducer listed for its sender, whose digest the
    receipt signs; the reducer below lies in part 5 of 8 only."""
    names = [peer_of(k) for k in keys[:3]]
    numels = [300] * 8
    served = [sender_parts("fp16", seed, numels) for seed in range(3)]
    weights = [10.0, 12.0, 8.0]
    exact = recompute(served, weights, numels, Aggregation.centered_clip)
    output = [encode_average(v * (-4 if i == 5 else 1), CODEC_TYPES["fp16"]) for i, v in enumerate(exact)]
    receipt = receipt_for(keys[0], names, served, weights, output)  # names[0] is the reducer
    listed = {n: [part_digest(p) for p in parts] for n, parts in zip(names, served)}

    def check(indices, listed=listed, served=served):
        sample = {n: [parts[i] for i in indices] for n, parts in zip(names, served)}
        encode = lambda v: encode_average(v, CODEC_TYPES["fp16"])  # noqa: E731
        return judge(receipt, output, sample, numels, Aggregation.centered_clip, encode, indices, listed)

    assert check([0, 2, 7]) == Verdict.passed  # the lie is not in this sample: it goes unseen this round
    assert check([1, 5]) == Verdict.wrong_average
    assert check(list(range(8)), listed={}) == Verdict.wrong_average  # every part: the receipt's digest is enough
    # digests listed under the receipt that it did not sign, for any sender: the reducer serves the lists, so it
    # is the one that cannot be checked (were it "inconclusive", a liar could list one wrong digest and pass)
    assert check([1, 5], listed={**listed, names[0]: listed[names[0]][::-1]}) == Verdict.withheld
    assert check([1, 5], listed={**listed, names[1]: listed[names[1]][:-1]}) == Verdict.withheld
    assert check([1, 5], listed={n: d for n, d in listed.items() if n != names[2]}) == Verdict.withheld
    # a sender's part served that is not the one listed: sender or reducer lies, as when bytes do not match
    swapped = [served[0], [*served[1][:5], served[1][4], *served[1][6:]], served[2]]
    assert check([1, 5], served=swapped) == Verdict.inconclusive
    assert check([1, 4], served=swapped) == Verdict.passed  # the swapped part is not drawn: nothing to see


def test_a_sample_includes_the_parts_whose_average_stands_out_so_a_large_lie_in_one_part_is_caught(keys):
    """A liar in a few parts escapes a random sample of N with probability (1 - f)^N. The auditor also checks the
    N parts whose average is largest against what it sent for them: a lie large enough to matter stands out
    there and is checked surely; what escapes is a lie within the spread of the honest parts' ratios."""
    names = [peer_of(k) for k in keys[:3]]
    numels = [300] * 16
    served = [sender_parts("fp16", seed, numels) for seed in range(3)]
    weights = [10.0, 12.0, 8.0]
    exact = recompute(served, weights, numels, Aggregation.centered_clip)
    honest = [encode_average(v, CODEC_TYPES["fp16"]) for v in exact]
    assert len(suspect_parts(honest, served[1], 2)) == 2  # an honest slice: two parts all the same
    for factor in (-4.0, 1000.0):
        lying = [encode_average(v * (factor if i == 11 else 1), CODEC_TYPES["fp16"]) for i, v in enumerate(exact)]
        for auditor in (1, 2):  # either groupmate's own parts will do
            suspects = suspect_parts(lying, served[auditor], 2)
            assert 11 in suspects, (factor, suspects)
            receipt = receipt_for(keys[0], names, served, weights, lying)
            listed = {n: [part_digest(p) for p in parts] for n, parts in zip(names, served)}
            indices = sample_parts(16, 2, also=suspects)
            sample = {n: [parts[i] for i in indices] for n, parts in zip(names, served)}
            encode = lambda v: encode_average(v, CODEC_TYPES["fp16"])  # noqa: E731
            verdict = judge(receipt, lying, sample, numels, Aggregation.centered_clip, encode, indices, listed)
            assert verdict == Verdict.wrong_average
    broken = [*honest[:3], runtime_pb2.Tensor(buffer=b"x", compression=CODEC_TYPES["fp16"]), *honest[4:]]
    assert suspect_parts(broken, served[1], 1) == [3]  # a part that will not decode stands out most


def test_a_sample_is_drawn_afresh_within_the_slice_and_keeps_an_accusers_parts():
    assert sample_parts(5, 0) == [0, 1, 2, 3, 4] and sample_parts(5, 5) == list(range(5))  # 0 or enough: all
    draws = [sample_parts(100, 3, also=[7, 250, -1, "x"]) for _ in range(20)]
    for drawn in draws:
        assert 7 in drawn and drawn == sorted(set(drawn)) and all(0 <= i < 100 for i in drawn)
        assert 3 <= len(drawn) <= 4  # three drawn, plus the accuser's 7 unless it was drawn too
    assert len({tuple(d) for d in draws}) > 1  # drawn at random: a reducer cannot know them when it signs


def test_a_receipt_for_a_big_slice_still_fits_an_accusation(keys):
    """A receipt signs one digest per sender whatever the slice's size, so it stays inside an accusation's record
    (``records.Accusation``, 16 KiB) for a 1B model's slices; the per-part digests travel beside it."""
    names = [peer_of(k) for k in keys[:3]] + [f"Qm{i:044d}" for i in range(61)]  # a group of 64
    part = sender_parts("fp16", 0, (16,))[0]
    digest = digest_parts([part] * 2000)
    statement = Statement(b"g" * 20, names[0], digest, 1.0, 2000).sign(keys[1])
    vouched = (b"",) + (statement_hash(statement),) * 63
    receipt = Receipt(b"g" * 20, names[0], tuple(names), (1.0,) * 64, (digest,) * 64, digest, vouched, b"n" * 16,
                      (2000,) * 64)  # fmt: skip
    assert len(receipt.sign(keys[0])) < 16384
    # an accusation of forgery carries the receipt and one statement under it: it fits too
    assert len(receipt.sign(keys[0])) + len(statement) + 64 < 16384
    assert open_receipt(receipt.sign(keys[0])) == receipt


def test_receipts_open_only_with_their_reducers_key(keys):
    names = [peer_of(k) for k in keys[:3]]
    served, weights, _, output = honest_round("fp4")
    receipt = receipt_for(keys[0], names, served, weights, output)
    blob = receipt.sign(keys[0])
    assert open_receipt(blob) == receipt
    assert open_receipt(receipt.sign(keys[1])) is None  # signed by someone else than the reducer it names
    assert open_receipt(blob[:-5] + b"xxxxx") is None
    assert open_receipt(b"garbage") is None


def test_every_reducer_has_one_auditor_that_is_not_itself():
    members = [f"peer{i}" for i in range(4)]
    seen = set()
    for g in range(40):
        group_id = g.to_bytes(4, "little") * 5
        auditors = [auditor_of(members, group_id, r) for r in members]
        assert all(a is not None and a != r for a, r in zip(auditors, members))
        seen.update(auditors)
    assert seen == set(members)  # the work is spread
    assert auditor_of(["a"], b"x", "a") is None


def record(key, accusations=()) -> ProgressRecord:
    return ProgressRecord(
        peer_id=peer_of(key), name="p", device="cpu", epoch=3, inner_step=0, samples_per_second=0.0,
        tokens_processed=0, state="training", last_loss=None, client_mode=False, relayed=False,
        accusations=[Accusation(**a) for a in accusations], time=time.time(),
    )  # fmt: skip


def lying_reducers_accusation(liar, a, b, epoch: int) -> tuple[list[str], bytes, dict]:
    """Groupmates ``a`` and ``b`` caught ``liar`` returning a sign-flipped average: names, its receipt, the entry."""
    names = [peer_of(k) for k in (a, b, liar)]
    served, weights, _, output = honest_round("fp4", lie=lambda v: -v)
    blob = receipt_for(liar, names, served, weights, output).sign(liar)
    verdict = dict(peer=peer_of(liar), verdict="wrong average", banned=True, receipt=blob)
    return names, blob, accusation_entry(verdict, epoch)


def test_a_quorum_of_accusations_is_counted_only_from_the_accused_groupmates(keys):
    liar, a, b, outsider = keys
    names, blob, entry = lying_reducers_accusation(liar, a, b, 3)
    served, weights, _, output = honest_round("fp4", lie=lambda v: -v)
    assert entry is not None and QUORUM == 2

    assert quorum_bans([record(a, [entry]), record(liar)]) == {}  # one claim bans no one
    bans = quorum_bans([record(a, [entry]), record(b, [entry])])
    assert set(bans) == {peer_of(liar)} and bans[peer_of(liar)].reason == BanReason.wrong_average
    # the outsider was not in the liar's group (not a sender in its receipt): its claim does not count
    assert quorum_bans([record(a, [entry]), record(outsider, [entry])]) == {}
    # a receipt that is not the accused's own does not count either
    forged = dict(entry, receipt=receipt_for(liar, names, served, weights, output).sign(a))
    assert quorum_bans([record(a, [forged]), record(b, [forged])]) == {}
    # nobody is banned for a false accusation on others' say-so
    false = dict(entry, verdict=BanReason.false_accusation.value)
    assert quorum_bans([record(a, [false]), record(b, [false])]) == {}
    # nor for a claim the receipt cannot back (withheld or malformed parts, unanswered audits): the accuser's word
    for reason in (BanReason.withheld, BanReason.unanswered, BanReason.malformed):
        claim = dict(entry, verdict=reason.value)
        assert quorum_bans([record(a, [claim]), record(b, [claim])]) == {}, reason


def test_accusations_never_ban_for_a_peer_that_did_not_catch_the_accused_itself(tmp_path, keys):
    # two keys that were in an honest reducer's group accuse it, with its own receipt: a quorum, but no proof this
    # peer checked; it keeps grouping with the reducer (whose own audits here may have passed)
    liar, a, b, _ = keys
    _, _, entry = lying_reducers_accusation(liar, a, b, 3)
    refused = []
    guard = Guard(BanList(tmp_path / "bans.json"), "us", publish=print, refuse=refused.append, announce=print)
    entries = [SimpleEntry(record(a, [entry])), SimpleEntry(record(b, [entry])), SimpleEntry(record(liar))]
    assert quorum_bans(e.record for e in entries)  # a quorum, as shown on the dashboard
    assert [e.record.peer_id for e in guard.filter(entries)] == [peer_of(k) for k in (a, b, liar)]
    assert refused == [] and peer_of(liar) not in guard.bans


def test_a_ban_is_lifted_after_ban_rounds_and_the_averager_is_told(tmp_path, keys):
    liar, a, _, _ = keys
    refused = []
    guard = Guard(BanList(tmp_path / "bans.json"), peer_of(a), publish=print, refuse=refused.append, announce=print)
    guard.on_findings([dict(peer=peer_of(liar), verdict="wrong average", banned=True, discarded=True)], 5)
    assert refused[-1] == [peer_of(liar)]
    guard.on_findings([], 5 + BAN_ROUNDS - 1)
    assert peer_of(liar) in guard.bans and len(refused) == 1  # still banned, nothing sent
    guard.on_findings([], 5 + BAN_ROUNDS)
    assert peer_of(liar) not in guard.bans and refused[-1] == []  # lifted: the averager refuses nobody now
    assert peer_of(liar) not in BanList(tmp_path / "bans.json")  # and a restart does not bring it back
    guard.on_findings([dict(peer=peer_of(liar), verdict="wrong average", banned=True, discarded=True)], 200)
    assert refused[-1] == [peer_of(liar)]  # caught again: banned again


class SimpleEntry:
    def __init__(self, rec):
        self.record = rec


def test_the_guard_bans_keeps_bans_across_restarts_and_hides_banned_peers(tmp_path, keys):
    liar, a, b, _ = keys
    refused, announced, published = [], [], []
    guard = Guard(
        BanList(tmp_path / "bans.json"), peer_of(a),
        publish=published.append, refuse=refused.append, announce=announced.append,
    )  # fmt: skip
    _, blob, _ = lying_reducers_accusation(liar, a, b, 5)
    guard.on_findings([dict(peer=peer_of(liar), verdict="wrong average", banned=True, discarded=True, receipt=blob)], 5)
    assert refused == [[peer_of(liar)]] and announced[0].by == ("self",) and announced[0].epoch == 5
    assert published[-1][0]["accused"] == peer_of(liar)

    class Entry:
        def __init__(self, rec):
            self.record = rec

    kept = guard.filter([Entry(record(liar)), Entry(record(b))])
    assert [e.record.peer_id for e in kept] == [peer_of(b)]

    reloaded = BanList(tmp_path / "bans.json")  # a restart keeps the ban
    assert peer_of(liar) in reloaded and reloaded.bans[peer_of(liar)].reason == BanReason.wrong_average
    again = []
    Guard(reloaded, peer_of(a), publish=print, refuse=again.extend, announce=print)
    assert again == [peer_of(liar)]
    assert isinstance(reloaded.bans[peer_of(liar)], Ban)


def test_status_json_and_the_dashboard_show_who_is_banned_and_why(keys):
    from types import SimpleNamespace

    from diloco_helpers import tiny_manifest
    from rich.console import Console

    from client.dashboard import _peers_table
    from client.swarm_watch import TrackedPeer
    from swarm.dht.records import PeerEntry
    from swarm.observer import snapshot

    liar, a, b, _ = keys
    names, _, entry = lying_reducers_accusation(liar, a, b, 2)
    records = [record(a, [entry]), record(b, [entry]), record(liar)]
    expires = time.time() + 60

    banned = snapshot(tiny_manifest(), [PeerEntry(r, expires) for r in records])["banned"]
    assert banned == [
        dict(peer_id=peer_of(liar), reasons=["wrong average"], by=sorted(names[:2]), epoch=2, quorum=True,
             proven=False)
    ]  # fmt: skip
    only_one = snapshot(tiny_manifest(), [PeerEntry(r, expires) for r in records[1:]])["banned"]
    assert only_one[0]["quorum"] is False and only_one[0]["by"] == [peer_of(b)]

    watch = SimpleNamespace(snapshot=SimpleNamespace(peers=[TrackedPeer(r, time.time()) for r in records]))
    source = SimpleNamespace(own=None, watch=watch, manifest=tiny_manifest())
    console = Console(record=True, width=200)
    console.print(_peers_table(source, time.time()))
    text = console.export_text()
    liar_line = next(line for line in text.splitlines() if peer_of(liar)[-8:] in line)
    assert "banned: wrong average (2 of us, a quorum)" in liar_line
    assert sum("banned" in line for line in text.splitlines()) == 1

    # one accusation with a proof (two averages of one slice under the liar's signature): applied everywhere, so shown
    # first and as proven
    group = b"g" * 20
    proof = equivocation_proof([Output(group, peer_of(liar), b"n", d * 32).sign(liar) for d in (b"a", b"b")])
    proven = accusation_entry(dict(peer=peer_of(liar), verdict="equivocated", banned=True, receipt=proof), 3)
    records = [record(a, [proven]), record(b), record(liar)]
    banned = snapshot(tiny_manifest(), [PeerEntry(r, expires) for r in records])["banned"]
    assert banned == [
        dict(peer_id=peer_of(liar), reasons=["equivocated"], by=[peer_of(a)], epoch=3, quorum=False, proven=True)
    ]
    watch.snapshot.peers = [TrackedPeer(r, time.time()) for r in records]
    console = Console(record=True, width=200)
    console.print(_peers_table(source, time.time()))
    liar_line = next(line for line in console.export_text().splitlines() if peer_of(liar)[-8:] in line)
    assert "banned: equivocated (1 of us, proven)" in liar_line
