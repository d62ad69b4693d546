"""Every parser of others' records, fuzzed: whatever a DHT read returns (wrong types, huge strings and lists, NaN and
infinities, negative numbers, nested junk, expirations far ahead), a parser either keeps a record within its bounds or
refuses it, and never raises. The bounds are checked here field by field, not with the schema that enforces them.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from swarm import NetworkConfig, start_dht
from swarm.defence.bans import BanReason, accused, quorum_bans
from swarm.dht import peers as dht_peers
from swarm.dht.groups import parse_groups
from swarm.dht.identity import peer_id_of_owner
from swarm.dht.peers import parse_peers, read_bucket, read_peers
from swarm.dht.presence import Presence, within_bounds
from swarm.dht.records import (
    CHECKSUM_HISTORY,
    EXPIRY_SLACK,
    GLOBAL_PREFIX,
    GROUP_TTL,
    MANIFEST_TTL,
    MAX_ACCUSATIONS,
    MAX_COUNT,
    MAX_DEVICE,
    MAX_MANIFEST_JSON,
    MAX_NAME,
    MAX_RATE,
    MAX_TIME,
    MAX_TOKENS,
    RECORD_TTL,
    RUNS_KEY,
    Accusation,
    AccusationVerdict,
    GlobalSchema,
    PeerState,
    ProgressRecord,
    bucket_of,
    fresh,
    groups_key,
    parse_record,
    progress_key,
    run_subkey,
    run_validator,
)
from swarm.dht.registry import _listings, parse_manifests
from swarm.manifest import RunManifest

FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
RUN_ID = "0123456789abcdef"
SUBKEYS = [RSASignatureValidator(RSAPrivateKey()).local_public_key for _ in range(2)]
IDS = [peer_id_of_owner(s) for s in SUBKEYS]
CHECKSUM = "ab" * 32
TAG = "0123456789abcdef"
NOW = time.time()
MANIFEST = RunManifest(model={"model_type": "gpt2"}, name="fuzz")
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def progress_value(peer_id: str) -> dict:
    return dict(
        peer_id=peer_id, name="n", device="cpu", epoch=3, inner_step=1, samples_per_second=1.5, tokens_processed=10,
        state="training", last_loss=2.5, client_mode=False, relayed=False, micro_batch=4, download_progress=0.0,
        checksums=[dict(epoch=3, checksum=CHECKSUM)],
        accusations=[dict(accused=IDS[1], verdict=AccusationVerdict.wrong_average.value, epoch=2, receipt=b"r")],
        time=NOW,
    )  # fmt: skip


def group_value(delegate: str) -> dict:
    return dict(
        epoch=3, group=TAG, delegate=delegate, size=2, weight=64.0, digest=CHECKSUM, merged=None, included=[TAG],
        peers=2, client_mode=False, roster=[TAG], time=NOW,
    )  # fmt: skip


def manifest_value() -> dict:
    return dict(manifest_json=MANIFEST.canonical_json(), name=MANIFEST.name, created_at=NOW)


# ---- what a foreign peer may put in a field -------------------------------------------------------------------


def often(common: st.SearchStrategy, rare: st.SearchStrategy, percent: int = 75) -> st.SearchStrategy:
    """``common`` about ``percent``% of the time (hypothesis's ``one_of`` does not weigh its branches)."""
    return st.integers(0, 99).flatmap(lambda i: common if i < percent else rare)


NUMBERS = [-1, 0, 1, -0.0, 0.5, 1.0, 2**40, 2**40 + 1, 2**62, 2**64 - 1, 1e12, 1e13, 1e300, True, False]
NUMBERS += [math.nan, math.inf, -math.inf]
STRINGS = ["", "\n", "a" * 64, "a" * 65, "Qm\n", "x\x1b[31m", "é" * 64, CHECKSUM + "\n", CHECKSUM.upper(), TAG]
STRINGS += [s.value for s in PeerState] + [v.value for v in AccusationVerdict] + IDS + ["king", "passed"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=30),
    st.binary(max_size=30),
    st.sampled_from(NUMBERS),
    st.sampled_from(STRINGS),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=12), st.integers(), st.binary(max_size=4)), inner, max_size=4),
    ),
    max_leaves=12,
)
huge = st.one_of(
    st.integers(65, 70_000).map(lambda n: "a" * n),
    st.integers(65, 70_000).map(lambda n: b"\x00" * n),
    st.integers(9, 5_000).map(lambda n: [dict(epoch=1, checksum=CHECKSUM)] * n),
    st.integers(9, 5_000).map(lambda n: [TAG] * n),
)
checksum_items = st.fixed_dictionaries({"epoch": st.sampled_from(NUMBERS), "checksum": st.sampled_from(STRINGS)})
accusation_items = st.fixed_dictionaries(
    {
        "accused": st.one_of(st.sampled_from(STRINGS), huge),
        "verdict": st.one_of(st.sampled_from(STRINGS), st.text(max_size=20)),
        "epoch": st.sampled_from(NUMBERS),
        "receipt": st.one_of(st.binary(max_size=20), st.integers(16_000, 17_000).map(lambda n: b"r" * n), junk),
    }
)
# honest records, anywhere in their bounds
finite = dict(allow_nan=False, allow_infinity=False)
counts = st.integers(0, MAX_COUNT)
printable = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=MAX_NAME)
valid_checksums = st.builds(lambda e: dict(epoch=e, checksum=CHECKSUM), counts)
valid_accusations = st.builds(
    lambda e, v, r: dict(accused=IDS[1], verdict=v.value, epoch=e, receipt=r), counts,
    st.sampled_from(AccusationVerdict), st.binary(max_size=64),
)  # fmt: skip
PROGRESS = dict(
    peer_id=st.sampled_from(IDS[:1] * 4 + IDS[1:]), name=printable, device=printable, epoch=counts, inner_step=counts,
    samples_per_second=st.floats(0.0, MAX_RATE), tokens_processed=st.integers(0, MAX_TOKENS),
    state=st.sampled_from([s.value for s in PeerState]), last_loss=st.one_of(st.none(), st.floats(**finite)),
    client_mode=st.booleans(), relayed=st.booleans(), micro_batch=counts, download_progress=st.floats(0.0, 1.0),
    checksums=st.lists(valid_checksums, max_size=CHECKSUM_HISTORY),
    accusations=st.lists(valid_accusations, max_size=MAX_ACCUSATIONS), time=st.floats(0.0, MAX_TIME),
)  # fmt: skip
digests = st.one_of(st.none(), st.just(CHECKSUM))
GROUP = dict(
    epoch=counts, group=st.just(TAG), delegate=st.sampled_from(IDS[:1] * 4 + IDS[1:]), size=st.integers(1, 4096),
    weight=st.floats(0.0, MAX_TOKENS), digest=digests, merged=digests,
    included=st.lists(st.just(TAG), max_size=256), peers=st.integers(0, 4096 * 256), client_mode=st.booleans(),
    roster=st.lists(st.just(TAG), max_size=256), time=st.floats(0.0, MAX_TIME),
)  # fmt: skip
MANIFEST_FIELDS = dict(
    manifest_json=st.one_of(st.just(MANIFEST.canonical_json()), st.text(max_size=100)),
    name=printable.filter(bool), created_at=st.floats(0.0, MAX_TIME),
)  # fmt: skip

