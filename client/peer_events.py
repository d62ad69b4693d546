"""What the volunteer reads about the peer's events: one plain line each, as a pure function of the event.

The training loop keeps only what changes its own state (the dashboard's state, the download's donor, the
disk's speed); every other event is a line in the event log, chosen here by the event's type.
"""

from __future__ import annotations

from swarm.defence.bans import BAN_ROUNDS
from swarm.events import (
    AveragingFailed,
    AwaitingMajority,
    Banned,
    CheckpointUnusable,
    ClaimDoubted,
    DonorDistrusted,
    DownloadDeferred,
    DownloadFailed,
    DownloadStarted,
    Initialized,
    PeerEvent,
    Replayed,
    ReplayFailed,
    ReplayStarted,
    Resyncing,
    StateLoaded,
    StateSaveFailed,
)


def describe(event: PeerEvent) -> tuple[str, str] | None:
    """(the event log's kind, the line) for ``event``; None for an event that is not shown as a line."""
    match event:
        case Resyncing(reason=reason):
            return "resync", f"re-syncing: {reason}"
        case DownloadStarted(donor=donor):
            return "download", f"downloading the training state from peer {donor[-8:]}"
        case DownloadDeferred(eta=eta, expected=expected):
            return "download", (
                f"waiting ~{eta:.0f} s for the swarm's round to end before downloading: at the last "
                f"download's speed it takes ~{expected:.0f} s, more than is left of this round"
            )
        case AwaitingMajority(epoch=epoch, seconds=seconds):
            return "download", (
                f"no state of epoch {epoch} is held by half of the peers yet (its round ended with its groups apart): "
                f"waiting up to {seconds:.0f} s before downloading"
            )
        case StateLoaded(donor=donor, epoch=epoch, checksum=checksum):
            return "state_loaded", f"state of epoch {epoch} (checksum {checksum[:8]}) loaded from {donor[-8:]}"
        case DownloadFailed(donor=donor, reason=reason):
            return "download_failed", f"state download from {donor[-8:]} failed: {reason}"
        case DonorDistrusted(donor=donor, reason=reason):
            return "bad_donor", f"peer {donor[-8:]} served a bad state ({reason}); not asking it again"
        case ClaimDoubted(peers=peers, epoch=epoch, rounds=rounds):
            return "doubted", (
                f"{peers} peer(s) vouch for a state of epoch {epoch} that none of them served: not believed until "
                f"{rounds} rounds past it; this peer's round goes on"
            )
        case Initialized(epoch=epoch, reason=reason):
            return "initialized", f"starting at epoch {epoch}: {reason}"
        case StateSaveFailed(reason=reason):
            return "log", f"Writing the checkpoint failed ({reason}); the previous one is kept."
        case AveragingFailed(reason=reason):
            return "log", f"averaging failed: {reason}; this round is local"
        case ReplayStarted(epoch=epoch, target=target):
            return "download", f"catching up from epoch {epoch} to {target} by replaying the rounds"
        case Replayed(epoch=epoch, target=target):
            return "state_loaded", f"caught up to epoch {target} by replaying {target - epoch} rounds"
        case ReplayFailed(epoch=epoch, reason=reason):
            return "download_failed", f"replay stopped at epoch {epoch} ({reason}): downloading the state"
        case Banned(ban=ban):
            accusers = ", ".join(b[-8:] for b in ban.by)
            who = "our audit" if ban.by == ("self",) else f"the proof in {accusers}'s accusation"
            until = ban.epoch + BAN_ROUNDS
            return "banned", f"banned peer {ban.peer_id[-8:]} until epoch {until}: {ban.reason} (caught by {who})"
        case CheckpointUnusable(path=path, reason=reason):
            return "log", f"Checkpoint {path.name} is unusable ({reason}); it is skipped."
    return None
