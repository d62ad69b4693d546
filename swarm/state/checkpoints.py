"""A peer's own state files: writing one after every change of the outer state, offering it to others, and
publishing the checksum that joiners and the consistency checks compare with.

The files are written in the background (``state_store.StateStore``); each one written is served to peers that
download the state, and said to the training loop (its bytes and seconds) as a ``PeerEvent``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarm.events import PeerEvent
from swarm.state.store import SavedState, StateStore

if TYPE_CHECKING:
    from swarm.peer import Peer

logger = logging.getLogger(__name__)


class Checkpoints:
    def __init__(self, peer: Peer, extra: Callable[[], dict[str, Any]]):
        self.peer = peer
        self._extra = extra  # the loop's own extras for each file (its data position, say); never sent to others

    def open_store(self) -> StateStore:
        peer = self.peer
        return StateStore(peer.state_dir, peer.run_id, on_saved=self._on_saved, on_failed=self._on_failed)

    def save(self) -> None:
        """Write the current outer state to a new state file, in the background."""
        peer = self.peer
        peer.averager.note_epoch(peer.outer.epoch)
        peer.store.save_async(peer.outer, self.extra())

    def extra(self) -> dict[str, Any]:
        """The loop's extras for the state file being made; {} (logged) if the loop's callback fails."""
        try:
            return dict(self._extra())
        except Exception:
            logger.debug("state_extra failed", exc_info=True)
            return {}

    def announce(self) -> None:
        """Publish our checksum for the current epoch and offer our state (its file) to others."""
        peer = self.peer
        peer.presence.add_checksum(peer.outer.epoch, peer.outer.checksum())
        peer.presence.update(epoch=peer.outer.epoch, inner_step=peer.inner_step, publish_now=True)
        if not peer.client_mode:
            peer.averager.allow_state_sharing = True

    def _on_saved(self, saved: SavedState) -> None:
        """On the state writer's thread: serve the new file, and tell the loop (checkpoint bytes and time)."""
        self.peer.averager.serve_state_file(saved.path, saved.epoch)
        details = dict(path=str(saved.path), epoch=saved.epoch, bytes=saved.bytes, seconds=saved.seconds)
        self.peer.emit(PeerEvent.state_saved, details)

    def _on_failed(self, reason: str) -> None:
        self.peer.emit(PeerEvent.state_save_failed, dict(reason=reason))
