"""Where an averaged round's time goes after a peer hands over its pseudo-gradient, from a wan run's rounds.

Each averaged round's record says, per peer, the seconds from hand-over to the all-reduce's start (``matchmaking``),
the all-reduce timed in the averager process where it ran (``allreduce``, audits included), and the time until the
host took the average (``landing``: an overlapped host looks once per inner step), and when it was reported (one
wall clock for all peers of the lab). So each peer's hand-over time is known, and the matchmaking splits in two:

- **waiting**: from this peer's hand-over to the last groupmate's (the peers are out of phase);
- **protocol**: from the last groupmate's hand-over to the all-reduce's start (DHT reads, join requests).

Each epoch is taken to be one group (the wan benchmark's ``target_group_size`` is its number of peers). The time
between a round's outer step and its report (publishing the new state, milliseconds) is not subtracted: it shifts
every peer's hand-over alike, and the waiting is a difference between them.

``python -m benchmarks.lag_split WAN_JSON`` prints the mean of each part per mode and link, with the mean lag in
inner steps, and writes ``lag_split.json`` beside the wan run's file. Runs before 2026-11-27 (no ``landing``, no
``time`` per round, the all-reduce timed by the host) cannot be split.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.common import print_table, rate_label

NAME = "lag_split"
PARTS = ("waiting", "protocol", "allreduce", "landing")


def split(rows: list[dict]) -> dict:
    """The mean of each part over the averaged rounds of one phase (``rows``: every peer's rounds), with how many
    peer-rounds it covers and the mean steps late (overlapped rounds only)."""
    by_epoch: dict[int, list[dict]] = {}
    for r in rows:
        if r["averaged"] and r["group_size"] > 1:
            s = r["seconds"]
            ready = r["time"] - s["outer"] - s.get("consistency", 0.0) - s["landing"]
            started = ready - s["allreduce"]
            by_epoch.setdefault(r["epoch"], []).append(dict(row=r, started=started, handed=started - s["matchmaking"]))
    parts: dict[str, list[float]] = {k: [] for k in PARTS}
    late = []
    for group in by_epoch.values():
        last = max(g["handed"] for g in group)
        for g in group:
            parts["waiting"].append(last - g["handed"])
            parts["protocol"].append(max(0.0, g["started"] - last))
            parts["allreduce"].append(g["row"]["seconds"]["allreduce"])
            parts["landing"].append(g["row"]["seconds"]["landing"])
            if g["row"].get("steps_late") is not None:
                late.append(g["row"]["steps_late"])
    count = len(parts["allreduce"])
    means = {k: statistics.fmean(v) if v else None for k, v in parts.items()}
    return dict(rounds=count, seconds=means, steps_late=statistics.fmean(late) if late else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lag_split", description=__doc__.split("\n")[0])
    p.add_argument("wan_json", type=Path)
    args = p.parse_args(argv)
    record = json.loads(args.wan_json.read_text())
    out: dict[str, list[dict]] = {}
    rows = []
    for mode, phases in record["rounds"].items():
        for ph in phases:
            result = dict(rate_mbit=ph["rate_mbit"], **split([r for rs in ph["peers"].values() for r in rs]))
            out.setdefault(mode, []).append(result)
            s = result["seconds"]
            rows.append(
                (
                    mode,
                    rate_label(ph["rate_mbit"]),
                    result["rounds"],
                    *("-" if s[k] is None else f"{s[k]:.2f}" for k in PARTS),
                    "-" if result["steps_late"] is None else f"{result['steps_late']:.2f}",
                )
            )
    print_table(
        "seconds from hand-over, mean over averaged peer-rounds", ["wire", "Mbit/s", "n", *PARTS, "steps late"], rows
    )
    path = args.wan_json.with_name(f"{NAME}.json")
    path.write_text(json.dumps(dict(source=args.wan_json.name, split=out), indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
