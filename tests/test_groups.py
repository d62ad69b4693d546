"""Two-stage rounds and bounded records, as pure rules on real records and views (``swarm.dht.groups``,
``swarm.dht.records``, ``swarm.dht.peers.RecordCache``, ``swarm.averager.process.matchmaking_bucket``)."""

from __future__ import annotations

import time
from collections import Counter

from test_swarm_view import A, B, C, record

from swarm.averager.process import attempt_timeout, epoch_group_bits, matchmaking_bucket
from swarm.dht import peers as dht_peers
from swarm.dht.groups import (
    ROSTER_WAIT,
    SETTLE,
    TREE_STEP,
    Decision,
    Stage2,
    delegate_decision,
    delegate_disagrees,
    delegate_of,
    delegate_rank,
    fetch_sources,
    group_record,
    group_tag,
    in_groups,
    own_result,
    result_of,
    stage2_plan,
    stands_in,
    unaccounted,
    writer_rank,
)
from swarm.dht.peers import PROBE_EVERY, REFIND_EVERY, RecordCache, SwarmReader
from swarm.dht.records import BUCKET_SIZE, MAX_LEVEL, PeerEntry, PeerState, bucket_of, read_level, write_levels
from swarm.dht.view import build_view, nobody_to_group_with, round_started_without

D, E = "d" * 8, "e" * 8
DIGEST = {name: name * 64 for name in "0123456789"}


def view_of(*records):
    return build_view([PeerEntry(r, time.time() + 60) for r in records], time.time(), 10, 8)


def group(epoch, tag, delegate, size=2, weight=16.0, digest="1", **merge):
    return group_record(epoch, tag, delegate, size, weight, DIGEST[digest], False, **merge)


def test_every_member_picks_the_same_delegate_and_tag():
    members, gid = (A, B, C), b"group-id-1"
    assert delegate_of(members, gid) == delegate_of((C, A, B), gid) in members
    assert group_tag(gid) == group_tag(b"group-id-1") != group_tag(b"group-id-2") and len(group_tag(gid)) == 16


def test_the_swarms_average_is_the_one_holding_the_most_samples_and_a_member_prefers_its_delegates():
    g1, g2, g3 = "1" * 16, "2" * 16, "3" * 16
    records = [
        group(5, g1, A, weight=16.0, merged=DIGEST["7"], included=[g1, g2]),
        group(5, g2, B, weight=8.0, merged=DIGEST["7"], included=[g1, g2]),
        group(5, g3, C, weight=20.0, merged=DIGEST["8"], included=[g3]),  # a second second-stage group, lighter
        group(4, g1, D, weight=99.0, merged=DIGEST["9"], included=[g1]),  # another epoch's
    ]
    best = result_of(records, 5)
    assert best.digest == DIGEST["7"] and best.weight == 24.0 and set(best.holders) == {A, B}
    assert own_result(records, 5, g3).digest == DIGEST["8"]  # its delegate's: it holds its work
    assert own_result(records, 5, "4" * 16) is None and result_of(records, 6) is None


def test_a_delegate_waits_for_the_epochs_unaccounted_peers_then_merges_or_finds_itself_alone():
    mine, other = "1" * 16, "2" * 16
    view = view_of(
        record(A, 3, PeerState.merging),
        record(B, 3, PeerState.merging),
        record(C, 3, PeerState.training),  # still training towards the round: its group will come
        record(D, 4),  # another epoch: not waited for
    )
    ours = [group(3, mine, A)]
    assert unaccounted(view, ours, 3, (A, B), mine) == 1
    assert delegate_decision(view, ours, 3, (A, B), mine, waited=SETTLE / 2, patience=30) == Decision.wait
    assert delegate_decision(view, ours, 3, (A, B), mine, waited=5, patience=30) == Decision.wait
    assert delegate_decision(view, ours, 3, (A, B), mine, waited=31, patience=30) == Decision.alone  # gave up on C
    merging = view_of(record(A, 3, PeerState.merging), record(B, 3, PeerState.merging), record(C, 3, PeerState.merging))
    assert unaccounted(merging, ours, 3, (A, B), mine) == 1  # C merges in a group not registered yet
    both = [*ours, group(3, other, C, size=1)]
    assert unaccounted(merging, both, 3, (A, B), mine) == 0
    assert delegate_decision(merging, both, 3, (A, B), mine, waited=5, patience=30) == Decision.merge
    alone = view_of(record(A, 3, PeerState.merging), record(B, 3, PeerState.merging))
    assert delegate_decision(alone, ours, 3, (A, B), mine, waited=5, patience=30) == Decision.alone
    assert delegate_decision(alone, [], 3, (A, B), mine, waited=5, patience=30) == Decision.wait  # not read back
    # C is in a group of its own, still averaging over a slow link: waited for beyond the patience for trainers
    averaging = view_of(
        record(A, 3, PeerState.merging), record(B, 3, PeerState.merging), record(C, 3, PeerState.averaging)
    )
    assert in_groups(averaging, ours, 3, (A, B), mine) == 1 and in_groups(view, ours, 3, (A, B), mine) == 0
    assert delegate_decision(averaging, ours, 3, (A, B), mine, 31, 30, group_patience=240) == Decision.wait
    assert delegate_decision(averaging, ours, 3, (A, B), mine, 241, 30, group_patience=240) == Decision.alone
    assert delegate_decision(view, ours, 3, (A, B), mine, 31, 30, group_patience=240) == Decision.alone  # C trains


