"""The training's CPU priority: lowered for every thread it has and will have, never for the helpers it forked
before, never raised. Run in a fresh interpreter: a lowered pytest worker would slow every later test."""

from __future__ import annotations

import os

from client_helpers import run_script

SCRIPT = r"""
import json, multiprocessing, os, threading, time
from client.priority import lower_priority

def niceness(tid): return os.getpriority(os.PRIO_PROCESS, tid)
def alive(tid):
    try:
        return niceness(tid)
    except ProcessLookupError:  # a thread that ended after it was listed (CI saw one)
        return None
def threads(): return [int(t) for t in os.listdir("/proc/self/task")]
def nicenesses(): return [n for n in map(alive, threads()) if n is not None]

base = niceness(0)
before = threading.Thread(target=time.sleep, args=(30,), daemon=True)
before.start()
helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
helper.start()  # forked before, as the DHT and averager are
changed = lower_priority(base + 10)
later_nice = []
later = threading.Thread(target=lambda: later_nice.append(niceness(threading.get_native_id())), daemon=True)
later.start(); later.join()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
child.start()  # forked after, as a data loader's workers would be
result = dict(
    base=base,
    changed=changed,
    threads=nicenesses(),
    later=later_nice[0],
    helper=niceness(helper.pid),
    child=niceness(child.pid),
    again=lower_priority(base + 5),  # already lower: not raised
    zero=lower_priority(0),
    after=nicenesses(),
)
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
"""


def test_the_training_is_lowered_and_its_helpers_are_not(tmp_path):
    result, _ = run_script(SCRIPT, cwd=tmp_path, timeout=60)
    low = min(result["base"] + 10, 19)
    assert result["changed"] >= 2, result  # the main thread and the one started before
    assert set(result["threads"]) == {low}, result
    assert result["later"] == low and result["child"] == low, result  # inherited
    assert result["helper"] == result["base"], result  # forked before: kept its own
    assert result["again"] == 0 and result["zero"] == 0 and set(result["after"]) == {low}, result
    assert os.getpriority(os.PRIO_PROCESS, 0) == result["base"]  # this test process untouched
