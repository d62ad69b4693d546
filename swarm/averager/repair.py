"""A reducer's slice that came to us in part (its stream was cut) is fetched again whole from the reducer, and
accepted only as it signed it; otherwise it is dropped whole, read as zeros (``Dropped``), as a vanished reducer's.

So every groupmate applies the same slice, instead of one dropping it alone and leaving the round with another
state than the others'. A liar cannot fail one part to us and have the rest applied unchecked.
"""

from __future__ import annotations

import enum
import logging
import math

from swarm.averager.audit_requests import AuditRequests, _retried
from swarm.averager.audit_serving import AuditRequest, AuditRound
from swarm.averager.bounds import admitted
from swarm.averager.held import Dropped, HeldPart
from swarm.defence.audit import digest_parts

logger = logging.getLogger(__name__)


class RepairFailure(enum.StrEnum):
    """Why a slice that came in part could not be had again whole from its reducer (then it is dropped)."""

    no_receipt = "no_receipt"  # the reducer did not hand over the receipt it signed for the round
    unreachable = "unreachable"  # fetching its average again failed or ran out of time
    not_signed = "not_signed"  # what it served is not the average it signed (part count or digest)
    disagrees = "disagrees"  # a part differs from what it streamed to us the first time
    withheld = "withheld"  # it handed over its signed receipt, then not the average it signed for


# failures of a reducer that is alive (it answered with its receipt) and still kept its signed average from us: a
# strike each, as an audit it would not let us make (``auditing.UNANSWERED_STRIKES`` in a row ban it)
WITHHELD_AVERAGE = frozenset({RepairFailure.withheld, RepairFailure.not_signed, RepairFailure.disagrees})


def slices_to_repair(outputs: dict[str, list], me: str, refused: set[str]) -> list[str]:
    """The reducers whose slice came to us in part, to fetch again whole. Not one whose own parts we refused as
    its reducer (``ExactAllReduceRunner.refused_senders``): its slice was dropped on purpose, and its round, waiting
    for the average we never send it, signs no receipt before our audits' time is out (15 s a round, seen)."""
    return [
        m for m, out in outputs.items() if m != me and m not in refused and any(isinstance(p, Dropped) for p in out)
    ]


def restore_slice(held: list[list[HeldPart]], owner: dict, peer: str, parts: list[HeldPart]) -> int:
    """``peer``'s slice from ``parts`` (in the order it reduced them); the number of values restored."""
    restored = 0
    for (t, j), part in zip([key for key, who in owner.items() if who == peer], parts):
        if isinstance(held[t][j], Dropped):
            restored += held[t][j].numel
        held[t][j] = part
    return restored


def drop_slice(held: list[list[HeldPart]], owner: dict, peer: str) -> int:
    """Every part of ``peer``'s slice read as zeros; the number of values newly dropped."""
    dropped = 0
    for (t, j), who in owner.items():
        if who == peer and not isinstance(held[t][j], Dropped):
            numel = math.prod(held[t][j].size)
            held[t][j] = Dropped(numel)
            dropped += numel
    return dropped


class SliceRepair(AuditRequests):
    async def _repair_slice(self, record: AuditRound, reducer: str, deadline: float) -> list[HeldPart] | RepairFailure:
        """``reducer``'s whole average, fetched again from it when our copy came in part: accepted only if it is
        what the reducer signed in its receipt, which its auditor checked, and agrees with every part we did
        receive. Otherwise, why not."""
        have = record.outputs[reducer]
        numels = [p.numel if isinstance(p, Dropped) else math.prod(p.size) for p in have]
        try:
            receipt, _, _ = await _retried(lambda: self._fetch_receipt(record, reducer), deadline)
        except Exception:
            logger.debug("could not fetch %s's receipt", reducer, exc_info=True)
            return RepairFailure.unreachable
        if receipt is None:
            logger.debug("no receipt from %s to repair its slice with", reducer)
            return RepairFailure.no_receipt
        try:
            limit = 4 * sum(numels) + (1 << 16)
            again = lambda: self._fetch_parts(record, reducer, reducer, limit, AuditRequest.output)  # noqa: E731
            parts = await _retried(again, deadline)
        except Exception:
            logger.debug("could not fetch %s's average again", reducer, exc_info=True)
            return RepairFailure.withheld
        if len(parts) != len(have) or digest_parts(parts) != receipt.output:
            logger.debug("%s's average again: %d parts of %d, digest as signed: %s", reducer, len(parts), len(have),
                         digest_parts(parts) == receipt.output)  # fmt: skip
            return RepairFailure.not_signed
        if not admitted(parts, numels, record.runner.tensor_part_container.compression.compression_type):
            logger.debug("%s's average again: its parts are out of bounds", reducer)
            return RepairFailure.disagrees
        for index, (got, held) in enumerate(zip(parts, have)):
            if not isinstance(held, Dropped) and got.SerializeToString() != held.SerializeToString():
                logger.debug("%s's average again: part %d differs from what we received", reducer, index)
                return RepairFailure.disagrees
        return parts