def test_every_delegate_starts_the_second_stage_with_the_one_roster_however_late_it_read_the_groups():
    g = {d: str(i) * 16 for i, d in enumerate((A, B, C, D), start=1)}
    early = [group(7, g[d], d) for d in (A, B, C)]  # what the first writer read when it decided: D came later
    first, second, _ = sorted((A, B, C), key=lambda d: writer_rank(7, d))
    # nobody writes before deciding to merge; the first writer at once, the next only after its turn's wait
    assert stage2_plan(early, 7, g[first], first, -1.0).action == Stage2.wait
    plan = stage2_plan(early, 7, g[first], first, 0.0)
    assert plan.action == Stage2.write and plan.writer == first
    assert [r.delegate for r in plan.roster] == sorted((A, B, C))
    assert stage2_plan(early, 7, g[second], second, ROSTER_WAIT * 0.9).action == Stage2.wait
    assert stage2_plan(early, 7, g[second], second, ROSTER_WAIT).action == Stage2.write  # the first is gone
    roster = [r.group for r in plan.roster]
    written = [group(7, g[d], d, roster=roster if d == first else ()) for d in (A, B, C)]
    late = [*written, group(7, g[D], D)]  # the groups as the others read them, D's registered since
    for d in (A, B, C):  # whatever they read, whether they decided to merge yet or not: the same members
        for records in (written, late):
            for waited in (-1.0, 0.0, 10 * ROSTER_WAIT):
                follow = stage2_plan(records, 7, g[d], d, waited)
                assert follow.action == Stage2.follow and follow.writer == first, (d, waited)
                assert [r.delegate for r in follow.roster] == sorted((A, B, C))
    # the late group is not in it, and no second roster is written for it: its delegate takes the swarm's average
    assert stage2_plan(late, 7, g[D], D, 10 * ROSTER_WAIT).action == Stage2.wait
    # a member of a roster whose groups' records it has not all read yet waits for them (for ROSTER_WAIT)
    reader, unread = (d for d in (A, B, C) if d != first)
    partial = [r for r in written if r.delegate != unread]
    for waited in (-1.0, 0.0, ROSTER_WAIT * 0.9):
        assert stage2_plan(partial, 7, g[reader], reader, waited).action == Stage2.wait


def test_a_strangers_roster_that_leaves_groups_out_does_not_stop_them_from_merging():
    g = {d: str(i) * 16 for i, d in enumerate((A, B, C, D), start=1)}
    liar = D
    records = [group(3, g[liar], liar, roster=[g[liar], g[A]]), *(group(3, g[d], d) for d in (A, B, C))]
    assert stage2_plan(records, 3, g[A], A, 0.0).action == Stage2.follow  # A was named: it tries (then without D)
    first, second = sorted((B, C), key=lambda d: writer_rank(3, d))
    plan = stage2_plan(records, 3, g[first], first, 0.0)
    assert plan.action == Stage2.write and {r.delegate for r in plan.roster} == {B, C}
    assert stage2_plan(records, 3, g[second], second, 0.0).action == Stage2.wait  # its turn comes later
    # a roster naming a group that is not registered holds its followers only until they have waited ROSTER_WAIT
    fake = [group(3, g[liar], liar, roster=[g[liar], g[A], g[B], "f" * 16]), *(group(3, g[d], d) for d in (A, B))]
    assert stage2_plan(fake, 3, g[A], A, -1.0).action == Stage2.wait
    assert stage2_plan(fake, 3, g[A], A, ROSTER_WAIT * 0.9).action == Stage2.wait
    writer = min((A, B), key=lambda d: writer_rank(3, d))
    plan = stage2_plan(fake, 3, g[writer], writer, ROSTER_WAIT)
    assert plan.action == Stage2.write and {r.delegate for r in plan.roster} == {A, B, liar}


