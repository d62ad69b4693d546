"""CPU seconds (user + system) of every peer process of a wan run, by role, read once a second until the peers are
gone: ``python3 cpu_by_role.py OUT.json``, started beside ``python -m benchmarks.wan``. By hand, not a benchmark."""

import json
import sys
import time

import psutil


def role(process: psutil.Process) -> str:
    if process.name() == "p2pd":
        return "p2pd"
    parent = process.parent()
    if parent is not None and "client.cli" in " ".join(parent.cmdline()):  # a helper: the DHT runs the p2pd
        return "dht" if any(c.name() == "p2pd" for c in process.children()) else "averager"
    return "trainer"


def peer_processes() -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["cmdline", "name"])
        if p.info["name"] == "p2pd" or "client.cli" in " ".join(p.info["cmdline"] or [])
    ]


def main(out: str) -> None:
    seen: dict[int, dict] = {}
    started_at, started = time.time(), False
    while time.time() - started_at < 900:
        processes = peer_processes()
        if started and not processes:
            break
        started = started or bool(processes)
        for p in processes:
            try:
                times = p.cpu_times()
                seen[p.pid] = dict(role=role(p), cpu=times.user + times.system)
            except psutil.Error as e:  # it ended between the listing and the read: its last reading stands
                print(f"pid {p.pid}: {e!r}", file=sys.stderr)
        time.sleep(1)
    by_role: dict[str, float] = {}
    for entry in seen.values():
        by_role[entry["role"]] = by_role.get(entry["role"], 0.0) + entry["cpu"]
    wall = time.time() - started_at
    with open(out, "w") as f:
        json.dump(dict(by_role=by_role, wall=wall), f, indent=1)
    print(by_role, wall)


if __name__ == "__main__":
    main(sys.argv[1])
