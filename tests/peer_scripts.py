"""Tests that run several real peers as separate Python processes, each one script: how the scripts meet (files in
their shared working folder, written whole), and how their results come back (a ``RESULT`` line of JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# the start of every such script: helpers to wait for and say a value, ``me`` (the script's index), and this
# process's DHT, joined to the first script's
RENDEZVOUS = r"""
import json, os, sys, time
from pathlib import Path
from swarm.dht.network import NetworkConfig, start_dht

def wait_for(name):
    while not Path(name).exists():
        time.sleep(0.05)
    return json.loads(Path(name).read_text())

def say(name, value):
    Path(name + ".tmp").write_text(json.dumps(value))
    os.replace(name + ".tmp", name)

def result(value):
    print("RESULT " + json.dumps(value))
    sys.stdout.flush()
    os._exit(0)

me = int(sys.argv[1])
initial = [] if me == 0 else wait_for("maddrs")
dht = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0, initial_peers=initial))
if me == 0:
    say("maddrs", [str(a) for a in dht.get_visible_maddrs()])
"""


def run_peers(script: str, count: int, folder: Path, timeout: float = 240) -> list[dict]:
    """``RENDEZVOUS + script`` in ``count`` processes in ``folder``; each one's ``result``, in order."""
    code = RENDEZVOUS + script
    peers = [
        subprocess.Popen([sys.executable, "-c", code, str(i)], cwd=folder, stdout=subprocess.PIPE, text=True)
        for i in range(count)
    ]
    results = []
    for peer in peers:
        try:
            out, _ = peer.communicate(timeout=timeout)
        finally:
            peer.kill()
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, f"no result (exit {peer.returncode}):\n{out[-2000:]}"
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results