def test_of_two_rosters_every_delegate_follows_the_first_ranked_writers_that_holds_its_group():
    g = {d: str(i) * 16 for i, d in enumerate((A, B, C), start=1)}
    first, second, third = sorted((A, B, C), key=lambda d: writer_rank(3, d))
    both = [
        group(3, g[first], first, roster=[g[first], g[second], g[third]]),
        group(3, g[second], second, roster=[g[second], g[third]]),  # wrote while the first's was on its way
        group(3, g[third], third),
    ]
    for d in (A, B, C):
        plan = stage2_plan(both, 3, g[d], d, 0.0)
        assert plan.action == Stage2.follow and plan.writer == first, d


def test_the_swarms_average_reaches_a_group_down_a_tree_in_which_no_member_serves_more_than_two():
    tag, delegate = "5" * 16, "m00"
    members = [delegate, *(f"m{i:02d}" for i in range(1, 63))]
    holders = (delegate, "x1", "x2")  # the second stage's delegates
    first = {m: fetch_sources(members, tag, delegate, m, holders, 0.0) for m in members[1:]}
    assert all(len(sources) == 1 for sources in first.values())
    assert max(Counter(s[0] for s in first.values()).values()) == 2  # a parent serves two children
    assert Counter(s[0] for s in first.values())[delegate] == 2
    # the tree spans the group: following parents from any member reaches the delegate in at most log2(63) hops
    for member in members[1:]:
        hops, node = 0, member
        while node != delegate:
            node, hops = first[node][0], hops + 1
        assert hops <= 6
    # in a group of four, one member gets it from another
    four = [delegate, "m01", "m02", "m03"]
    parents = Counter(fetch_sources(four, tag, delegate, m, holders, 0.0)[0] for m in four[1:])
    assert parents[delegate] == 2 and sum(parents.values()) == 3
    # every TREE_STEP the next ancestor up may be asked too (the parent may be gone); then the holders
    deep = max(members[1:], key=lambda m: len(fetch_sources(members, tag, delegate, m, holders, 1e9)))
    later = fetch_sources(members, tag, delegate, deep, holders, TREE_STEP)
    assert later[0] == first[deep][0] and later[1] == first[later[0]][0]
    last = fetch_sources(members, tag, delegate, deep, holders, 1e9)
    assert set(last) - set(members) == {"x1", "x2"} and last.index(delegate) < last.index("x1")
    # a delegate, or a peer outside the group, asks the holders, each in an order of its own
    orders = {tuple(fetch_sources(members, tag, delegate, who, holders, 0.0)) for who in ("a", "b", "c", "d", "e")}
    assert all(set(order) == set(holders) for order in orders) and len({o[0] for o in orders}) > 1
    assert delegate not in fetch_sources(members, tag, delegate, delegate, holders, 0.0)


def test_a_member_does_not_take_a_swarms_average_its_delegate_made_from_another_average_of_their_group():
    tag = "1" * 16
    # the delegate kept the slice our audits dropped (it was the liar): its group record names another digest
    records = [group(3, tag, A, digest="5", merged=DIGEST["5"], included=[tag])]
    assert delegate_disagrees(records, 3, tag, A, DIGEST["6"])
    assert not delegate_disagrees(records, 3, tag, A, DIGEST["5"])  # the same bytes: take it
    assert not delegate_disagrees(records, 3, tag, B, DIGEST["6"])  # B is not our delegate
    assert not delegate_disagrees([], 3, tag, A, DIGEST["6"]) and not delegate_disagrees(records, 4, tag, A, "x")
    assert not delegate_disagrees(records, 3, tag, A, None)  # a group of one has no digest to compare


