"""The line a volunteer reads after each outer round: what it did, what it cost, and how late it landed."""

from __future__ import annotations

from swarm import RoundOutcome, RoundReport


def how_it_went(report: RoundReport, group: str = "averaged with {} peers") -> str:
    """What the round applied: the group's average; or, when not ours, why (a round that took the swarm's average
    of the other groups says so: it has no fallback reason)."""
    if report.averaged:
        return group.format(report.group_size)
    if report.fallback_reason:
        return f"local ({report.fallback_reason})"
    if report.outcome == RoundOutcome.adopted:
        return "the swarm's average without ours"
    return "local"


def round_line(report: RoundReport, inner_steps: int) -> tuple[str, str]:
    """(kind, line): ``round`` for an averaged round, ``fallback`` for a local one."""
    s = report.seconds
    how = how_it_went(report)
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