# what a foreign peer may put in a field instead
plausible = st.one_of(
    st.integers(-2, 2**41), st.floats(-1.0, 1e13), st.text("Qm0aZ9é\n", max_size=70), st.sampled_from(STRINGS),
    st.lists(valid_checksums, max_size=CHECKSUM_HISTORY + 2), st.lists(valid_accusations, max_size=MAX_ACCUSATIONS + 2),
    st.booleans(), st.none(),
)  # fmt: skip
hostile = st.one_of(
    junk, huge, st.sampled_from(NUMBERS),
    st.lists(checksum_items, max_size=CHECKSUM_HISTORY + 3), st.lists(accusation_items, max_size=MAX_ACCUSATIONS + 3),
)  # fmt: skip


# one field just out of its bounds (or of the wrong type), the rest of the record honest: each is refused
COUNT_MISSES = [-1, MAX_COUNT + 1, 3.0, True, "3", None]
REAL_MISSES = [math.nan, math.inf, -math.inf, 2, "1.5", None]
TEXT_MISSES = ["\x1b[2J", "a\n", "\x9b2J", 7, b"n", None]
ONE_CHECKSUM = dict(epoch=3, checksum=CHECKSUM)
ONE_ACCUSATION = dict(accused=IDS[1], verdict=AccusationVerdict.wrong_average.value, epoch=2, receipt=b"r")
MISSES = {
    "progress": dict(
        peer_id=["Q" * 65, "", "Qm-1", IDS[0] + "\n", 5], name=TEXT_MISSES + ["n" * (MAX_NAME + 1)],
        device=TEXT_MISSES + ["d" * (MAX_DEVICE + 1)], epoch=COUNT_MISSES, inner_step=COUNT_MISSES,
        micro_batch=COUNT_MISSES, tokens_processed=[-1, MAX_TOKENS + 1, 2**64 - 1, 1.0],
        samples_per_second=REAL_MISSES + [-1.0, MAX_RATE * 2], last_loss=REAL_MISSES[:-1],
        download_progress=REAL_MISSES + [-0.1, 1.5], time=REAL_MISSES + [-1.0, MAX_TIME * 2],
        state=["king", "", "training\n", "Training", 1, None], client_mode=[1, "true", None], relayed=[0, None],
        checksums=[
            [ONE_CHECKSUM] * (CHECKSUM_HISTORY + 1), [{**ONE_CHECKSUM, "epoch": -1}],
            [{**ONE_CHECKSUM, "epoch": MAX_COUNT + 1}], [{**ONE_CHECKSUM, "checksum": CHECKSUM + "\n"}],
            [{**ONE_CHECKSUM, "checksum": CHECKSUM.upper()}], [{**ONE_CHECKSUM, "extra": 1}], [CHECKSUM], None,
        ],
        accusations=[
            [ONE_ACCUSATION] * (MAX_ACCUSATIONS + 1), [{**ONE_ACCUSATION, "verdict": "a made-up verdict"}],
            [{**ONE_ACCUSATION, "verdict": "passed"}], [{**ONE_ACCUSATION, "accused": "z" * 65}],
            [{**ONE_ACCUSATION, "epoch": MAX_COUNT + 1}], [{**ONE_ACCUSATION, "receipt": b"r" * 16385}],
            [{**ONE_ACCUSATION, "receipt": "r"}], None,
        ],
    ),
    "group": dict(
        epoch=COUNT_MISSES, group=["0" * 17, TAG + "\n", TAG.upper(), None], delegate=["Q" * 65, "", "Qm-1", None],
        size=[0, 4097, 2.0, None], weight=REAL_MISSES + [-1.0, 2.0**63], digest=[CHECKSUM + "\n", "ab", 1],
        merged=[CHECKSUM.upper(), 1], included=[[TAG] * 257, [TAG + "\n"], TAG], client_mode=[1, None],
        peers=[-1, 4096 * 256 + 1, 2.0, True, None],
        roster=[[TAG] * 257, [TAG + "\n"], TAG, None],
        time=REAL_MISSES + [-1.0, MAX_TIME * 2],
    ),
    "manifest": dict(
        manifest_json=["x" * (MAX_MANIFEST_JSON + 1), b"{}", None], name=TEXT_MISSES + ["", "n" * (MAX_NAME + 1)],
        created_at=REAL_MISSES + [-1.0, MAX_TIME * 2],
    ),
}  # fmt: skip
MISSED = [(kind, field, bad) for kind, table in MISSES.items() for field, values in table.items() for bad in values]


