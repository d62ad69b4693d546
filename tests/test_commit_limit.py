"""An all-reduce's time limit never cuts the write of its average into the buffers.

hivemind bounds an all-reduce with ``asyncio.wait_for``. Past the bound it cancels the coroutine, but the write of
the average into the shared buffers runs in an executor thread and went on: the step had failed, and the buffers
then held the average where the host counted on what was there before (a second stage's group average for the next
try, or its own update for a round gone local). ``FixedGroups._within_limit`` gives up an all-reduce only before its
write begins. Here two real averager processes average, in a second stage (a fixed group) and in a first stage
(matchmaking), with a limit of 2 s and a write that takes 3 s."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, os, sys, time
from pathlib import Path
import torch
import swarm.averager.process as process
from swarm.averager.fixed_group import fixed_group_id
from swarm.dht.network import NetworkConfig, start_dht
from swarm.manifest import AveragingSpec

WRITE_SECONDS, LIMIT = 3.0, 2.0
decode_into = process.decode_into
def slow_decode_into(tensor, parts):  # a large model's write on a slow machine (forked into the averager process)
    time.sleep(WRITE_SECONDS)
    decode_into(tensor, parts)
process.decode_into = slow_decode_into

def wait_for(name):
    while not Path(name).exists():
        time.sleep(0.05)
    return json.loads(Path(name).read_text())

def say(name, value):
    Path(name + ".tmp").write_text(json.dumps(value))
    os.replace(name + ".tmp", name)

me = int(sys.argv[1])
initial = [] if me == 0 else wait_for("maddrs")
dht = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0, initial_peers=initial))
if me == 0:
    say("maddrs", [str(a) for a in dht.get_visible_maddrs()])
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
print("RESULT " + json.dumps(dict(second_stage=second_stage, first_stage=first_stage)))
sys.stdout.flush()
os._exit(0)
"""


def test_a_limit_that_comes_while_the_average_is_written_waits_for_the_write(tmp_path):
    peers = [
        subprocess.Popen([sys.executable, "-c", SCRIPT, str(i)], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    results = []
    for peer in peers:
        try:
            out, _ = peer.communicate(timeout=240)
        finally:
            peer.kill()
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, f"no result (exit {peer.returncode}):\n{out[-2000:]}"
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    for stage in ("second_stage", "first_stage"):
        # before: each step failed at the limit (TimeoutError), and its buffers then held the average all the same
        (ok, average), theirs = results[0][stage], results[1][stage]
        assert ok is True and theirs == [True, average], (stage, results)
        assert average not in ([1.0, 2.0, 3.0, 4.0], [3.0, 6.0, 9.0, 12.0]), (stage, results)  # averaged, and kept
