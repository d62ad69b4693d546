"""Getting the swarm's state: on joining, when behind, after a disagreement, and from our own checkpoint.

Every state that did not come out of our own outer step arrives as a file and is
checked before anything is loaded from it: the header's run and shapes, the
parameters' sha256 against what the majority of peers published for that epoch,
and the momentum's CRC32. Only then is it read into the outer state, and the file
becomes our newest checkpoint as it is.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from swarm.averager.allreduce import check_parts, decode_into
from swarm.averager.transfer import DownloadStopped, read_update
from swarm.dht.records import PeerState
from swarm.dht.view import Resync, SwarmView, consensus, resync_needed
from swarm.errors import LeaveRequested, StateDownloadError
from swarm.events import PeerEvent, short_reason
from swarm.state import file as state_file
from swarm.state.file import StateFileError
from swarm.state.store import residual_path

if TYPE_CHECKING:
    from swarm.peer import Peer

logger = logging.getLogger(__name__)

DOWNLOAD_ATTEMPTS = 3
REPLAY_DONORS = 3  # donors asked for one round's update before downloading the whole state instead


class ReplayStep(enum.Enum):
    applied = "applied"
    unavailable = "no donor served it"  # nothing changed: another donor, or the full download
    broken = "it did not give the majority's checksum"  # our state moved: only the full download is left


MIN_DEFERRED_DOWNLOAD = 2.0  # seconds: a download this quick never waits for the swarm's round to end
VIEW_WAIT = 3.0  # records of other peers can take this long to reach a node that just joined


class StateSync:
    def __init__(self, peer: Peer):
        self.peer = peer
        self._download_rate: float | None = None  # bytes/s of our last state download

    # ---- our own checkpoint ---------------------------------------------------------------------

    def load_file(self, path: Path) -> bool:
        """Load one of our state files (a checkpoint found at start); False, with an event, if it is unusable."""
        peer = self.peer
        try:
            header = state_file.check(path, run_id=peer.run_id, shapes=peer.outer.shapes)
        except StateFileError as e:
            peer.emit(PeerEvent.checkpoint_unusable, dict(path=str(path), reason=str(e)))
            return False
        with peer.shield():
            peer.outer.load_file(path, header)
            if peer.outer.residual is not None:  # what we had not sent yet, if it was saved with this state
                state_file.load_residual(
                    residual_path(path), run_id=peer.run_id, checksum=header.checksum, residual=peer.outer.residual
                )
            peer.outer.write_to(peer.params)
            peer.averager.note_epoch(header.epoch)
            peer.store.use_existing(path, header)
        return True

    # ---- joining --------------------------------------------------------------------------------

    def catch_up(self, resumed: bool) -> None:
        """Download the state from the swarm if anyone is training; otherwise start from the seed or checkpoint."""
        peer = self.peer
        view = self._wait_for_view()
        others = [p for p in view.peers if p.peer_id != peer.peer_id and p.latest_checksum is not None]
        if not others:
            reason = "resumed from checkpoint" if resumed else "first peer of the run: weights from the manifest seed"
            peer.emit(PeerEvent.initialized, dict(epoch=peer.epoch, reason=reason))
            if not resumed:
                peer.checkpoints.save()
            return
        agreed = consensus(view.peers, view.global_epoch) if view.global_epoch is not None else None
        if resumed and agreed is not None and agreed.epoch == peer.epoch and agreed.agrees(peer.outer.checksum()):
            peer.emit(PeerEvent.initialized, dict(epoch=peer.epoch, reason="checkpoint agrees with the swarm"))
            return
        peer.set_state(PeerState.downloading_state, publish=True)
        if not self.download_consensus_state():
            if peer.stop_requested:
                raise LeaveRequested("asked to leave while downloading the state")
            raise StateDownloadError(
                f"{len(others)} peers of run {peer.run_id} are training, but none of them served a verified copy "
                "of the training state. Check that this machine can reach them (firewall, --client-mode), then "
                "start again."
            )

    def _wait_for_view(self) -> SwarmView:
        peer = self.peer
        view = peer.view()
        if peer.dht.initial_peers:
            deadline = time.monotonic() + VIEW_WAIT
            while time.monotonic() < deadline and not any(p.peer_id != peer.peer_id for p in view.peers):
                time.sleep(0.5)
                view = peer.view()
        return view

    # ---- staying consistent --------------------------------------------------------------------

    def resync_needed(self, epoch: int) -> Resync | None:
        """Why we must take the swarm's state at ``epoch``, or None (``swarm_view.resync_needed``)."""
        peer = self.peer
        mine = peer.outer.checksum() if peer.outer.epoch == epoch else None
        return resync_needed(peer.view(), peer.peer_id, epoch, mine, peer.last_round_local)

    def resync(self, why: str) -> bool:
        peer = self.peer
        peer.set_state(PeerState.resyncing, publish=True)
        peer.emit(PeerEvent.resync, dict(reason=why, epoch=peer.epoch))
        ok = self.download_consensus_state()
        if ok:
            peer.stats.resyncs += 1
            peer.last_round_local = False
        peer.outer.write_to(peer.params)  # whatever happened, the model restarts from the global copy
        peer.begin_round()
        peer.checkpoints.announce()
        peer.set_state(PeerState.training, publish=True)
        return ok

    # ---- downloading ---------------------------------------------------------------------------

    def download_consensus_state(self) -> bool:
        """Fetch the state held by most peers at the global epoch from one of them, verified by its hash."""
        peer = self.peer
        avg = peer.manifest.averaging
        # nobody should copy a state we are replacing; checkpoints.announce offers ours again afterwards
        peer.averager.allow_state_sharing = False
        if self._replay():
            return True
        for attempt in range(DOWNLOAD_ATTEMPTS):
            if peer.stop_requested:
                return False
            view = self._view_after_round_if_download_is_too_slow()
            if view.global_epoch is None:
                return False
            agreed = consensus(view.peers, view.global_epoch)
            if agreed is None:
                time.sleep(1.0)
                continue
            donors = [
                p.peer_id
                for p in view.peers
                if p.peer_id in agreed.holders and p.peer_id != peer.peer_id and not p.client_mode
            ]
            if not donors:
                return agreed.agrees(peer.outer.checksum()) and peer.outer.epoch == agreed.epoch
            random.shuffle(donors)  # spread joiners over donors
            for donor in donors:
                if peer.stop_requested:
                    return False
                if self._download_from(donor, avg.chunk_timeout, avg.allreduce_timeout):
                    return True
            time.sleep(min(5.0, 1.0 * (attempt + 1)))
        return False

    # ---- replaying the rounds we missed ---------------------------------------------------------

    def adopt_round(self, shift: Sequence[torch.Tensor]) -> bool:
        """Overlapped: the swarm finished the round of our epoch without us while our next round's inner steps
        went on. Apply that round's average as its group received it (a one-round replay) and move ``shift``
        (the model, less the stand-in step) by the same change, so those steps are kept and we stay in phase
        with the swarm; a full re-sync would restart them, and by the time they were done the swarm's next
        round would be under way without us again, every round. False when the swarm is not exactly one round
        ahead or no donor served the round: nothing changed. On a ``broken`` replay the outer state moved,
        and so did ``shift``: the caller must re-sync."""
        return self._replay(shift=shift)

    def _replay(self, shift: Sequence[torch.Tensor] | None = None) -> bool:
        """Catch up by applying the averages of the rounds we missed, as their groups received them, when our
        state is the swarm's at our epoch and we are 1..replay_rounds epochs behind (one, with ``shift``). Each
        step must give the checksum the majority published for it; anything else and the caller downloads the
        whole state."""
        peer = self.peer
        view = peer.view()
        start, target = peer.outer.epoch, view.global_epoch
        limit = 1 if shift is not None else peer.manifest.averaging.replay_rounds
        if target is None or not 0 < target - start <= limit:
            return False
        ours = consensus(view.peers, start)
        if ours is None or not ours.agrees(peer.outer.checksum()):
            return False
        peer.emit(PeerEvent.replay_started, dict(epoch=start, target=target))
        for epoch in range(start, target):
            agreed = consensus(view.peers, epoch + 1)
            if agreed is None:
                return False
            donors = [p.peer_id for p in view.peers if p.peer_id in agreed.holders and not p.client_mode]
            donors = [d for d in donors if d != peer.peer_id]
            random.shuffle(donors)
            outcome = ReplayStep.unavailable
            for donor in donors[:REPLAY_DONORS]:
                outcome = self._replay_one(donor, epoch, agreed.checksum, shift)
                if outcome != ReplayStep.unavailable:
                    break
            if outcome != ReplayStep.applied:  # unavailable everywhere, or it broke our state: download it all
                peer.emit(PeerEvent.replay_failed, dict(epoch=epoch, reason=outcome.value))
                return False
        with peer.shield():
            peer.outer.reset_residual()
            if shift is None:
                peer.outer.write_to(peer.params)
            peer.checkpoints.save()
        peer.emit(PeerEvent.replayed, dict(epoch=start, target=target, kept_steps=shift is not None))
        return True

    def _replay_one(
        self, donor: str, epoch: int, expected: str, shift: Sequence[torch.Tensor] | None = None
    ) -> ReplayStep:
        peer = self.peer
        avg = peer.manifest.averaging
        destination = peer.store.temporary_path(f"update-{epoch}-{donor[-8:]}")
        try:
            try:
                peer.averager.download_update(
                    donor,
                    epoch,
                    destination,
                    max_bytes=peer.outer.nbytes // 2 + (1 << 20),  # even uncompressed, 4 bytes per parameter
                    chunk_timeout=avg.chunk_timeout,
                    timeout=avg.allreduce_timeout,
                    should_stop=lambda: peer.stop_requested,
                )
                held = read_update(destination, peer.run_id, epoch, len(peer.outer.params))
                with peer.averager.get_tensors() as buffers:
                    for tensor, parts in zip(buffers, held):
                        check_parts(tensor, parts)
            except DownloadStopped:
                return ReplayStep.broken  # leaving: no more donors
            except Exception as e:
                logger.debug("update %d from %s unusable", epoch, donor, exc_info=True)
                reason = f"update of epoch {epoch}: {short_reason(e)}"
                peer.emit(PeerEvent.download_failed, dict(donor=donor, reason=reason))
                return ReplayStep.unavailable
            with peer.shield(), peer.averager.get_tensors() as buffers:
                for tensor, parts in zip(buffers, held):
                    decode_into(tensor, parts)
                peer.outer.step(buffers, shift=shift)
            return ReplayStep.applied if peer.outer.checksum() == expected else ReplayStep.broken
        finally:
            destination.unlink(missing_ok=True)

    def _view_after_round_if_download_is_too_slow(self) -> SwarmView:
        """On a slow link a download can outlast what is left of the swarm's round; the state would be stale
        on arrival and we would download again, forever. Knowing how fast our last download went, wait for
        the swarm's next round to end and download then: a whole round's time for the transfer, and the
        early-join rule lets us average in that same round."""
        peer = self.peer
        view = peer.view()
        if self._download_rate is None or view.global_epoch is None or view.eta_next_round is None:
            return view
        expected = peer.outer.nbytes / self._download_rate
        if expected < MIN_DEFERRED_DOWNLOAD or view.eta_next_round >= expected:
            return view
        avg = peer.manifest.averaging
        peer.emit(PeerEvent.download_deferred, dict(eta=view.eta_next_round, expected=expected))
        epoch, deadline = view.global_epoch, time.monotonic() + view.eta_next_round + avg.matchmaking_timeout
        while time.monotonic() < deadline and not peer.stop_requested:
            time.sleep(0.5)
            view = peer.view()
            if view.global_epoch is None or view.global_epoch > epoch:
                break
        return view

    def _download_from(self, donor: str, chunk_timeout: float, timeout: float) -> bool:
        peer = self.peer
        peer.emit(PeerEvent.download_started, dict(donor=donor))
        destination = peer.store.temporary_path(f"download-{donor[-8:]}")
        try:
            return self._fetch_and_load(donor, destination, chunk_timeout, timeout)
        finally:
            destination.unlink(missing_ok=True)  # adopted files were renamed away; anything left is a failure

    def _fetch_and_load(self, donor: str, destination: Path, chunk_timeout: float, timeout: float) -> bool:
        peer = self.peer
        started = time.monotonic()
        # a header is well under a kilobyte per tensor; anything much larger is not this run's state
        max_bytes = peer.outer.nbytes + (1 << 20) + 1024 * len(peer.outer.params)
        try:
            peer.averager.download_state(
                donor,
                destination,
                max_bytes=max_bytes,
                chunk_timeout=chunk_timeout,
                timeout=timeout,
                should_stop=lambda: peer.stop_requested,
            )
        except DownloadStopped:
            return False
        except Exception as e:
            logger.debug("state download from %s failed", donor, exc_info=True)
            peer.emit(PeerEvent.download_failed, dict(donor=donor, reason=short_reason(e)))
            return False
        self._download_rate = destination.stat().st_size / max(time.monotonic() - started, 1e-3)
        try:
            header = state_file.check(destination, run_id=peer.run_id, shapes=peer.outer.shapes)
            agreed = consensus(peer.view().peers, header.epoch)
            if agreed is None or not agreed.agrees(header.checksum):
                raise StateFileError("the state is not the one most peers hold for its epoch")
        except StateFileError as e:
            peer.emit(PeerEvent.download_failed, dict(donor=donor, reason=str(e)))
            return False
        with peer.shield():  # a stop signal waits for the outer state to be whole again
            peer.outer.load_file(destination, header)
            peer.outer.write_to(peer.params)
            peer.averager.note_epoch(header.epoch)
            peer.store.adopt(destination, header, peer.checkpoints.extra())
        peer.emit(PeerEvent.state_loaded, dict(donor=donor, epoch=header.epoch, checksum=header.checksum))
        return True
