"""The line a volunteer reads after each outer round: what it did, what it cost, and how late it landed."""

from __future__ import annotations

from swarm import RoundReport


def round_line(report: RoundReport, inner_steps: int) -> tuple[str, str]:
    """(kind, line): ``round`` for an averaged round, ``fallback`` for a local one."""
    s = report.seconds
    how = f"averaged with {report.group_size} peers" if report.averaged else f"local ({report.fallback_reason})"
    audits = f"(audits {s['audit']:.1f}s) " if s.get("audit", 0) > 0 else ""  # checked reducers, within it
    late = f"landed {report.steps_late}/{inner_steps} steps late " if report.steps_late is not None else ""
    return (
        "round" if report.averaged else "fallback",
        f"round -> epoch {report.epoch}: {how}{', re-synced' if report.resynced else ''}; "
        f"compute {s.get('compute', 0):.1f}s matchmaking {s.get('matchmaking', 0):.1f}s "
        f"all-reduce {s.get('allreduce', 0):.1f}s {audits}outer {s.get('outer', 0):.2f}s "
        f"sent {report.bytes_sent / 1e6:.2f}MB received {report.bytes_received / 1e6:.2f}MB "
        f"{late}checksum {report.checksum[:10]}",
    )
