"""The directory of outer-state files: written in the background after every change, pruned, found again.

After each round (and each download) the training thread hands the new state to
``save_async`` and goes on training; a writer thread writes it to a temporary name
under the state's lock (which the training thread needs again only at the next
round's begin or end), fsyncs it once the lock is released and renames it into
place, so a reader or a restart sees a whole file or none. The newest ``keep``
files are kept: a file damaged later still leaves the one before it.

Each state file ``state-SEQ.safetensors`` may have a small ``state-SEQ.json``
beside it with the owner's own extras (its data position, say), which is never
sent to others. Files are numbered in the order they were made, not by epoch: a
peer that re-synced to an older epoch must resume from that, not from what it
held before.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.state import file as state_file
from swarm.state.file import StateFileError, StateHeader
from swarm.state.outer import OuterState

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^state-(\d{6})\.safetensors$")


@dataclass(frozen=True)
class SavedState:
    path: Path
    epoch: int
    checksum: str
    bytes: int
    seconds: float  # time the write took (0 for an adopted download)


@dataclass(frozen=True)
class FoundState:
    path: Path
    header: StateHeader
    extra: dict[str, Any]


def _sequence(path: Path) -> int:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def state_files(directory: Path) -> list[Path]:
    """State files, newest first."""
    return sorted((p for p in Path(directory).glob("state-*.safetensors") if _NAME.match(p.name)), key=_sequence)[::-1]


def residual_path(state_path: Path) -> Path:
    """The error-feedback residual that goes with a state file (this peer's own)."""
    return state_path.with_suffix(".residual")


def read_extra(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.with_suffix(".json").read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def find_latest(directory: Path, run_id: str, shapes=None, warn: Callable[[str], None] = lambda m: None):
    """The newest state file that passes every check, or None; damaged ones are reported and skipped."""
    for path in state_files(directory):
        try:
            header = state_file.check(path, run_id=run_id, shapes=shapes)
        except StateFileError as e:
            warn(f"Checkpoint {path.name} is unusable ({e}); it is skipped.")
            continue
        return FoundState(path, header, read_extra(path))
    return None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        logger.debug("could not fsync %s", directory, exc_info=True)


class StateStore:
    def __init__(
        self,
        directory: Path,
        run_id: str,
        *,
        keep: int = 2,
        on_saved: Callable[[SavedState], None] = lambda saved: None,
        on_failed: Callable[[str], None] = lambda reason: None,
    ):
        self.directory, self.run_id, self.keep = Path(directory), run_id, keep
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".tmp-*"):  # a write or download cut short by a kill
            stale.unlink(missing_ok=True)
        self._on_saved, self._on_failed = on_saved, on_failed
        existing = state_files(self.directory)
        self._next = _sequence(existing[0]) + 1 if existing else 0
        self.latest: SavedState | None = None
        self._pending: tuple[OuterState, dict] | None = None
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="swarm-state-writer", daemon=True)
        self._thread.start()

    # ---- the training thread's side ------------------------------------------------------------

    def save_async(self, outer: OuterState, extra: dict[str, Any] | None = None) -> None:
        """Write ``outer`` as it is now, in the background; ``extra`` goes into the JSON beside it. Its
        error-feedback residual goes beside it too, unless it changed before the writer got to it."""
        with self._cond:
            self._pending = (outer, dict(extra or {}), outer.residual_version)
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every scheduled write is on disk; False if that took longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def temporary_path(self, tag: str) -> Path:
        """A name for a file being written (a download), removed at the next start if it is left behind."""
        return self.directory / f".tmp-{tag}-{os.getpid()}.safetensors"

    def adopt(self, path: Path, header: StateHeader, extra: dict[str, Any] | None = None) -> SavedState:
        """Make a checked file (a download) the newest state file, without writing it again."""
        with self._cond:
            final = self._claim_name()
        self._write_extra(final, extra or {})
        os.replace(path, final)
        _fsync_dir(self.directory)
        saved = SavedState(final, header.epoch, header.checksum, header.total_bytes, 0.0)
        self._finish(saved)
        return saved

    def discard_downloads(self) -> None:
        """Remove this process's unfinished downloads: an averager stopped in the middle of one may have
        written its file after the download was given up and removed."""
        for path in self.directory.glob(f".tmp-*-{os.getpid()}.safetensors"):
            if path.name.startswith((".tmp-download-", ".tmp-update-")):
                path.unlink(missing_ok=True)

    def use_existing(self, path: Path, header: StateHeader) -> SavedState:
        """Make a state file already in the directory (a checkpoint we resumed from) the newest one."""
        saved = SavedState(Path(path), header.epoch, header.checksum, header.total_bytes, 0.0)
        self._finish(saved)
        return saved

    def close(self, timeout: float = 10.0) -> bool:
        done = self.wait_idle(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return done

    # ---- the writer thread --------------------------------------------------------------------

    def _claim_name(self) -> Path:
        path = self.directory / f"state-{self._next:06d}.safetensors"
        self._next += 1
        return path

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                (outer, extra, residual_version), self._pending = self._pending, None
                self._busy = True
                final = self._claim_name()
            try:
                self._write(outer, extra, residual_version, final)
            except Exception as e:  # a full disk must not stop training; the previous file stays
                logger.debug("writing the state file failed", exc_info=True)
                self._on_failed(f"{type(e).__name__}: {e}")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, outer: OuterState, extra: dict[str, Any], residual_version: int, final: Path) -> None:
        tmp = self.directory / f".tmp-{final.stem}-{os.getpid()}.safetensors"
        tmp_residual = self.directory / f".tmp-{final.stem}-{os.getpid()}.residual"
        started = time.monotonic()
        try:
            # the lock is held while the bytes are copied out (the next round's begin and outer step wait for that,
            # never the inner steps), not while the disk takes them: on a lent H200 machine the fsync of 1.1 GB held
            # an overlapped round's begin for 18-24 s with the GPU idle (benchmarks/results/gpu-overlap/README.md)
            with outer.lock:
                epoch, checksum = outer.epoch, outer.checksum()
                nbytes = state_file.write(
                    tmp,
                    run_id=self.run_id,
                    epoch=epoch,
                    checksum=checksum,
                    params=outer.params,
                    momentum=outer.momentum,
                    durable=False,
                )
                with_residual = outer.residual is not None and outer.residual_version == residual_version
                if with_residual:
                    state_file.write_residual(
                        tmp_residual,
                        run_id=self.run_id,
                        epoch=epoch,
                        checksum=checksum,
                        residual=outer.residual,
                        durable=False,
                    )
            state_file.make_durable(tmp)
            if with_residual:
                state_file.make_durable(tmp_residual)
            self._write_extra(final, extra)
            if with_residual:
                os.replace(tmp_residual, residual_path(final))
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            tmp_residual.unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)
        self._finish(SavedState(final, epoch, checksum, nbytes, time.monotonic() - started))

    def _write_extra(self, final: Path, extra: dict[str, Any]) -> None:
        target = final.with_suffix(".json")
        tmp = self.directory / f".tmp-{target.name}"
        tmp.write_text(json.dumps(extra))
        os.replace(tmp, target)

    def _finish(self, saved: SavedState) -> None:
        """Prune, and make ``saved`` the newest unless a later-numbered file finished first (a write that
        was under way while a download was adopted)."""
        with self._cond:
            if self.latest is not None and _sequence(self.latest.path) > _sequence(saved.path):
                return
            self.latest = saved
            for old in state_files(self.directory)[self.keep :]:
                if old == saved.path:
                    continue
                old.unlink(missing_ok=True)
                old.with_suffix(".json").unlink(missing_ok=True)
                residual_path(old).unlink(missing_ok=True)
        self._on_saved(saved)
