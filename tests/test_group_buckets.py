"""A group's members read its bucket of the groups key, not the whole key (``groups.reads_wide``,
``records.group_bucket_key``): a member's read returns a few records whatever the swarm's size, and a delegate,
which makes the roster of every group, still reads them all."""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator

from swarm import NetworkConfig, start_dht
from swarm.dht import groups
from swarm.dht.groups import TREE_STEP, ancestors_of, group_record, group_tag, own_result, reads_wide, results_of
from swarm.dht.identity import peer_id_of_owner
from swarm.dht.records import GROUP_BITS, group_bucket_key, run_validator

RUN_ID = "0123456789abcdef"
DIGEST = {name: name * 64 for name in "0123456789"}
MEMBERS = tuple(f"peer{i:02d}" for i in range(7))


def test_a_member_reads_its_bucket_until_it_may_take_another_groups_average_or_has_asked_its_whole_tree():
    tag, delegate = group_tag(b"g"), MEMBERS[0]
    deep = max(MEMBERS[1:], key=lambda m: len(ancestors_of(MEMBERS, tag, delegate, m)))
    depth = len(ancestors_of(MEMBERS, tag, delegate, deep))
    assert depth == 2  # seven members: a binary tree of three levels, the delegate at its root
    args = (MEMBERS, tag, delegate)
    assert reads_wide(*args, delegate, left=100.0, patience=10.0, waited=None)  # a delegate makes the roster
    assert not reads_wide(*args, deep, left=100.0, patience=10.0, waited=None)  # waiting for its delegate's
    assert not reads_wide(*args, deep, left=100.0, patience=10.0, waited=(depth - 1) * TREE_STEP)  # its tree
    assert reads_wide(*args, deep, left=100.0, patience=10.0, waited=depth * TREE_STEP)  # then the other holders
    assert reads_wide(*args, deep, left=10.0, patience=10.0, waited=None)  # the last part: another group's average
    assert reads_wide(*args, "stranger", left=100.0, patience=10.0, waited=0.0)  # not in the tree: holders only


def test_a_member_that_read_only_its_bucket_counts_the_peers_its_delegate_said_and_no_more_than_full_groups():
    mine, theirs = group_tag(b"mine"), group_tag(b"theirs")
    merged = dict(merged=DIGEST["9"], included=sorted([mine, theirs]))
    delegate = group_record(3, mine, "peer00", 3, 48.0, DIGEST["1"], False, **merged, peers=7)
    other = group_record(3, theirs, "peer05", 4, 64.0, DIGEST["2"], False, **merged, peers=7)
    assert results_of([delegate, other], 3)[DIGEST["9"]].peers == 7  # every group read: their sizes
    assert own_result([delegate], 3, mine).peers == 7  # only our bucket: what our delegate said
    liar = group_record(3, mine, "peer00", 3, 48.0, DIGEST["1"], False, **{**merged, "peers": 10**6})
    assert own_result([liar], 3, mine).peers == 4096 * 2  # at most a full group each
    unsaid = group_record(3, mine, "peer00", 3, 48.0, DIGEST["1"], False, **merged)
    assert own_result([unsaid], 3, mine).peers == 4  # ours, and one for the group we did not read
    mislabelled = group_record(3, mine, "peer00", 3, 48.0, DIGEST["1"], False, **{**merged, "peers": 1})
    assert results_of([mislabelled, other], 3)[DIGEST["9"]].peers == 7  # sizes read beat what was said


def test_group_buckets_spread_over_every_key_the_validator_knows():
    tags = [group_tag(str(i).encode()) for i in range(4000)]
    buckets = {group_bucket_key(RUN_ID, t) for t in tags}
    assert len(buckets) == 1 << GROUP_BITS
    assert all(group_bucket_key(RUN_ID, t) == group_bucket_key(RUN_ID, t) for t in tags[:10])


def test_on_a_real_dht_a_delegate_writes_both_keys_and_a_members_read_returns_its_groups_bucket():
    dht = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0))
    try:
        dht.add_validators([run_validator(RUN_ID)])
        me = peer_id_of_owner(RSASignatureValidator().local_public_key)
        first, second = group_tag(b"first"), next(
            t for t in (group_tag(str(i).encode()) for i in range(100))
            if group_bucket_key(RUN_ID, t) != group_bucket_key(RUN_ID, group_tag(b"first"))
        )  # fmt: skip
        assert groups.register(dht, RUN_ID, group_record(3, first, me, 2, 32.0, DIGEST["1"], False))
        assert [r.group for r in groups.read_bucket(dht, RUN_ID, first)] == [first]
        assert groups.register(dht, RUN_ID, group_record(4, second, me, 2, 32.0, DIGEST["2"], False))
        assert [r.group for r in groups.read_groups(dht, RUN_ID)] == [second]  # one record per delegate
        assert [r.group for r in groups.read_bucket(dht, RUN_ID, second)] == [second]
        assert [r.epoch for r in groups.read_bucket(dht, RUN_ID, first)] == [3]  # its members still find it
    finally:
        dht.shutdown()
