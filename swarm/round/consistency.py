"""Did our groupmates end a round on our state? The checks after an outer round (``swarm.round.pipeline``).

A blocking round waits briefly for its groupmates' checksums of the new epoch and re-syncs if the majority
holds another state. An overlapped round leaves that to the next round's begin, so that training goes on; a
peer that ends its run after a round checks it before leaving (``check_unchecked``), and keeps its averager
up for the groupmates still auditing or repairing that round (``serve_last_round``). The rules read the swarm
view (``swarm.dht.view``); what is here is when to wait for them, and how long.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from swarm.dht.view import Resync, groupmates_published, mates_finishing, still_merging
from swarm.events import RoundOutcome, RoundReport
from swarm.state.context import PeerContext


class RoundChecks:
    """``resync_needed(epoch)`` says why our state at ``epoch`` is not the swarm's; ``resync(why)`` takes the swarm's
    instead, and says whether it could (the round's, ``OuterRound``)."""

    def __init__(self, ctx: PeerContext, resync_needed: Callable[[int], Resync | None], resync: Callable[[str], bool]):
        self.ctx, self._resync_needed, self._resync = ctx, resync_needed, resync
        # the last finished round and its group, until its consistency is checked (at the next begin)
        self.unchecked: tuple[RoundReport, tuple[str, ...]] | None = None
        # the last round we averaged in: (epoch, group, when it ended); its groupmates' audits and repairs fetch
        # from our averager for a while after it (``serve_last_round``)
        self.last_group: tuple[int, tuple[str, ...], float] | None = None

    def after_round(self, report: RoundReport, group: tuple[str, ...], averaged: bool, overlapped: bool) -> None:
        """A round just finished: checked now (blocking) or left to the next round's begin (overlapped)."""
        if averaged and len(group) > 1:
            self.last_group = (report.epoch, group, time.monotonic())
        if overlapped:
            self.unchecked = (report, group)
        else:
            self.check(report, group)
            if report.outcome == RoundOutcome.local:  # checked against nobody: a peer that ends its run here
                self.unchecked = (report, group)  # checks again

    def before_next_round(self, epoch: int) -> None:
        """At the next round's begin, before its late re-check of ``epoch``: the groupmates landed with us but
        may not have published yet; seeing only our own checksum, two diverged peers would each find no majority
        against it and average on from two states for good."""
        unchecked, self.unchecked = self.unchecked, None
        if unchecked is not None and unchecked[0].epoch == epoch:
            self.await_checksums(unchecked[1], epoch)

    def check_unchecked(self) -> RoundReport | None:
        """The consistency check an overlapped round left to the next round's begin, now: for a peer that ends
        its run after that round (``--max-epochs``), whose last state would otherwise never be compared with its
        group's. A last round that found no group (local) is checked again too, against the peers that were
        still finishing that round: checked at once, against nobody, while the others were still averaging it,
        it left on a state of its own (the likely story of a CI run that ended with one peer's checksum apart,
        its log ending on "could not find a group"). The report of that round (``resynced`` set if it
        re-synced), or None if nothing was left."""
        if self.unchecked is None:
            return None
        (report, group), self.unchecked = self.unchecked, None
        if report.resynced or report.epoch != self.ctx.outer.epoch:  # a re-sync or a replay moved the state on
            return None
        if report.outcome == RoundOutcome.local:
            group = (*group, *mates_finishing(self.ctx.reader.view(), self.ctx.me, report.epoch))
        self.check(report, group)
        return report

    def check(self, report: RoundReport, group: Sequence[str]) -> None:
        """Wait (briefly) for the groupmates' checksums of the new epoch, then re-sync if the majority holds
        another state."""
        outer = self.ctx.outer
        t2 = time.monotonic()
        epoch = outer.epoch
        self.await_checksums(group, epoch)
        why = self._resync_needed(epoch)
        if why is not None:
            report.resynced = self._resync(f"after the round: {why}")
            report.resync_reason = why.reason if report.resynced else None
            report.checksum = outer.checksum()
            report.epoch = outer.epoch
        report.seconds["consistency"] = time.monotonic() - t2

    def serve_last_round(self, until: float) -> None:
        """Before a peer that leaves after a round stops its averager: until that round's groupmates published
        their checksums (their audits and repairs, which fetch from our averager, are done), within the round's
        audit window and ``until``. Without it a groupmate whose copy of our slice came in part found us gone and
        dropped the slice, then held another state than the group's (seen in the byzantine benchmark)."""
        if self.last_group is not None:
            epoch, group, ended = self.last_group
            window = min(until, ended + self.ctx.manifest.averaging.allreduce_timeout)
            self.await_checksums(group, epoch, window, until_stopped=True)  # a stop signal leaves at once
            # two-stage rounds: peers of other groups still merging that round may fetch its average from us
            while time.monotonic() < window and not self.ctx.stop_requested():
                if not still_merging(self.ctx.reader.view(), epoch - 1, self.ctx.me):
                    break
                time.sleep(0.2)

    def await_checksums(
        self, group: Sequence[str], epoch: int, deadline: float | None = None, until_stopped: bool = False
    ) -> None:
        """Until every groupmate still here published its checksum for ``epoch``, or consistency_timeout."""
        ctx = self.ctx
        if deadline is None:
            deadline = time.monotonic() + ctx.manifest.averaging.consistency_timeout
        mates = [m for m in group if m != ctx.me]  # their buckets are read each time (a large run's view samples)
        while time.monotonic() < deadline and not groupmates_published(ctx.reader.view(mates), group, ctx.me, epoch):
            if until_stopped and ctx.stop_requested():
                return
            time.sleep(0.2)
