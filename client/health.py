"""The status file a running peer refreshes, and the check Docker's HEALTHCHECK runs on it.

A container whose peer hangs (a wedged GPU driver, a deadlock) still looks
"running" to Docker; the file tells a live process from a stuck one: ``updated_at``
proves the process is alive, ``progress_at`` that training or catching up moves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:  # `swarm-client health` runs every 30 s in Docker: it imports neither torch nor hivemind
    from swarm.manifest import RunManifest

STATUS_FILE = "status.json"
DEFAULT_MAX_AGE = 60.0  # the file is rewritten every few seconds
MIN_STUCK_AFTER = 300.0


class PeerStatus(BaseModel):
    pid: int
    peer_id: str
    run_id: str
    state: str
    round: str | None = None  # an overlapped round's stage while the peer trains (``client.idle.shown_state``)
    epoch: int
    inner_step: int
    updated_at: float  # unix time of this rewrite
    progress_at: float  # unix time of the last inner step, round or download progress
    stuck_after: float  # seconds without progress that mean "stuck"


def stuck_after(manifest: RunManifest, numel: int = 0) -> float:
    """The longest a healthy peer of a model of ``numel`` parameters can go without progress: waiting for slower
    peers, then a whole round's timeouts (its all-reduce as long as its payload needs at the slowest link), twice,
    plus slack."""
    avg = manifest.averaging
    round_timeouts = avg.matchmaking_timeout + avg.allreduce_seconds(numel) + avg.consistency_timeout
    return max(MIN_STUCK_AFTER, avg.wait_for_peers + 2 * round_timeouts + 60)


def write_status(workdir: Path, status: PeerStatus) -> None:
    """Atomic: the health check never reads half a file."""
    path = Path(workdir) / STATUS_FILE
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(status.model_dump_json())
    os.replace(tmp, path)


def check_health(workdir: Path, max_age: float = DEFAULT_MAX_AGE, now: float | None = None) -> tuple[bool, str]:
    """(healthy, one line saying why) for the peer whose workdir this is."""
    now = time.time() if now is None else now
    path = Path(workdir).expanduser() / STATUS_FILE
    try:
        status = PeerStatus.model_validate_json(path.read_text())
    except FileNotFoundError:
        return False, f"no status file at {path}: is the peer running with this workdir?"
    except (OSError, ValidationError, ValueError) as e:
        return False, f"unreadable status file {path}: {str(e).splitlines()[0]}"
    where = f"peer {status.peer_id[-8:]} {status.state}, epoch {status.epoch} step {status.inner_step}"
    if status.state == "left":
        return False, f"{where}: the peer has left (exited at {time.ctime(status.updated_at)})"
    silent = now - status.updated_at
    if silent > max_age:
        return False, f"{where}: the status file was last refreshed {silent:.0f} s ago (limit {max_age:.0f} s)"
    idle = now - status.progress_at
    if idle > status.stuck_after:
        return False, f"{where}: no progress for {idle:.0f} s (limit {status.stuck_after:.0f} s)"
    return True, f"{where}, last progress {idle:.0f} s ago"


def status_fields(**fields: Any) -> PeerStatus:
    return PeerStatus(pid=os.getpid(), updated_at=time.time(), **fields)
