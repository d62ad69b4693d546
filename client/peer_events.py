"""What the volunteer reads about the peer's events: one plain line each, as a pure function of the event.

The training loop keeps only what changes its own state (the dashboard's state, the download's donor, the
disk's speed); every other event is a line in the event log, chosen here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swarm import PeerEvent


def describe(kind: PeerEvent, data: dict[str, Any]) -> tuple[str, str] | None:
    """(the event log's kind, the line) for ``kind``; None for an event that is not shown as a line."""
    match kind:
        case PeerEvent.resync:
            return "resync", f"re-syncing: {data['reason']}"
        case PeerEvent.download_started:
            return "download", f"downloading the training state from peer {data['donor'][-8:]}"
        case PeerEvent.download_deferred:
            return "download", (
                f"waiting ~{data['eta']:.0f} s for the swarm's round to end before downloading: at the last "
                f"download's speed it takes ~{data['expected']:.0f} s, more than is left of this round"
            )
        case PeerEvent.state_loaded:
            return "state_loaded", f"state of epoch {data['epoch']} loaded from {data['donor'][-8:]}"
        case PeerEvent.download_failed:
            return "download_failed", f"state download from {data['donor'][-8:]} failed: {data['reason']}"
        case PeerEvent.initialized:
            return "initialized", f"starting at epoch {data['epoch']}: {data['reason']}"
        case PeerEvent.state_save_failed:
            return "log", f"Writing the checkpoint failed ({data['reason']}); the previous one is kept."
        case PeerEvent.averaging_error:
            return "log", f"averaging failed: {data['reason']}; this round is local"
        case PeerEvent.replay_started:
            return "download", f"catching up from epoch {data['epoch']} to {data['target']} by replaying the rounds"
        case PeerEvent.replayed:
            rounds = data["target"] - data["epoch"]
            return "state_loaded", f"caught up to epoch {data['target']} by replaying {rounds} rounds"
        case PeerEvent.replay_failed:
            why = data["reason"]
            return "download_failed", f"replay stopped at epoch {data['epoch']} ({why}): downloading the state"
        case PeerEvent.banned:
            ban = data["ban"]
            who = "our audit" if ban.by == ("self",) else f"{len(ban.by)} of its groupmates"
            return "banned", f"banned peer {ban.peer_id[-8:]} for the rest of the run: {ban.reason} (caught by {who})"
        case PeerEvent.checkpoint_unusable:
            name = Path(data["path"]).name
            return "log", f"Checkpoint {name} is unusable ({data['reason']}); it is skipped."
    return None
