"""Catching up by replaying the rounds we missed, instead of downloading the whole state.

A peer whose state is the swarm's at its epoch, and that is 1..``averaging.replay_rounds`` epochs behind, fetches
each missed round's average as its group received it (half a byte per parameter with fp4, against eight for the
state) and applies it with the outer step. Each step must give the checksum the swarm holds for it (the
``running_consensus``); anything else and the caller downloads the whole state. An overlapped peer that the
swarm left one round behind adopts that round this way while its next round's inner steps go on (``adopt``).
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Callable, Collection, Sequence

import torch

from swarm.averager.bounds import max_update_bytes
from swarm.averager.codecs import codec
from swarm.averager.held import check_parts, decode_into
from swarm.averager.transfer import DownloadStopped, read_update
from swarm.dht.view import running_consensus
from swarm.events import DownloadFailed, Replayed, ReplayFailed, ReplayStarted, short_reason
from swarm.state.checkpoints import Checkpoints
from swarm.state.context import PeerContext

logger = logging.getLogger(__name__)

REPLAY_DONORS = 3  # donors asked for one round's update before downloading the whole state instead


class ReplayStep(enum.Enum):
    applied = "applied"
    unavailable = "no donor served it"  # nothing changed: another donor, or the full download
    broken = "it did not give the majority's checksum"  # our state moved: only the full download is left


class Replay:
    """``vouched``: the keys whose checksum of an epoch we take without a majority (``running_consensus``)."""

    def __init__(self, ctx: PeerContext, checkpoints: Checkpoints, vouched: Callable[[], Collection[str]]):
        self.ctx, self.checkpoints, self.vouched = ctx, checkpoints, vouched

    def adopt(self, shift: Sequence[torch.Tensor]) -> bool:
        """Overlapped: the swarm finished the round of our epoch without us while our next round's inner steps
        went on. Apply that round's average as its group received it (a one-round replay) and move ``shift``
        (the model, less the stand-in step) by the same change, so those steps are kept and we stay in phase
        with the swarm; a full re-sync would restart them, and by the time they were done the swarm's next
        round would be under way without us again, every round. False when the swarm is not exactly one round
        ahead or no donor served the round: nothing changed. On a ``broken`` replay the outer state moved,
        and so did ``shift``: the caller must re-sync."""
        return self.missed_rounds(shift=shift)

    def missed_rounds(self, shift: Sequence[torch.Tensor] | None = None) -> bool:
        """Catch up by applying the averages of the rounds we missed, as their groups received them, when our
        state is the swarm's at our epoch and we are 1..replay_rounds epochs behind (one, with ``shift``). Each
        step must give the checksum the majority published for it; anything else and the caller downloads the
        whole state."""
        ctx = self.ctx
        view = ctx.reader.view()
        start, target = ctx.outer.epoch, view.global_epoch
        limit = 1 if shift is not None else ctx.manifest.averaging.replay_rounds
        if target is None or not 0 < target - start <= limit:
            return False
        vouched = self.vouched()
        ours = running_consensus(view.peers, start, vouched)
        if ours is None or not ours.agrees(ctx.outer.checksum()):
            return False
        ctx.emit(ReplayStarted(start, target))
        for epoch in range(start, target):
            agreed = running_consensus(view.peers, epoch + 1, vouched)
            if agreed is None:
                return False
            donors = [p.peer_id for p in view.peers if p.peer_id in agreed.holders and not p.client_mode]
            donors = [d for d in donors if d != ctx.me]
            random.shuffle(donors)
            outcome = ReplayStep.unavailable
            for donor in donors[:REPLAY_DONORS]:
                outcome = self._replay_one(donor, epoch, agreed.checksum, shift)
                if outcome != ReplayStep.unavailable:
                    break
            if outcome != ReplayStep.applied:  # unavailable everywhere, or it broke our state: download it all
                ctx.emit(ReplayFailed(epoch, outcome.value))
                return False
        with ctx.shield():
            ctx.outer.reset_residual()
            if shift is None:
                ctx.outer.write_to(ctx.params)
            self.checkpoints.save()
        ctx.emit(Replayed(start, target, kept_steps=shift is not None))
        return True

    def _replay_one(
        self, donor: str, epoch: int, expected: str, shift: Sequence[torch.Tensor] | None = None
    ) -> ReplayStep:
        ctx = self.ctx
        avg = ctx.manifest.averaging
        destination = self.checkpoints.store.temporary_path(f"update-{epoch}-{donor[-8:]}")
        try:
            try:
                ctx.averager.download_update(
                    donor,
                    epoch,
                    destination,
                    max_bytes=max_update_bytes(codec(avg.compression).compression_type, ctx.outer.numels),
                    chunk_timeout=avg.chunk_timeout,
                    min_rate=avg.min_rate,
                    timeout=avg.update_timeout(ctx.outer.numel),
                    should_stop=ctx.stop_requested,
                )
                held = read_update(destination, ctx.manifest.run_id, epoch, len(ctx.outer.params))
                with ctx.averager.get_tensors() as buffers:
                    for tensor, parts in zip(buffers, held):
                        check_parts(tensor, parts, codec(ctx.manifest.averaging.compression).compression_type)
            except DownloadStopped:
                return ReplayStep.broken  # leaving: no more donors
            except Exception as e:
                logger.debug("update %d from %s unusable", epoch, donor, exc_info=True)
                ctx.emit(DownloadFailed(donor, f"update of epoch {epoch}: {short_reason(e)}"))
                return ReplayStep.unavailable
            with ctx.shield(), ctx.averager.get_tensors() as buffers:
                for tensor, parts in zip(buffers, held):
                    decode_into(tensor, parts)
                ctx.outer.step(buffers, shift=shift)
            return ReplayStep.applied if ctx.outer.checksum() == expected else ReplayStep.broken
        finally:
            destination.unlink(missing_ok=True)
