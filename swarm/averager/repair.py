"""A reducer's slice that came to us in part (its stream was cut) is fetched again whole from the reducer, and
accepted only as it signed it; otherwise it is dropped whole, read as zeros (``Dropped``), as a vanished reducer's.

So every groupmate applies the same slice, instead of one dropping it alone and leaving the round with another
state than the others'. A liar cannot fail one part to us and have the rest applied unchecked.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import typing

from swarm.averager.allreduce import ExactAllReduceRunner
from swarm.averager.audit_requests import AuditRequests, _retried
from swarm.averager.audit_serving import AuditRequest, AuditRound
from swarm.averager.bounds import admitted
from swarm.averager.findings import Found
from swarm.averager.held import Dropped, HeldPart
from swarm.defence.audit import Verdict
from swarm.defence.receipts import digest_parts

logger = logging.getLogger(__name__)


class RepairFailure(enum.StrEnum):
    """Why a slice that came in part could not be had again whole from its reducer (then it is dropped)."""

    no_receipt = "no_receipt"  # the reducer did not hand over the receipt it signed for the round
    unreachable = "unreachable"  # fetching its average again failed or ran out of time
    not_signed = "not_signed"  # what it served is not the average it signed (part count or digest)
    disagrees = "disagrees"  # a part differs from what it streamed to us the first time
    withheld = "withheld"  # it handed over its signed receipt, then not the average it signed for


# failures of a reducer that is alive (it answered with its receipt) and still kept its signed average from us: a
# strike each, as an audit it would not let us make (``UNANSWERED_STRIKES`` in a row ban it)
UNANSWERED_STRIKES = 2  # audits in a row a reducer left unanswered or withheld its parts in, before a ban
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

    async def _repair_partial_slices(
        self,
        runner: ExactAllReduceRunner,
        record: AuditRound,
        held: list[list[HeldPart]],
        owner: dict,
        deadline: float,
        only: typing.Collection[str] | None = None,
    ) -> tuple[int, list[dict], list[str], list[Found]]:
        """A slice that came in part (its reducer vanished mid-way, or cut its stream to us) is fetched again from
        its reducer and checked against its receipt; failing that it is dropped whole, since a liar could fail one
        part to us and have the rest applied unchecked (then our state differs from the group's, and the
        consistency check re-syncs us). ``only``: those reducers' slices alone. The values dropped (less those
        restored), the failures, the reducers restored, and the strikes of those that kept their average from us."""
        refused = {p.to_base58() for p in runner.refused_senders}
        partial = slices_to_repair(record.outputs, self.peer_id.to_base58(), refused)
        partial = [p for p in partial if only is None or p in only]
        repairs = await asyncio.gather(*(self._repair_slice(record, p, deadline) for p in partial))
        dropped, failures, restored, found = 0, [], [], []
        for peer, parts in zip(partial, repairs):
            if isinstance(parts, RepairFailure):
                dropped += drop_slice(held, owner, peer)
                failures.append(dict(peer=peer, failure=parts.value))
                if parts in WITHHELD_AVERAGE:  # alive (it signed for the round), and kept its average from us
                    strikes = self._strike(peer, Verdict.withheld)
                    found.append((peer, Verdict.withheld, None, False, strikes >= UNANSWERED_STRIKES))
            else:
                dropped -= restore_slice(held, owner, peer, parts)
                record.outputs[peer] = parts
                restored.append(peer)
                logger.debug("the average of %s came in part: fetched again, whole", peer)
        return dropped, failures, restored, found

    async def _tell_unrepaired(self, record: AuditRound, failures: list[dict], deadline: float) -> None:
        """Our verdict on each reducer we audit whose slice came in part and could not be had again: ``withheld``
        if it kept its average from us (each groupmate checks it itself), else ``unanswered``."""
        for failure in failures:
            verdict = Verdict.withheld if failure["failure"] in WITHHELD_AVERAGE else Verdict.unanswered
            await self._tell_group(record, failure["peer"], verdict, [], deadline)
