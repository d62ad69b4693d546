"""What runs beside the training loop: the swarm watcher's ticks, the health file and the plain log lines.

Everything here runs on the watcher's thread, once a second, never on the
training thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from client.hardware import Hardware
from client.health import status_fields, stuck_after, write_status
from client.idle import OwnState, shown_state, why_idle
from client.preflight import DeviceKind
from client.swarm_watch import SwarmSnapshot
from client.trainer import Trainer
from swarm import PeerState

PLAIN_SWARM_EVERY = 30.0  # seconds between the swarm summary lines without a dashboard


def own_state(trainer: Trainer, has_initial_peers: bool) -> OwnState:
    m, tel, peer = trainer.manifest, trainer.telemetry, trainer.peer
    started = peer is not None and peer.outer is not None
    state, background = shown_state(tel.state, started and peer.round_in_background)
    return OwnState(
        peer_id=trainer.dht.peer_id.to_base58(),
        state=state,
        round_in_background=background,
        epoch=peer.epoch if started else 0,
        inner_step=peer.inner_step if started else 0,
        inner_steps=m.inner_steps,
        samples_per_step=m.samples_per_step,
        download_fraction=peer.download_progress if peer is not None else 0.0,
        download_donor=tel.download_donor,
        has_initial_peers=has_initial_peers,
        samples_per_second=tel.tokens_per_second / m.seq_len,
    )


def gpu_memory(hardware: Hardware) -> Callable[[], str]:
    """Text for the dashboard: CUDA memory in use, or the process's RAM on CPU and MPS."""
    process = psutil.Process()

    def text() -> str:
        if hardware.kind is DeviceKind.CUDA:
            used = torch.cuda.memory_allocated(hardware.device)
            total = torch.cuda.get_device_properties(hardware.device).total_memory
            peak = torch.cuda.max_memory_allocated(hardware.device)
            return f"{used / 2**30:.1f} GiB in use, peak {peak / 2**30:.1f} of {total / 2**30:.0f} GiB"
        return f"no GPU ({hardware.kind.value}); process RAM {process.memory_info().rss / 2**30:.1f} GiB"

    return text


class TrainingTick:
    """Called by the swarm watcher after each read: refresh the health file and, without a dashboard,
    print a swarm summary and the idle line now and then."""

    def __init__(
        self,
        trainer: Trainer,
        workdir: Path,
        has_initial_peers: bool,
        print_line: Callable[[str], None] | None,
    ):
        self.trainer, self.workdir, self.has_initial_peers = trainer, workdir, has_initial_peers
        self.print_line = print_line
        self._stuck_after = stuck_after(trainer.manifest, trainer.parameters)
        self._last_fraction = 0.0
        self._last_print: float | None = None  # the first swarm line goes out as soon as the swarm is seen

    def __call__(self, snapshot: SwarmSnapshot) -> None:
        own = self.write_status()
        due = self._last_print is None or time.monotonic() - self._last_print > PLAIN_SWARM_EVERY
        if self.print_line is not None and snapshot.view is not None and own.state == PeerState.training and due:
            self._last_print = time.monotonic()
            self.print_line(swarm_line(snapshot, self.trainer.manifest.seq_len))
            self.print_line(f"why idle: {why_idle(own, snapshot.view)}")

    def write_status(self) -> OwnState:
        own = own_state(self.trainer, self.has_initial_peers)
        tel = self.trainer.telemetry
        if own.download_fraction != self._last_fraction:  # a download that advances is progress
            self._last_fraction = own.download_fraction
            tel.touch()
        write_status(
            self.workdir,
            status_fields(
                peer_id=own.peer_id or "",
                run_id=self.trainer.manifest.run_id,
                state=own.state,
                round=own.round_in_background,
                epoch=own.epoch,
                inner_step=own.inner_step,
                progress_at=tel.progress_at,
                stuck_after=self._stuck_after,
            ),
        )
        return own


def swarm_line(snapshot: SwarmSnapshot, seq_len: int) -> str:
    view = snapshot.view
    if view is None:
        return "swarm: not read yet"
    eta = f", next round in ~{view.eta_next_round:.0f} s" if view.eta_next_round is not None else ""
    return (
        f"swarm: {view.num_alive} peers alive, global epoch {view.global_epoch}, "
        f"{view.samples_per_second:,.1f} samples/s ({view.samples_per_second * seq_len:,.0f} tokens/s), "
        f"{view.tokens_processed:,} tokens trained{eta}"
    )