def mutated(fields: dict[str, st.SearchStrategy], kind: str) -> st.SearchStrategy:
    """An honest record (its ``fields`` drawn within their bounds), or one with a field or two replaced (often by a
    value just out of its bounds), dropped or added, or junk instead of a record."""

    def edit(value: dict, change: tuple[str, Any], drop: bool) -> dict:
        field, new = change
        return {k: v for k, v in value.items() if k != field} if drop else {**value, field: new}

    honest = st.fixed_dictionaries(fields)
    misses = st.sampled_from([(field, bad) for k, field, bad in MISSED if k == kind])
    changes = often(misses, st.tuples(st.sampled_from([*fields, "extra"]), st.one_of(plausible, hostile)), 60)
    drops = often(st.just(False), st.just(True), 85)
    edited = st.builds(edit, honest, changes, drops)
    return often(honest, st.one_of(edited, edited, st.builds(edit, edited, changes, drops), junk), 35)


# expirations, as offsets from now (most of them fresh for every kind), or anything else a malicious peer's answer
# could hold
OFFSETS = [-1.0, 0.5, 14.0, 25.0, 26.0, 590.0, 625.0, 1e4, 1e9, 3.2e7 * 100, math.inf, -math.inf, math.nan]
expirations = often(st.floats(0.5, 14.0), st.one_of(st.sampled_from(OFFSETS), st.floats(), junk), 70)


