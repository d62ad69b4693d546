"""Checkpoints that survive being killed at any line.

Each is written to a temporary file and renamed into place, so a reader sees a
whole checkpoint or none; the last two are kept, so a checkpoint that turns out
corrupt (a full disk, a bad sector) still leaves the one before it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

KEEP = 2
PATTERN = "checkpoint-*.pt"


@dataclass
class LoadedCheckpoint:
    path: Path
    state: dict[str, Any]


def checkpoint_dir(workdir: Path, run_id: str) -> Path:
    return Path(workdir) / "runs" / run_id / "checkpoints"


def save(directory: Path, epoch: int, inner_step: int, state: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"checkpoint-{epoch:07d}-{inner_step:06d}.pt"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for old in sorted(directory.glob(PATTERN))[:-KEEP]:
        old.unlink(missing_ok=True)
    return final


def load_latest(directory: Path, run_id: str, warn=lambda message: None) -> LoadedCheckpoint | None:
    """The newest readable checkpoint of ``run_id``; corrupt ones are reported and skipped, never fatal."""
    for path in sorted(Path(directory).glob(PATTERN), reverse=True):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            if not isinstance(state, dict) or state.get("run_id") != run_id:
                raise ValueError("it belongs to another run or is not a swarm checkpoint")
            return LoadedCheckpoint(path, state)
        except Exception as e:
            warn(
                f"Checkpoint {path.name} is unreadable ({type(e).__name__}: {str(e)[:120]}); it is skipped. "
                "An older checkpoint or the swarm's state will be used instead."
            )
    return None