def test_a_member_speaks_for_its_group_only_once_the_delegate_is_gone_and_only_one_member_does():
    tag, members = "1" * 16, (A, B, C)
    survivors = sorted((B, C), key=lambda m: delegate_rank(tag, m))
    first, second = survivors
    alive = view_of(record(A, 3, PeerState.merging), record(B, 3, PeerState.merging), record(C, 3, PeerState.merging))
    # the delegate is still there (slow, say): nobody speaks for it, however long it takes
    assert not any(stands_in(alive, [], 3, members, A, tag, me) for me in members)
    # the delegate's record expired (killed in the all-reduce): the first survivor in the order speaks, only it
    dead = view_of(record(B, 3, PeerState.merging), record(C, 3, PeerState.merging))
    assert [stands_in(dead, [], 3, members, A, tag, me) for me in survivors] == [True, False]
    # once the group is registered (by anyone), nobody else does
    assert not stands_in(dead, [group(3, tag, first)], 3, members, A, tag, second)
    # the first survivor is gone too: the second speaks
    alone = view_of(record(second, 3, PeerState.merging))
    assert stands_in(alone, [], 3, members, A, tag, second)
    # a delegate that moved past the epoch (its all-reduce failed, it stepped alone) will not register either
    moved = view_of(record(A, 4), record(B, 3, PeerState.merging), record(C, 3, PeerState.merging))
    assert stands_in(moved, [], 3, members, A, tag, first) and not stands_in(moved, [], 3, members, A, tag, second)
    assert not stands_in(dead, [], 3, members, A, tag, A)  # the delegate itself never "stands in"


def test_a_member_does_not_wait_for_a_delegate_its_own_evidence_of_the_round_condemns():
    """A liar that is its group's delegate (it sent malformed parts, withheld its slice) would hold its honest
    groupmates' merge until it left or merge_limit ran out: the members that caught it speak for the group at once,
    the first of them in the order only, and never for a distrusted groupmate."""
    tag, members = "2" * 16, (A, B, C)
    first, second = sorted((B, C), key=lambda m: delegate_rank(tag, m))
    alive = view_of(record(A, 3, PeerState.merging), record(B, 3, PeerState.merging), record(C, 3, PeerState.merging))
    assert not any(stands_in(alive, [], 3, members, A, tag, me) for me in (B, C))  # no evidence: it is waited for
    assert [stands_in(alive, [], 3, members, A, tag, me, distrusted={A}) for me in (first, second)] == [True, False]
    # the first in the order is distrusted too (it lied to us as well): the second speaks
    assert stands_in(alive, [], 3, members, A, tag, second, distrusted={A, first})
    # once someone registered the group, nobody else does, whatever it holds against the delegate
    assert not stands_in(alive, [group(3, tag, first)], 3, members, A, tag, second, distrusted={A})


def test_a_lone_peer_stops_looking_for_a_group_once_everyone_else_merges():
    merging = [record(B, 3, PeerState.merging), record(C, 3, PeerState.merging)]
    assert nobody_to_group_with(view_of(record(A, 3, PeerState.matchmaking), *merging), A, 3)
    assert not nobody_to_group_with(view_of(*merging, record(D, 3, PeerState.training)), A, 3)  # D may come
    assert not nobody_to_group_with(view_of(record(B, 3), record(C, 3)), A, 3)  # nobody merging: a first stage
    # and a peer still training joins the round early when its mates are merging, as when they are matchmaking
    assert round_started_without(view_of(record(A, 3), *merging), A, 3, min_group_size=2)


def test_records_go_to_the_levels_next_to_the_readers_and_a_bucket_splits_in_two_one_level_down():
    assert read_level(BUCKET_SIZE) == 0 and read_level(1000) == MAX_LEVEL and read_level(12) == 2
    assert list(write_levels(0)) == [0, 1] and list(write_levels(4)) == [3, 4, 5]
    assert list(write_levels(MAX_LEVEL)) == [MAX_LEVEL - 1, MAX_LEVEL]
    for peer in ("QmA", "QmB", "QmC"):
        assert bucket_of(peer, 3) >> 1 == bucket_of(peer, 2) and 0 <= bucket_of(peer, 3) < 8
    # even probes find any three consecutive levels a run writes to (swarm.dht.peers.find_level)
    assert all(any(level % 2 == 0 for level in write_levels(L)) for L in range(MAX_LEVEL + 1))


