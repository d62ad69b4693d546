"""An all-reduce's time limit never cuts the write of its average into the buffers.

hivemind bounds an all-reduce with ``asyncio.wait_for``. Past the bound it cancels the coroutine, but the write of
the average into the shared buffers runs in an executor thread and went on: the step had failed, and the buffers
then held the average where the host counted on what was there before (a second stage's group average for the next
try, or its own update for a round gone local). ``FixedGroups._within_limit`` gives up an all-reduce only before its
write begins. Here two real averager processes average, in a second stage (a fixed group) and in a first stage
(matchmaking), with a limit of 2 s and a write that takes 3 s."""

from __future__ import annotations

from peer_scripts import run_peers

SCRIPT = r"""
import torch
import swarm.averager.process as process
from swarm.averager.fixed_group import fixed_group_id
from swarm.manifest import AveragingSpec

WRITE_SECONDS, LIMIT = 3.0, 2.0
decode_into = process.decode_into
def slow_decode_into(tensor, parts):  # a large model's write on a slow machine (forked into the averager process)
    time.sleep(WRITE_SECONDS)
    decode_into(tensor, parts)
process.decode_into = slow_decode_into

mine = [[1.0, 2.0, 3.0, 4.0], [3.0, 6.0, 9.0, 12.0]][me]
options = dict(process.averager_options(AveragingSpec(), 4), audit=False, min_group_size=2, target_group_size=2,
               min_matchmaking_time=1.0, request_timeout=0.5, allreduce_timeout=LIMIT)
averager = process.PseudoGradientAverager([torch.tensor(mine)], dht, run_id="0" * 16, prefix="t", start=True,
                                          **options)
say(f"id{me}", averager.peer_id.to_base58())
ids = [wait_for("id0"), wait_for("id1")]

def outcome(handle):
    try:
        handle.wait()
        ok = True
    except Exception as e:
        ok = repr(e)
    time.sleep(WRITE_SECONDS + 1.0)  # a write cut from its step would land meanwhile
    with averager.get_tensors() as tensors:
        return [ok, tensors[0].tolist()]

members = [(peer, False, dict(epoch=1)) for peer in ids]
second_stage = outcome(averager.start_fixed_averaging(group_id=fixed_group_id("run/1/0", ids), members=members,
                                                      weight=1.0, hard_timeout=60.0))
with averager.get_tensors() as tensors:
    tensors[0].copy_(torch.tensor(mine))
say(f"ready{me}", True)
wait_for(f"ready{1 - me}")
first_stage = outcome(averager.start_averaging(weight=1.0, gather=dict(epoch=2), group_bits=process.epoch_group_bits(2),
                                               timeout=30.0, hard_timeout=60.0))
result(dict(second_stage=second_stage, first_stage=first_stage))
"""


def test_a_limit_that_comes_while_the_average_is_written_waits_for_the_write(tmp_path):
    results = run_peers(SCRIPT, 2, tmp_path)
    for stage in ("second_stage", "first_stage"):
        # before: each step failed at the limit (TimeoutError), and its buffers then held the average all the same
        (ok, average), theirs = results[0][stage], results[1][stage]
        assert ok is True and theirs == [True, average], (stage, results)
        assert average not in ([1.0, 2.0, 3.0, 4.0], [3.0, 6.0, 9.0, 12.0]), (stage, results)  # averaged, and kept
