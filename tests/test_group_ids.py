"""A group's id binds what its leader told each member (``swarm.hivemind_fixes.group_ids``, and
``fixed_group.fixed_group_id`` for a second stage): a leader that tells two followers different layouts under one id
no longer makes honest groupmates refuse each other's parts as the wrong size and ban each other."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from peer_scripts import run_peers

from swarm.averager.fixed_group import fixed_group_id
from swarm.hivemind_fixes.group_ids import SALT, binds, bound_group_id

MEMBERS = [b"\x12\x20" + bytes([i]) * 32 for i in range(3)]
GATHERED = [b"\x93\xcb?\xf0\x00\x00\x00\x00\x00\x00\x00\xc4\x00" + bytes([i]) for i in range(3)]


def test_an_id_binds_its_members_their_order_and_their_data():
    group_id = bound_group_id(b"s" * SALT, MEMBERS, GATHERED)
    assert binds(group_id, MEMBERS, GATHERED) and len(group_id) == SALT + 20
    assert not binds(group_id, MEMBERS[::-1], GATHERED[::-1])  # another order: other slices
    assert not binds(group_id, MEMBERS[:2], GATHERED[:2])  # another group
    assert not binds(group_id, MEMBERS, [GATHERED[0], GATHERED[1] + b"\x00", GATHERED[2]])  # another bandwidth
    assert not binds(group_id[:20], MEMBERS, GATHERED)  # hivemind's random 20 bytes
    assert not binds(group_id, MEMBERS, GATHERED[:2])
    assert bound_group_id(b"t" * SALT, MEMBERS, GATHERED) != group_id  # each group its own id


_layouts = st.integers(1, 5).flatmap(
    lambda n: st.tuples(st.lists(st.binary(min_size=1, max_size=40), min_size=n, max_size=n, unique=True),
                        st.lists(st.binary(max_size=40), min_size=n, max_size=n))
)  # fmt: skip


@given(_layouts, st.binary(min_size=SALT, max_size=SALT), st.data())
def test_any_change_to_what_a_leader_sent_breaks_its_id(layout, salt, data):
    """A follower told another member, order, or gathered byte than the id was made of finds it does not bind."""
    members, gathered = layout
    group_id = bound_group_id(salt, members, gathered)
    assert binds(group_id, members, gathered)
    change = data.draw(st.sampled_from(["drop", "swap", "byte", "id"]))
    i = data.draw(st.integers(0, len(members) - 1))
    members, gathered = list(members), list(gathered)
    if change == "drop":
        del members[i], gathered[i]
    elif change == "swap":  # (with one member: nothing to swap, and it still binds)
        j = (i + 1) % len(members)
        members[i], members[j], gathered[i], gathered[j] = members[j], members[i], gathered[j], gathered[i]
    elif change == "byte":
        gathered[i] = gathered[i] + b"\x00"
    else:
        group_id = group_id[:-1] + bytes([group_id[-1] ^ 1])
    assert binds(group_id, members, gathered) == (change == "swap" and len(members) == 1)


def test_a_second_stage_id_binds_each_delegates_mode_and_data():
    members = [("a", False, dict(epoch=3, samples=10, group="g1")), ("b", False, dict(epoch=3, samples=20, group="g2"))]
    assert fixed_group_id("run/3/merge/w/0", members) == fixed_group_id("run/3/merge/w/0", members[::-1])
    flipped = [("a", True, members[0][2]), members[1]]  # a record that said client mode to some readers
    heavier = [("a", False, dict(members[0][2], samples=11)), members[1]]
    ids = {fixed_group_id("run/3/merge/w/0", m) for m in (members, flipped, heavier)}
    assert len(ids) == 3


SCRIPT = r"""
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
import swarm.averager.process as process
from swarm.manifest import AveragingSpec

join, told = Matchmaking.rpc_join_group, set()
async def lying_join(self, request, context):  # as a leader: the first follower told is told we are a client
    async for message in join(self, request, context):
        if message.code == averaging_pb2.BEGIN_ALLREDUCE and message.group_id not in told:
            told.add(message.group_id)
            gathered = list(message.gathered)
            i = list(message.ordered_peer_ids).index(self.peer_id.to_bytes())
            bandwidth, mode, data = MSGPackSerializer.loads(gathered[i])
            gathered[i] = MSGPackSerializer.dumps([0.0, AveragingMode.CLIENT.value, data])  # we reduce nothing
            message = averaging_pb2.MessageFromLeader(code=message.code, group_id=message.group_id,
                ordered_peer_ids=message.ordered_peer_ids, gathered=gathered)
        yield message
Matchmaking.rpc_join_group = lying_join  # every peer lies when it leads: whoever leads, two honest followers

options = dict(process.averager_options(AveragingSpec(), 4), min_group_size=2, target_group_size=3,
               min_matchmaking_time=3.0, request_timeout=1.0, allreduce_timeout=30.0)
averager = process.PseudoGradientAverager([torch.arange(1 << 20, dtype=torch.float32) * (me + 1)], dht,
                                          run_id="0" * 16, prefix="t", start=True, **options)
say(f"id{me}", averager.peer_id.to_base58())
for i in range(3):
    wait_for(f"id{i}")
try:
    handle = averager.start_averaging(weight=1.0, gather=dict(epoch=1), group_bits=process.epoch_group_bits(1),
                                      timeout=20.0, hard_timeout=60.0)
    outcome = handle.wait()
    findings = [[f["peer"], f["verdict"], f["banned"]] for f in outcome.findings]
    outcome = dict(group=list(outcome.group), findings=findings)
except Exception as e:
    outcome = dict(error=repr(e))
outcome["me"] = averager.peer_id.to_base58()
result(outcome)
"""


def test_a_leader_that_tells_a_follower_another_layout_gets_no_honest_groupmate_banned(tmp_path):
    """Three real averager processes; whichever leads tells the first follower it tells that the leader is a client
    (reduces nothing), and the others that it is not. Before, that follower cut its parts elsewhere, and an honest
    groupmate refused them as the wrong size and banned it ("sent malformed parts", checked). Now it does not take
    that group, and nobody is banned."""
    results = run_peers(SCRIPT, 3, tmp_path)
    banned = [(r["me"], f) for r in results for f in r.get("findings", []) if f[2]]
    assert banned == [], results
    grouped = [r for r in results if "group" in r]
    assert any(len(r["group"]) >= 2 for r in grouped), results  # the round went on for the others
