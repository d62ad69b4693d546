"""`swarm-client status`: the swarm view for someone who trains nothing (an operator, a script)."""

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
        telemetry = Telemetry()
        watch = SwarmWatch(observer.entries, observer.manifest, telemetry, announce_epochs=True)
        watch.poll()
        parameters = manifest_parameters(observer.manifest)
        source = DashboardSource(
            manifest=observer.manifest,
            parameters=lambda: parameters,
            telemetry=telemetry,
            watch=watch,
            title="swarm-client status",
        )
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


def _first_entries(observer: Observer) -> list:
    deadline = time.monotonic() + FIRST_READ_TIMEOUT
    entries = observer.entries()
    while not entries and time.monotonic() < deadline:
        time.sleep(0.5)
        entries = observer.entries()
    return entries
