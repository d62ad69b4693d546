"""This peer's live numbers, shared by the training loop, the dashboard, the log lines and --log-json.

The training loop only appends to it (a few attribute writes per step), so the
hot path stays cheap; the dashboard and the monitor thread read it whenever they
like. One JSON object per step, round and event goes to ``--log-json`` when set.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from swarm import RoundReport

LOSS_HISTORY = 240
EVENT_HISTORY = 200


@dataclass(frozen=True)
class Event:
    time: float  # unix time
    kind: str  # log, joined, left, round, fallback, resync, state_loaded, download_failed, ...
    message: str


class Telemetry:
    def __init__(self, log_json: Path | None = None, echo: Callable[[str], None] | None = None):
        """``echo`` prints each event as a plain line (when there is no dashboard to show them)."""
        self.echo = echo
        self.started_at = time.time()
        self.training_started_at: float | None = None  # wall time of the first inner step
        self.compute_seconds = 0.0  # inner steps only
        self.steps = 0
        self.losses: deque[float] = deque(maxlen=LOSS_HISTORY)
        self.lr = 0.0
        self.tokens_per_second = 0.0  # smoothed over recent steps
        self.micro_batch = 0
        self.skipped_scaler_steps = 0
        self.nan_steps = 0
        self.epoch = 0
        self.inner_step = 0
        self.state = "starting"
        self.rounds = 0
        self.averaged_rounds = 0
        self.last_round: RoundReport | None = None
        self.eval_loss: tuple[int, float] | None = None  # the latest held-out figure: epoch, loss
        self.last_round_wall = 0.0  # seconds between the end of the previous round and the end of this one
        self.download_donor: str | None = None
        self.last_checkpoint: tuple[int, int, float] | None = None  # epoch, bytes, seconds to write
        self.progress_at = time.time()  # last time anything moved: the health check's signal
        self.events: deque[Event] = deque(maxlen=EVENT_HISTORY)
        self._round_mark = time.time()
        self._lock = threading.Lock()
        self._json: IO[str] | None = None
        if log_json is not None:
            log_json = Path(log_json).expanduser()
            log_json.parent.mkdir(parents=True, exist_ok=True)
            self._json = log_json.open("a", buffering=1)

    # ---- written by the training loop and the peer's listener -----------------------------------

    def step(self, *, loss: float, seconds: float, lr: float, tokens: int, epoch: int, inner_step: int) -> None:
        now = time.time()
        if self.training_started_at is None:
            self.training_started_at = now - seconds
            self._round_mark = self.training_started_at
        self.steps += 1
        self.compute_seconds += seconds
        self.losses.append(loss)
        self.lr, self.epoch, self.inner_step, self.progress_at = lr, epoch, inner_step, now
        rate = tokens / max(seconds, 1e-9)
        self.tokens_per_second = rate if self.steps == 1 else 0.9 * self.tokens_per_second + 0.1 * rate
        self._write(
            dict(
                type="step",
                time=now,
                epoch=epoch,
                inner_step=inner_step,
                loss=loss,
                lr=lr,
                tokens_per_second=rate,
                step_seconds=seconds,
                micro_batch=self.micro_batch,
            )
        )

    def round(self, report: RoundReport) -> None:
        now = time.time()
        self.last_round_wall, self._round_mark = now - self._round_mark, now
        self.last_round, self.progress_at = report, now
        self.rounds += 1
        self.averaged_rounds += int(report.averaged)
        self.epoch, self.inner_step = report.epoch, 0
        self._write(
            dict(
                type="round",
                time=now,
                epoch=report.epoch,
                averaged=report.averaged,
                group_size=report.group_size,
                fallback_reason=report.fallback_reason,
                resynced=report.resynced,
                resync_reason=report.resync_reason.name if report.resync_reason is not None else None,
                dropped_fraction=report.dropped_fraction,
                checksum=report.checksum,
                samples=report.samples,
                seconds={k: round(v, 4) for k, v in report.seconds.items()},
                bytes_sent=report.bytes_sent,
                bytes_received=report.bytes_received,
                audit_bytes=report.audit_bytes,
                repair_failures=list(report.repair_failures),
                steps_late=report.steps_late,
                wall_seconds=round(self.last_round_wall, 4),
                outcome=report.outcome.value,
                merged_groups=report.merged_groups,
                merge_source=report.merge_source.value if report.merge_source is not None else None,
                counted=report.counted,
                records_read=report.records_read,
                records_written=report.records_written,
            )
        )

    def evaluation(self, epoch: int, loss: float) -> None:
        """The held-out loss of the model as it left the round that ended at ``epoch``."""
        self.eval_loss = (epoch, loss)
        self._write(dict(type="eval", time=time.time(), epoch=epoch, loss=loss))

    def event(self, kind: str, message: str) -> None:
        event = Event(time.time(), kind, message)
        with self._lock:
            self.events.append(event)
        if self.echo is not None:
            self.echo(message)
        self._write(dict(type="event", time=event.time, kind=kind, message=message))

    def checkpoint(self, epoch: int, nbytes: int, seconds: float) -> None:
        """A state file reached the disk (written in the background, or a download adopted as it is)."""
        self.last_checkpoint = (epoch, nbytes, seconds)
        self._write(dict(type="checkpoint", time=time.time(), epoch=epoch, bytes=nbytes, seconds=round(seconds, 3)))

    def set_state(self, state: str) -> None:
        self.state, self.progress_at = state, time.time()

    def touch(self) -> None:
        """Something moved (e.g. a state download advanced) without a step."""
        self.progress_at = time.time()

    # ---- read by the dashboard, the log lines and the health file --------------------------------

    def utilization(self, now: float | None = None) -> float | None:
        """Share of wall time since the first inner step spent in inner steps."""
        if self.training_started_at is None:
            return None
        wall = (now or time.time()) - self.training_started_at
        return min(1.0, self.compute_seconds / wall) if wall > 0 else None

    def recent_events(self, n: int) -> list[Event]:
        with self._lock:
            return list(self.events)[-n:]

    def close(self) -> None:
        with self._lock:
            if self._json is not None:
                self._json.close()
                self._json = None

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str) + "\n"
        with self._lock:  # the state writer's thread reports here too
            if self._json is not None:
                self._json.write(line)