def with_expiry(offset: Any, now: float) -> Any:
    return now + offset if isinstance(offset, float) else offset


def found_of(items: list[tuple[Any, Any, Any]], now: float, shape: str) -> Any:
    """What a DHT read might return: hivemind's dictionary of values with expirations, or something else."""
    if shape == "none":
        return None
    if shape == "raw":  # items that are not values with expirations
        table = {subkey: value for subkey, value, _ in items}
    else:
        table = {subkey: ValueWithExpiration(value, with_expiry(e, now)) for subkey, value, e in items}
    return table if shape == "bare" else ValueWithExpiration(table, now + 10)


subkeys = often(st.just(SUBKEYS[0]), st.one_of(st.just(SUBKEYS[1]), st.binary(max_size=50), st.integers()))
shapes = often(st.just("dict"), st.sampled_from(["raw", "bare", "none"]), 85)


def items_of(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(st.tuples(subkeys, values, expirations), min_size=1, max_size=4)


# ---- the bounds, field by field ---------------------------------------------------------------------------------


def is_count(n: Any, low: int = 0, high: int = MAX_COUNT) -> bool:
    return type(n) is int and low <= n <= high


def is_real(x: Any, low: float = -math.inf, high: float = math.inf) -> bool:
    return type(x) is float and math.isfinite(x) and low <= x <= high


def is_text(s: Any, longest: int, shortest: int = 0) -> bool:
    return type(s) is str and shortest <= len(s) <= longest and not CONTROL.search(s)


def is_peer_id(s: Any) -> bool:
    return type(s) is str and re.fullmatch(r"[0-9A-Za-z]{1,64}", s) is not None


def assert_progress_bounded(r: ProgressRecord) -> None:
    assert is_peer_id(r.peer_id) and is_text(r.name, MAX_NAME) and is_text(r.device, MAX_DEVICE)
    assert all(is_count(n) for n in (r.epoch, r.inner_step, r.micro_batch)) and is_count(r.tokens_processed, 0, 2**62)
    assert is_real(r.samples_per_second, 0.0, MAX_RATE) and is_real(r.download_progress, 0.0, 1.0)
    assert r.last_loss is None or is_real(r.last_loss)
    assert is_real(r.time, 0.0, MAX_TIME) and r.state in {s.value for s in PeerState}
    assert type(r.client_mode) is bool and type(r.relayed) is bool
    assert len(r.checksums) <= CHECKSUM_HISTORY and len(r.accusations) <= MAX_ACCUSATIONS
    for c in r.checksums:
        assert is_count(c.epoch) and re.fullmatch(r"[0-9a-f]{64}", c.checksum)
    for a in r.accusations:
        assert is_peer_id(a.accused) and a.verdict in {v.value for v in AccusationVerdict} and is_count(a.epoch)
        assert type(a.receipt) is bytes and len(a.receipt) <= 16384


# ---- the expiry rule ----------------------------------------------------------------------------------------------


def test_a_record_is_kept_only_while_it_lives_and_no_longer_than_its_writer_could_give_it():
    now = 1_000.0
    assert fresh(now, now, RECORD_TTL) and fresh(now + RECORD_TTL, now, RECORD_TTL)
    assert fresh(now + RECORD_TTL + EXPIRY_SLACK, now, RECORD_TTL)  # a writer whose clock runs ahead
    assert not fresh(now - 0.1, now, RECORD_TTL)  # expired
    assert not fresh(now + RECORD_TTL + EXPIRY_SLACK + 0.1, now, RECORD_TTL)  # refused, not clamped
    assert not fresh(now + 10 * 365 * 86400, now, GROUP_TTL)  # a record for ten years
    assert fresh(now + GROUP_TTL, now, GROUP_TTL) and not fresh(now + GROUP_TTL, now, RECORD_TTL)
    for odd in (math.nan, math.inf, -math.inf, None, "1e3", True, [now], b"1"):
        assert not fresh(odd, now, RECORD_TTL)


@FUZZ
@given(expiration=st.one_of(st.floats(), st.integers(), junk), now=st.floats(0, 2e9), ttl=st.floats(0, 1e4))
def test_the_expiry_rule_never_raises_and_keeps_only_what_it_allows(expiration, now, ttl):
    if fresh(expiration, now, ttl):
        assert now <= expiration <= now + ttl + EXPIRY_SLACK


@pytest.mark.parametrize(
    "parse, ttl, honest",
    [
        (parse_peers, RECORD_TTL, lambda: (SUBKEYS[0], progress_value(IDS[0]))),
        (parse_groups, GROUP_TTL, lambda: (SUBKEYS[0], group_value(IDS[0]))),
        (parse_manifests, MANIFEST_TTL, lambda: (run_subkey(MANIFEST.run_id, SUBKEYS[0]), manifest_value())),
    ],
    ids=["progress", "groups", "manifests"],
)
def test_every_reader_refuses_a_record_set_to_outlive_its_kind(parse, ttl, honest):
    subkey, value = honest()
    now = get_dht_time()
    assert len(parse(ValueWithExpiration({subkey: ValueWithExpiration(value, now + ttl)}, now + ttl))) == 1
    far = now + ttl + EXPIRY_SLACK + 5
    assert parse(ValueWithExpiration({subkey: ValueWithExpiration(value, far)}, far)) == []
    assert parse(ValueWithExpiration({subkey: ValueWithExpiration(value, math.nan)}, now)) == []


# ---- the parsers of foreign records ---------------------------------------------------------------------------


@FUZZ
@given(items=items_of(mutated(PROGRESS, "progress")), shape=shapes)
def test_progress_records_from_a_bucket_are_bounded_or_refused(items, shape):
    now = get_dht_time()
    entries = parse_peers(found_of(items, now, shape))
    for entry in entries:
        assert_progress_bounded(entry.record)
        assert entry.record.peer_id in IDS and fresh(entry.expiration, now, RECORD_TTL)
    records = [e.record for e in entries]
    accused(records), quorum_bans(records)  # the accusations they carry are read without raising


@FUZZ
@given(items=items_of(mutated(GROUP, "group")), shape=shapes)
def test_group_records_are_bounded_or_refused(items, shape):
    for r in parse_groups(found_of(items, get_dht_time(), shape)):
        assert is_count(r.epoch) and re.fullmatch(r"[0-9a-f]{16}", r.group) and r.delegate in IDS
        assert is_count(r.size, 1, 4096) and is_real(r.weight, 0.0, MAX_TOKENS) and is_real(r.time, 0.0, MAX_TIME)
        for digest in (r.digest, r.merged):
            assert digest is None or re.fullmatch(r"[0-9a-f]{64}", digest)
        assert len(r.included) <= 256 and all(re.fullmatch(r"[0-9a-f]{16}", t) for t in r.included)


manifest_subkeys = st.one_of(
    st.sampled_from([run_subkey(MANIFEST.run_id, SUBKEYS[0]), run_subkey(RUN_ID, SUBKEYS[1])]), subkeys
)


@FUZZ
@given(
    items=st.lists(st.tuples(manifest_subkeys, mutated(MANIFEST_FIELDS, "manifest"), expirations), max_size=4),
    shape=shapes,
)
def test_manifest_records_are_bounded_or_refused(items, shape):
    records = parse_manifests(found_of(items, get_dht_time(), shape))
    for run_id, r in records:
        assert re.fullmatch(r"[0-9a-f]{16}", run_id)
        assert type(r.manifest_json) is str and len(r.manifest_json) <= MAX_MANIFEST_JSON
        assert is_text(r.name, MAX_NAME, 1) and is_real(r.created_at, 0.0, MAX_TIME)
    assert {r.run_id for r in _listings(records)} <= {MANIFEST.run_id}  # only a manifest that hashes to its id


@FUZZ
@given(value=st.one_of(accusation_items, junk))
def test_accusations_are_bounded_or_refused(value):
    found = parse_record(Accusation, value)
    if found is not None:
        assert is_peer_id(found.accused) and found.verdict in {v.value for v in AccusationVerdict}
        assert is_count(found.epoch) and type(found.receipt) is bytes and len(found.receipt) <= 16384


def test_an_accusations_verdict_is_one_a_ban_gives():
    assert {v.value for v in AccusationVerdict} == {r.value for r in BanReason}


# ---- what honest DHT nodes accept (their validators run on store and on get) ---------------------------------------

RUN_VALIDATOR = run_validator(RUN_ID)
RUNS_VALIDATOR = SchemaValidator(GlobalSchema, prefix=GLOBAL_PREFIX)


def one(subkey: Any, value: Any) -> ValueWithExpiration:
    """A read of a key holding one record, set to live a few seconds more."""
    return ValueWithExpiration({subkey: ValueWithExpiration(value, get_dht_time() + 5)}, get_dht_time() + 5)


def dht_record(raw_key: str, subkey: Any, value: Any) -> DHTRecord | None:
    try:
        packed = MSGPackSerializer.dumps(value), MSGPackSerializer.dumps(subkey)
    except (TypeError, ValueError, OverflowError):  # not something msgpack can carry
        return None
    return DHTRecord(DHTID.generate(source=raw_key).to_bytes(), packed[1], packed[0], get_dht_time() + 10)


@FUZZ
@given(value=mutated(PROGRESS, "progress"))
def test_a_progress_record_an_honest_node_accepts_is_bounded_and_kept_by_readers(value):
    record = dht_record(progress_key(RUN_ID), SUBKEYS[0], value)
    assume(record is not None and value is not None)  # None: a deletion, which the schema allows
    if RUN_VALIDATOR.validate(record):
        parsed = ProgressRecord.parse_obj(value)
        assert_progress_bounded(parsed)
        assert len(parse_peers(one(SUBKEYS[0], value))) == int(parsed.peer_id == IDS[0])  # its signer's id, or not


def test_a_bucket_read_keeps_only_the_records_of_peers_whose_bucket_it_is(monkeypatch):
    """A key that writes its record into every bucket of a level (the probe up moves readers to a level whose
    buckets hold 2 records, and each record counts in the estimate of the swarm's size) counts in its own alone."""
    level = next(lv for lv in range(1, 9) if bucket_of(IDS[0], lv) != bucket_of(IDS[1], lv))
    both = ValueWithExpiration(
        {s: ValueWithExpiration(progress_value(i), get_dht_time() + 5) for s, i in zip(SUBKEYS, IDS)},
        get_dht_time() + 5,
    )
    monkeypatch.setattr(dht_peers.calls, "get", lambda dht, key, timeout=None: both)
    assert len(parse_peers(both)) == 2  # both well formed and signed by their peers
    for me in IDS:
        kept = read_bucket(None, RUN_ID, level, bucket_of(me, level))
        assert [e.record.peer_id for e in kept] == [me]
    assert len(read_bucket(None, RUN_ID, 0, 0)) == 2  # level 0: one key for everyone


@FUZZ
@given(value=mutated(GROUP, "group"))
def test_a_group_record_an_honest_node_accepts_is_kept_by_readers(value):
    record = dht_record(groups_key(RUN_ID), SUBKEYS[0], value)
    assume(record is not None and value is not None)  # None: a deletion, which the schema allows
    if RUN_VALIDATOR.validate(record):
        assert len(parse_groups(one(SUBKEYS[0], value))) == int(value["delegate"] == IDS[0])


@FUZZ
@given(value=mutated(MANIFEST_FIELDS, "manifest"))
def test_a_manifest_record_an_honest_node_accepts_is_kept_by_readers(value):
    subkey = run_subkey(MANIFEST.run_id, SUBKEYS[0])
    record = dht_record(RUNS_KEY, subkey, value)
    assume(record is not None and value is not None)  # None: a deletion, which the schema allows
    if RUNS_VALIDATOR.validate(record):
        assert len(parse_manifests(one(subkey, value))) == 1


HONEST = {
    "progress": (progress_key(RUN_ID), SUBKEYS[0], progress_value(IDS[0]), RUN_VALIDATOR, parse_peers),
    "group": (groups_key(RUN_ID), SUBKEYS[0], group_value(IDS[0]), RUN_VALIDATOR, parse_groups),
    "manifest": (RUNS_KEY, run_subkey(MANIFEST.run_id, SUBKEYS[0]), manifest_value(), RUNS_VALIDATOR, parse_manifests),
}


# ids by position, not value: some values hold a peer id made from a fresh key, which differs in each xdist worker
@pytest.mark.parametrize("kind, field, bad", MISSED, ids=[f"{k}.{f}#{i}" for i, (k, f, _) in enumerate(MISSED)])
def test_a_field_out_of_its_bounds_is_refused_by_honest_nodes_and_by_readers(kind, field, bad):
    raw_key, subkey, honest, validator, parse = HONEST[kind]
    assert validator.validate(dht_record(raw_key, subkey, honest)) and len(parse(one(subkey, honest))) == 1
    record = dht_record(raw_key, subkey, {**honest, field: bad})
    assert record is None or not validator.validate(record)
    assert parse(one(subkey, {**honest, field: bad})) == []


def test_a_subkey_longer_than_any_owners_is_refused_by_honest_nodes():
    record = dht_record(progress_key(RUN_ID), SUBKEYS[0] + b"x" * 4096, progress_value(IDS[0]))
    assert not RUN_VALIDATOR.validate(record)


# ---- what an honest peer publishes passes ---------------------------------------------------------------------


@FUZZ
@given(
    loss=st.one_of(st.none(), st.floats()),
    speed=st.floats(),
    name=st.text(max_size=200),
    device=st.text(max_size=300),
)
def test_our_own_record_always_fits_the_bounds(loss, speed, name, device):
    """A diverged loss (inf), an odd speed, a long name with control characters: the record is still published (a
    record outside the bounds would be refused whole, and the peer would vanish from the swarm)."""
    fields = {**progress_value(IDS[0]), "last_loss": loss, "samples_per_second": speed, "name": name, "device": device}
    record = ProgressRecord(**within_bounds(fields))
    assert_progress_bounded(record)
    assert RUN_VALIDATOR.validate(dht_record(progress_key(RUN_ID), SUBKEYS[0], record.dict()))


def test_a_presence_refuses_a_lifetime_readers_would_refuse():
    with pytest.raises(ValueError):
        Presence(None, RUN_ID, progress_value(IDS[0]), ttl=RECORD_TTL + 1)
    presence = Presence(None, RUN_ID, {**progress_value(IDS[0]), "last_loss": math.inf})
    assert presence.snapshot().last_loss is None


def test_on_a_real_dht_an_oversized_record_is_refused_and_one_set_to_live_for_an_hour_is_not_read():
    honest = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0))
    signer = RSASignatureValidator(RSAPrivateKey())
    other = hivemind.DHT(
        initial_peers=[str(a) for a in honest.get_visible_maddrs()], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[signer, SchemaValidator(GlobalSchema, prefix=GLOBAL_PREFIX)],
    )  # fmt: skip
    try:
        for dht in (honest, other):
            dht.add_validators([run_validator(RUN_ID)])
        subkey, key, now = signer.local_public_key, progress_key(RUN_ID), get_dht_time()
        value = progress_value(peer_id_of_owner(subkey))
        oversized = {**value, "checksums": [ONE_CHECKSUM] * (CHECKSUM_HISTORY + 1)}
        assert not other.store(key, subkey=subkey, value=oversized, expiration_time=now + 10)
        assert other.store(key, subkey=subkey, value=value, expiration_time=now + 3600)  # hivemind keeps it...
        assert read_peers(honest, RUN_ID) == []  # ... but no reader counts it
        assert len(parse_peers(honest.get(key, latest=True), ttl=3600)) == 1  # (for its lifetime alone)
    finally:
        other.shutdown()
        honest.shutdown()
