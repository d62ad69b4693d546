"""What a group's members said of themselves in their gathered data (``AllReduceOutcome.gathered``): each one's own
word, sent through the group's leader, so checked here before a round believes it. A string or 2**63 for a
member's samples had failed the round for the whole group (its sum was not a number, or past what a group record
holds), and an epoch that is a list had failed it with the set it was put in."""

from __future__ import annotations

import math
from collections.abc import Mapping


def _count(value: object, whole: bool = True) -> int | None:
    """A count of 0 or more; with ``whole=False`` a finite float too, floored (a volunteer's samples may be one)."""
    if isinstance(value, float) and not whole and math.isfinite(value) and value >= 0:
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def gathered_epochs(gathered: Mapping[str, object]) -> set[int | None]:
    """Each member's epoch; None for a member whose data names none (it is at no epoch of ours)."""
    return {_count(data.get("epoch")) if isinstance(data, dict) else None for data in gathered.values()}


def gathered_samples(gathered: Mapping[str, object], cap: int) -> dict[str, int]:
    """Each member's samples in the round, at most ``cap`` (the samples a round holds, as the all-reduce's weights
    are capped); 0 for a member whose data names no count."""
    samples = {p: _count(d.get("samples"), whole=False) if isinstance(d, dict) else None for p, d in gathered.items()}
    return {peer: min(count, cap) if count is not None else 0 for peer, count in samples.items()}
