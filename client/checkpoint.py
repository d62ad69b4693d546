"""Checkpoints: the peer's state files, plus this peer's own inner optimizer state when it leaves.

After every round the peer writes the outer state (global parameters and momentum,
8 bytes per parameter) to ``WORKDIR/runs/RUN/checkpoints/state-SEQ.safetensors`` in
the background (``swarm.state.store``), with this peer's data position and gradient
scaler in ``state-SEQ.json`` beside it; the newest two are kept. That is what a
restart resumes from, and the model is rebuilt from it: after a blocking round the
model *is* the outer parameters, so it is not saved again (after an overlapped one
it also holds the few inner steps taken while the average was in flight, which a
restart does without).

On a graceful exit, time allowing, the inner AdamW state is saved too
(``inner.pt``), tagged with the checksum of the outer state it goes with; a restart
from that same state picks it up. Without it (after a crash, say) the peer starts
its inner optimizer afresh, as every joiner does.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarm.state.store import FoundState, find_latest

INNER_FILE = "inner.pt"

logger = logging.getLogger(__name__)


def checkpoint_dir(workdir: Path, run_id: str) -> Path:
    return Path(workdir) / "runs" / run_id / "checkpoints"


def find(directory: Path, run_id: str, shapes=None, warn=lambda message: None) -> FoundState | None:
    """The newest checkpoint that passes its checks; damaged ones are reported (once each) and skipped."""

    def explain(message: str) -> None:
        warn(f"{message} An older checkpoint or the swarm's state will be used instead.")

    return find_latest(directory, run_id, shapes, explain)


@dataclass
class InnerState:
    optimizer: dict[str, Any]
    scaler: dict[str, Any]
    data: dict[str, int]


def save_inner(directory: Path, checksum: str, optimizer: dict, scaler: dict, data: dict[str, int]) -> Path:
    """Write the inner optimizer's state for the outer state with ``checksum`` (atomic: temp file, rename)."""
    final = Path(directory) / INNER_FILE
    tmp = final.with_name(f".tmp-{INNER_FILE}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(checksum=checksum, optimizer=optimizer, scaler=scaler, data=data), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def save_inner_in_time(
    directory: Path,
    checksum: str,
    state: InnerState,
    seconds_expected: float,
    seconds_left: float | None,
) -> str | None:
    """``save_inner``, when the disk can write it in half the time left (``seconds_left`` None: no hurry);
    otherwise, or when the write fails (a full disk), the one line that says so. The outer checkpoint is what
    matters: without this file a restart begins its inner optimizer afresh, as a joiner does."""
    if seconds_left is not None and seconds_expected >= seconds_left / 2:
        return (
            f"Inner optimizer state not saved: ~{seconds_expected:.0f} s to write, {seconds_left:.0f} s left; "
            "a restart begins it afresh, as a joiner does."
        )
    try:
        save_inner(directory, checksum, state.optimizer, state.scaler, state.data)
    except (OSError, RuntimeError) as e:
        logger.debug("saving the inner optimizer state failed", exc_info=True)
        return (
            f"Inner optimizer state not saved ({type(e).__name__}: {str(e)[:120]}); free disk space in "
            f"{directory}. A restart begins it afresh, as a joiner does."
        )
    return None


def load_inner(directory: Path, checksum: str, warn=lambda message: None) -> InnerState | None:
    """The saved inner state if it belongs to the outer state with ``checksum``; else None."""
    path = Path(directory) / INNER_FILE
    if not path.exists():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("checksum") != checksum:
            return None
        return InnerState(saved["optimizer"], saved["scaler"], {k: int(v) for k, v in saved["data"].items()})
    except Exception as e:
        warn(f"The inner optimizer state {path.name} is unreadable ({type(e).__name__}); starting it afresh.")
        return None
