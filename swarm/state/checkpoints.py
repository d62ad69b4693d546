"""A peer's own state files: writing one after every change of the outer state, offering it to others, and
publishing the checksum that joiners and the consistency checks compare with.

The files are written in the background (``swarm.state.store.StateStore``); each one written is served to peers
that download the state, and told to the training loop (its bytes and seconds) as a ``StateSaved`` event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.dht.presence import Presence
from swarm.events import StateSaved, StateSaveFailed
from swarm.state.context import PeerContext
from swarm.state.store import SavedState, StateStore

logger = logging.getLogger(__name__)


class Checkpoints:
    def __init__(
        self,
        ctx: PeerContext,
        state_dir: Path,
        presence: Presence,
        extra: Callable[[], dict[str, Any]],
        client_mode: bool,
    ):
        self.ctx, self._presence, self._client_mode = ctx, presence, client_mode
        self._extra = extra  # the loop's own extras for each file (its data position, say); never sent to others
        self.store = StateStore(state_dir, ctx.manifest.run_id, on_saved=self._on_saved, on_failed=self._on_failed)

    def save(self) -> None:
        """Write the current outer state to a new state file, in the background."""
        self.ctx.averager.note_epoch(self.ctx.outer.epoch)
        self.store.save_async(self.ctx.outer, self.extra())

    def extra(self) -> dict[str, Any]:
        """The loop's extras for the state file being made; {} (logged) if the loop's callback fails."""
        try:
            return dict(self._extra())
        except Exception:
            logger.debug("state_extra failed", exc_info=True)
            return {}

    def announce(self, inner_step: int) -> None:
        """Publish our checksum for the current epoch and offer our state (its file) to others."""
        outer = self.ctx.outer
        self._presence.add_checksum(outer.epoch, outer.checksum())
        self._presence.update(epoch=outer.epoch, inner_step=inner_step, publish_now=True)
        if not self._client_mode:
            self.ctx.averager.allow_state_sharing = True

    def _on_saved(self, saved: SavedState) -> None:
        """On the state writer's thread: serve the new file, and tell the loop (checkpoint bytes and time)."""
        self.ctx.averager.serve_state_file(saved.path, saved.epoch)
        self.ctx.emit(StateSaved(saved.path, saved.epoch, saved.bytes, saved.seconds))

    def _on_failed(self, reason: str) -> None:
        self.ctx.emit(StateSaveFailed(reason))
