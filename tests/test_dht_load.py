"""What a DHT node spends on others' reads and writes: each record judged once (``hivemind_fixes.verdicts``), by a
schema of its own key (``records.RunValidator``), and searches only as wide as a value's replicas
(``hivemind_fixes.beam``). Twelve peers on two cores had spent most of the machine in their DHT processes."""

from __future__ import annotations

import collections

import hivemind
import pydantic.v1 as pv1
import pytest
from hivemind.dht import protocol
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hypothesis import assume, given
from hypothesis import strategies as st

from swarm.dht.records import (
    GroupRecord,
    OwnerSubkey,
    ProgressRecord,
    group_bucket_key,
    groups_key,
    progress_key,
    run_prefix,
)
from swarm.hivemind_fixes import verdicts
from swarm.hivemind_fixes.beam import narrow_searches
from tests.test_records_fuzz import (
    FUZZ,
    GROUP,
    IDS,
    PROGRESS,
    RUN_ID,
    RUN_VALIDATOR,
    SUBKEYS,
    TAG,
    dht_record,
    group_value,
    mutated,
    progress_value,
)

# ---- a record is judged once ------------------------------------------------------------------------------------


class Counting(RecordValidatorBase):
    """Says yes to records whose value is not b"bad", and counts how often it was asked."""

    def __init__(self):
        self.asked = 0

    def validate(self, record: DHTRecord) -> bool:
        self.asked += 1
        return record.value != b"bad"


def record(value: bytes = b"v", subkey: bytes = b"s", expiration: float = 100.0) -> DHTRecord:
    return DHTRecord(b"k" * 20, subkey, value, expiration)


@pytest.fixture
def remembering():
    verdicts.remember_verdicts()
    yield
    # the patch stays for the process (as in a DHT process); nothing here depends on it being undone


def test_the_same_record_is_judged_once_and_a_refusal_is_remembered_too(remembering):
    inner = Counting()
    composite = CompositeValidator([inner])
    for _ in range(5):
        assert composite.validate(record())
        assert not composite.validate(record(b"bad"))
    assert inner.asked == 2


def test_any_byte_of_a_record_or_its_expiration_makes_it_another_record(remembering):
    inner = Counting()
    composite = CompositeValidator([inner])
    variants = [
        record(),
        record(b"w"),
        record(subkey=b"t"),
        record(expiration=100.5),
        DHTRecord(b"j" * 20, b"s", b"v", 100.0),
    ]
    for r in variants:
        composite.validate(r)
    assert inner.asked == len(variants)
    # length-prefixed parts: moving a byte from the subkey to the value is another record
    assert verdicts.record_digest(record(b"v", b"sx")) != verdicts.record_digest(record(b"xv", b"s"))


def test_a_validator_added_later_judges_records_again(remembering):
    first, later = Counting(), Counting()
    composite = CompositeValidator([first])
    assert composite.validate(record())
    composite.extend([later])
    composite.validate(record())
    assert (first.asked, later.asked) == (2, 1)


def test_the_table_is_bounded(remembering, monkeypatch):
    monkeypatch.setattr(verdicts, "MAX_VERDICTS", 8)
    inner = Counting()
    composite = CompositeValidator([inner])
    for i in range(20):
        composite.validate(record(str(i).encode()))
    assert len(composite.__dict__["_swarm_verdicts"]) == 8
    composite.validate(record(b"0"))  # forgotten: judged again
    assert inner.asked == 21


# ---- the run's keys, each by its own schema, judged as hivemind's SchemaValidator would -----------------------------

# hivemind's own validator over a schema of three of the run's keys, as the run's schema of all 512 keys was built
BUCKET_FIELD = group_bucket_key(RUN_ID, TAG).removeprefix(run_prefix(RUN_ID) + "_")
HIVEMIND = SchemaValidator(
    pv1.create_model(
        "AllKeysSchema",
        progress=(dict[OwnerSubkey, ProgressRecord | None], None),
        progress_L1_1=(dict[OwnerSubkey, ProgressRecord | None], None),
        groups=(dict[OwnerSubkey, GroupRecord | None], None),
        **{BUCKET_FIELD: (dict[OwnerSubkey, GroupRecord | None], None)},
    ),
    prefix=run_prefix(RUN_ID),
)
KEYS = [
    progress_key(RUN_ID), progress_key(RUN_ID, 1, 1), groups_key(RUN_ID), group_bucket_key(RUN_ID, TAG),
    f"{run_prefix(RUN_ID)}_other",
]  # fmt: skip


