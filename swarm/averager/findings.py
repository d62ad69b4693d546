"""What one round's audits found about each groupmate, as the averager hands it to the host (``auditing``)."""

from __future__ import annotations

from swarm.defence.audit import GUILTY, Verdict

# what one round's audits found about one groupmate: (peer, verdict, the liar's receipt or proof, drop, ban it)
Found = tuple[str, Verdict | str, bytes | None, bool, bool]


def one_a_peer(found: list[Found]) -> list[Found]:
    """One finding a groupmate, in the order first found: of several (its audit's verdict, then the split averages its
    signatures prove, or a repair's strike), a proven lie's first, else one that bans, else the first; it drops the
    slice if any of them does. Each finding becomes an accusation, and a record keeps only a few of them."""
    by_peer: dict[str, list[Found]] = {}
    for item in found:
        by_peer.setdefault(item[0], []).append(item)

    def rank(item: Found) -> tuple[bool, bool]:
        return item[1] in GUILTY and item[2] is not None, item[4]

    kept = []
    for items in by_peer.values():
        best = max(items, key=rank)  # max keeps the first of equals
        kept.append((*best[:3], any(item[3] for item in items), best[4]))
    return kept