def test_the_cache_moves_up_a_level_when_its_buckets_are_full_and_down_when_they_are_empty():
    cache, now = RecordCache(), time.time()
    crowd = [PeerEntry(record(f"peer{i:03d}"), now + 60) for i in range(3 * BUCKET_SIZE)]
    cache.add(0, crowd)
    assert cache.level == 1 and cache.peers_estimate >= len(crowd)
    reads = 0
    while cache.level == 1 and reads < 6:
        cache.add(1, [])
        reads += 1
    assert cache.level == 0 and reads >= 2  # empty buckets, read after read: one level down, not at the first
    assert [cache.next_bucket() for _ in range(2)] == [0, 0]
    assert len(cache.live(now)) == len(crowd) and cache.live(now + 120) == []  # records expire with their TTL


def split_run(late: int, rest: int, low: int, high: int) -> dict[tuple[int, int], list]:
    """Buckets of a run split in two: ``late`` peers settled at level ``low``, ``rest`` at ``high``, each writing to
    its level and its neighbours (``write_levels``)."""
    now, buckets = time.time(), {}
    for count, level, name in ((late, low, "late"), (rest, high, "rest")):
        for i in range(count):
            peer = f"{name}{i:03d}"
            for written in write_levels(level):
                buckets.setdefault((written, bucket_of(peer, written)), []).append(PeerEntry(record(peer), now + 60))
    return buckets


def read_like_a_peer(cache: RecordCache, buckets: dict, reads: int) -> None:
    for _ in range(reads):
        level, bucket = cache.next_read()
        cache.add(level, buckets.get((level, bucket), []))


def test_a_reader_settled_at_a_low_level_finds_the_rest_of_the_run_two_levels_up_and_joins_it():
    """Late arrivals that settled at level 2 (20 of them, 5 a bucket: no reason to move) and 87 peers at level 5
    (2.7 a bucket) write to levels 1-3 and 4-6: neither part reads the other's (swarm-sim saw the late ones lose every
    round's work). The probe two levels up finds the rest within a few probes; a run at one level never moves."""
    import random

    random.seed(0)
    buckets = split_run(late=20, rest=87, low=2, high=5)
    cache = RecordCache()
    cache.settle(2, buckets.get((2, 0), []))
    read_like_a_peer(cache, buckets, PROBE_EVERY - 2)
    assert cache.level == 2 and not any(p.startswith("rest") for p in cache.records)  # the split, as it was
    read_like_a_peer(cache, buckets, 6 * PROBE_EVERY)
    assert cache.level >= 4 and cache.peers_estimate > 50  # it reads where the rest writes now
    assert sum(p.startswith("rest") for p in cache.records) >= BUCKET_SIZE
    whole = split_run(late=0, rest=100, low=0, high=5)  # one run at one level: level 7 holds nobody, nothing moves
    steady = RecordCache()
    steady.settle(5, whole.get((5, 0), []))
    read_like_a_peer(steady, whole, 10 * PROBE_EVERY)
    assert steady.level in (4, 5)


def test_a_joiner_that_finds_only_its_own_record_at_level_0_looks_again_and_joins_the_run_where_it_writes(
    monkeypatch,
):
    """A joiner writes its record at level 0 before it knows the run's level. Its first read found that record and
    nothing else, so it stayed at level 0, saw nobody, and trained from the seed as the run's first peer (swarm-sim).
    Its own record does not count as finding the run: it probes on (at most every ``REFIND_EVERY`` while it sees only
    itself) and settles where the 100 peers write."""
    import random

    random.seed(1)
    clock = [1000.0]
    buckets = split_run(late=0, rest=100, low=0, high=5)
    joiner = "joiner"
    buckets[(0, 0)] = [PeerEntry(record(joiner), clock[0] + 60)]  # its own record, written before its first read
    reads = []

    def read_bucket(dht, run_id, level, bucket):
        reads.append(level)
        return [e for e in buckets.get((level, bucket), []) if e.expiration >= clock[0]]

    monkeypatch.setattr(dht_peers, "read_bucket", read_bucket)
    monkeypatch.setattr(dht_peers, "get_dht_time", lambda: clock[0])
    reader = SwarmReader(None, "run", inner_steps=20, samples_per_step=8, me=joiner)
    entries = reader.entries()
    assert reader.cache.level in (4, 5, 6) and len({e.record.peer_id for e in entries} - {joiner}) >= BUCKET_SIZE
    assert reads[:2] == [0, 2]  # level 0 held only itself: not the run

    # the run's first peer, alone: it looks again at most every REFIND_EVERY, not on every read
    alone = SwarmReader(None, "run", inner_steps=20, samples_per_step=8, me=joiner)
    buckets.clear()
    buckets[(0, 0)] = [PeerEntry(record(joiner), clock[0] + 60)]
    reads.clear()
    alone.entries()
    looks = reads.count(2)
    for _ in range(5):
        clock[0] += 1.0
        alone.entries()
    assert alone.cache.level == 0 and reads.count(2) == looks == 1  # 5 s later: not yet
    clock[0] += REFIND_EVERY
    buckets.update(split_run(late=0, rest=100, low=0, high=5))  # the run it was meant to join shows up
    alone.entries()
    assert alone.cache.level in (4, 5, 6) and reads.count(2) == 2  # where the run writes
    # a reader without ``me`` (status, tests) keeps what it had: a record at level 0 is the run
    plain = SwarmReader(None, "run", inner_steps=20, samples_per_step=8)
    buckets.clear()
    buckets[(0, 0)] = [PeerEntry(record(joiner), clock[0] + 60)]
    plain.entries()
    assert plain.cache.level == 0 and [e.record.peer_id for e in plain.entries()] == [joiner]