@FUZZ
@given(
    value=st.one_of(mutated(PROGRESS, "progress"), mutated(GROUP, "group")),
    key=st.sampled_from(KEYS),
    subkey=st.sampled_from([SUBKEYS[0], SUBKEYS[0] + b"x" * 4096, b"no owner", None]),
)
def test_the_run_validator_judges_every_record_as_hiveminds_schema_validator_did(value, key, subkey):
    found = dht_record(key, subkey, value)
    assume(found is not None)
    assert RUN_VALIDATOR.validate(found) == HIVEMIND.validate(found)


def test_honest_records_pass_and_a_dictionary_without_subkeys_does_not():
    assert RUN_VALIDATOR.validate(dht_record(progress_key(RUN_ID, 2, 3), SUBKEYS[0], progress_value(IDS[0])))
    assert RUN_VALIDATOR.validate(dht_record(groups_key(RUN_ID), SUBKEYS[0], group_value(IDS[0])))
    assert not RUN_VALIDATOR.validate(dht_record(groups_key(RUN_ID), SUBKEYS[0], progress_value(IDS[0])))
    for tag in ("00" + "0" * 14, TAG, "ff" + "f" * 14):  # every bucket of the groups key is judged by its schema
        assert RUN_VALIDATOR.validate(dht_record(group_bucket_key(RUN_ID, tag), SUBKEYS[0], group_value(IDS[0])))
        assert not RUN_VALIDATOR.validate(dht_record(group_bucket_key(RUN_ID, tag), SUBKEYS[0], progress_value(IDS[0])))
    whole = dht_record(progress_key(RUN_ID), None, {SUBKEYS[0]: progress_value(IDS[0])})
    assert not RUN_VALIDATOR.validate(whole) and not HIVEMIND.validate(whole)
    garbage = DHTRecord(whole.key, whole.subkey, b"\xc1\xc1", whole.expiration_time)  # bytes msgpack cannot read
    assert not RUN_VALIDATOR.validate(garbage)


# ---- searches as wide as a value's replicas, on real DHT nodes -------------------------------------------------------

FINDS = collections.Counter()
_call_find = protocol.DHTProtocol.call_find


async def _counted_find(self, *args, **kwargs):
    FINDS["sent"] += 1
    return await _call_find(self, *args, **kwargs)


async def _finds_sent(_dht, _node) -> int:
    return FINDS["sent"]


def test_a_read_asks_about_as_many_nodes_as_hold_the_value_and_still_finds_every_record():
    """Eight DHT nodes (hivemind's own, each its own process, as a peer's): every node writes its subkey of one key,
    then every node reads the key back with ``latest=True``. With hivemind's beam of 20 each read asks all seven
    others; searching ``num_replicas`` (5) wide it asks five, and no record is missing."""
    narrow_searches()  # patched before the nodes fork, as ``start_dht`` does
    protocol.DHTProtocol.call_find = _counted_find
    nodes: list[hivemind.DHT] = []
    try:
        nodes.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        maddrs = [str(a) for a in nodes[0].get_visible_maddrs()]
        nodes += [
            hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs) for _ in range(7)
        ]
        for i, node in enumerate(nodes):
            assert node.store("bucket", subkey=f"peer{i}", value=i, expiration_time=get_dht_time() + 60)
        before = sum(node.run_coroutine(_finds_sent) for node in nodes)
        found = [node.get("bucket", latest=True) for node in nodes]
        per_read = (sum(node.run_coroutine(_finds_sent) for node in nodes) - before) / len(nodes)
    finally:
        protocol.DHTProtocol.call_find = _call_find
        for node in nodes:
            node.shutdown()
    assert all(f is not None and sorted(f.value) == [f"peer{i}" for i in range(8)] for f in found)
    assert per_read <= 5.5, per_read  # hivemind's own beam: 7 (every other node)
