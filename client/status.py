"""`swarm-client status`: the swarm view for someone who trains nothing (an operator, a script).

Bounded whatever the run's size: the printed view is the dashboard's (a summary line and at most
``client.dashboard.MAX_ROWS`` peer rows past that many peers), and ``--json`` prints
``swarm.observer.snapshot``, capped lists and counts of every peer, under 64 KiB."""

from __future__ import annotations

import json
import time

from rich.console import Console

from client.dashboard import DashboardSource, LiveDashboard, render
from client.model import manifest_parameters
from client.swarm_watch import SwarmWatch
from client.telemetry import Telemetry
from swarm import NetworkConfig
from swarm.observer import Observer, snapshot

FIRST_READ_TIMEOUT = 5.0  # a node that just joined may need a moment to find the records


def run_status(network: NetworkConfig, run_id: str | None, *, as_json: bool, live: bool) -> int:
    observer = Observer.connect(network, run_id)
    try:
        entries = _first_entries(observer)
        if as_json:
            print(json.dumps(snapshot(observer.manifest, entries), indent=2))
            return 0
        source = observer_dashboard(observer, Telemetry(), "swarm-client status")
        watch = source.watch
        watch.poll()
        if not live:
            Console(width=160).print(render(source))
            return 0
        watch.start()
        try:
            with LiveDashboard(source):
                while True:
                    time.sleep(0.5)
        except KeyboardInterrupt:
            return 0
        finally:
            watch.stop()
    finally:
        observer.close()


def observer_dashboard(observer: Observer, telemetry: Telemetry, title: str) -> DashboardSource:
    """The dashboard of someone who trains nothing: header, peers and events, no "this peer" panel."""
    watch = SwarmWatch(observer.entries, observer.manifest, telemetry, announce_epochs=True)
    parameters = manifest_parameters(observer.manifest)  # before the first read, so the view is fresh
    return DashboardSource(observer.manifest, lambda: parameters, telemetry, watch, title=title)


def _first_entries(observer: Observer) -> list:
    deadline = time.monotonic() + FIRST_READ_TIMEOUT
    entries = observer.entries()
    while not entries and time.monotonic() < deadline:
        time.sleep(0.5)
        entries = observer.entries()
    return entries
