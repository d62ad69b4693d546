"""Reading what the byzantine benchmark's peers leave behind: their jsonl records, logs, bans and results."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

_LOADED = re.compile(r"state of epoch (?P<epoch>\d+) \(checksum (?P<checksum>\w+)\) loaded from (?P<donor>\w+)")


def _joiner(index: int, workdir: Path, exit_code: int | None, liar: str | None, honest_peers: int) -> dict:
    """What a late joiner loaded, and from whom. It downloads the state, or (within ``averaging.replay_rounds`` of
    its own epoch) replays the rounds it missed, each checked against the swarm's checksum. ``honest_state``: every
    state it downloaded is one an honest peer held at that epoch (its checksum after a round of that epoch); for a
    replay, its state after its first round is (``first_round_held``, also given for downloads: a joiner whose
    first round formed a group of its own differs without having loaded anything wrong); ``refused_liar``: the
    liar's bad states it refused."""
    events = [r for r in _records(workdir / f"peer{index}.jsonl") if r.get("type") == "event"]
    loaded = [m.groupdict() for e in events if (m := _LOADED.search(e.get("message", "")))]
    replayed = sum(1 for e in events if e.get("message", "").startswith("caught up to epoch"))
    held = {
        (r["epoch"], r["checksum"][:8]) for i in range(honest_peers) for r in _rounds(workdir / f"peer{i}.jsonl")
        if r.get("checksum")
    }  # fmt: skip
    first = next((r for r in _rounds(workdir / f"peer{index}.jsonl") if r.get("checksum")), None)
    return dict(
        peer=index,
        exit=exit_code,
        loaded=loaded,
        replayed=replayed,
        first_round_held=first is not None and (first["epoch"], first["checksum"][:8]) in held,
        # a download is checked by what it loaded; a replay (no checksum said) by the round after it
        honest_state=all((int(x["epoch"]), x["checksum"]) in held for x in loaded)
        if loaded
        else bool(replayed) and first is not None and (first["epoch"], first["checksum"][:8]) in held,
        from_liar=sum(1 for x in loaded if liar and liar.endswith(x["donor"])),
        refused_liar=sum(1 for e in events if e.get("kind") == "bad_donor" and liar and liar[-8:] in e["message"]),
    )


def _joiners(joiners: list[dict]) -> str:
    """'loaded an honest state / of joiners, refused the liar's N times' ('-' without late joiners)."""
    if not joiners:
        return "-"
    ok = sum(1 for j in joiners if j["honest_state"] and j["exit"] == 0)
    return f"{ok}/{len(joiners)}, refused {sum(j['refused_liar'] for j in joiners)}"


def _epoch(path: Path) -> int:
    return max((r["epoch"] for r in _rounds(path)), default=0)


def _lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines() if log.exists() else []


def _read(path: Path) -> list:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written as we read
            continue
    return out


def _rounds(path: Path) -> list[dict]:
    return [r for r in _records(path) if r.get("type") == "round"]


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def _peer_id(log: Path) -> str | None:
    found = re.search(r"Peer (Qm\w+) on ", log.read_text()) if log.exists() else None
    return found.group(1) if found else None