def test_matchmaking_splits_into_keys_of_about_a_group_only_when_the_swarm_outgrows_one():
    assert matchmaking_bucket("QmA", peers=12, group_size=64) == ""  # one key, as before
    keys = {matchmaking_bucket(f"Qm{i}", peers=1000, group_size=64) for i in range(400)}
    assert len(keys) == 16 and all(len(k) == 4 for k in keys)  # 1000 / 64 -> 16 keys of 4 bits
    # a retry after an attempt that found no group: half the bits, so that neighbouring keys' failures meet
    retried = {matchmaking_bucket(f"Qm{i}", peers=1000, group_size=64, retries=1) for i in range(400)}
    assert len(retried) == 4 and all(len(r) == 2 for r in retried)
    assert all(
        matchmaking_bucket(f"Qm{i}", 1000, 64, retries=1) == matchmaking_bucket(f"Qm{i}", 1000, 64)[:2]
        for i in range(50)
    )
    assert {matchmaking_bucket(f"Qm{i}", 1000, 64, retries=3) for i in range(50)} == {""}  # 4 -> 2 -> 1 -> 0 bits
    assert epoch_group_bits(5, bucket="0110").endswith("0110") and set(epoch_group_bits(5, bucket="0110")) <= {"0", "1"}


def test_a_key_of_about_one_group_is_given_up_after_two_windows_and_the_one_key_of_a_small_swarm_never():
    """Five peers in groups of two matchmake in four keys: the three the hash left alone each waited out the whole
    matchmaking timeout, every round (21 s), before joining the others' second stage."""
    keys = [matchmaking_bucket(f"Qm{i}", peers=5, group_size=2) for i in range(5)]
    assert all(len(k) == 2 for k in keys)  # four keys of 2 bits for five peers: some hold one
    assert attempt_timeout(keys[0], matchmaking_time=5.0, matchmaking_timeout=60.0) == 10.0
    assert attempt_timeout("", matchmaking_time=5.0, matchmaking_timeout=60.0) == 60.0  # one key: the whole wait
    assert attempt_timeout("01", matchmaking_time=5.0, matchmaking_timeout=8.0) == 8.0  # never past the timeout


def test_parse_groups_drops_malformed_and_unsigned_records_without_raising():
    """Foreign group records: random shapes, wrong types, oversized lists, a delegate that is not the signer."""
    import random

    from hivemind.utils import ValueWithExpiration, get_dht_time

    from swarm.dht.groups import parse_groups

    rng = random.Random(0)
    later = get_dht_time() + 60
    junk = [
        None,
        1,
        "x",
        b"\x00" * 10,
        [],
        {},
        {"epoch": -1},
        {"epoch": "1"},
        {"size": 10**9},
        {"included": ["0"] * 999},
    ]
    for _ in range(300):
        value = {}
        for _ in range(rng.randint(0, 6)):
            key = rng.choice(["epoch", "group", "delegate", "size", "weight", "digest", "merged", "included", "time"])
            value[key] = rng.choice(junk + [rng.random(), rng.randint(-5, 5), "a" * rng.randint(0, 100)])
        found = ValueWithExpiration({rng.randbytes(rng.randint(0, 40)): ValueWithExpiration(value, later)}, later)
        assert parse_groups(found) == []  # nothing here is both well formed and signed by its delegate
    assert parse_groups(None) == [] and parse_groups(ValueWithExpiration(b"x", later)) == []
