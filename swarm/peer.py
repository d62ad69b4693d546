"""A DiLoCo peer: the object a training loop calls after every inner step.

The loop owns the model, the data and the inner AdamW optimizer; the peer owns
everything that involves other machines: joining, catching up, the outer round
every H inner steps, keeping the global model consistent with the swarm, and
leaving. Every network wait in here is bounded, so a volunteer who vanishes at
any moment costs the others at most the timeouts of the manifest.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time

from swarm.averaging import (
    COMPRESSIONS,
    PseudoGradientAverager,
    RoundAborted,
    epoch_group_bits,
    state_tensor_infos,
)
from swarm.errors import StateDownloadError
from swarm.manifest import RunManifest
from swarm.network import NetworkConfig, start_dht
from swarm.orphans import install_orphan_reaper
from swarm.outer import OuterState, checksum
from swarm.progress import PUBLISH_INTERVAL, RECORD_TTL, PeerEntry, ProgressReporter, read_peers
from swarm.records import PeerState, run_prefix, run_validator
from swarm.registry import MANIFEST_TTL, publish_manifest
from swarm.swarm_view import SwarmView, build_view, consensus

logger = logging.getLogger(__name__)

DOWNLOAD_ATTEMPTS = 3
MIN_DEFERRED_DOWNLOAD = 2.0  # seconds: a download this quick never waits for the swarm's round to end
LEAVING = "leaving: round abandoned"
NON_FINITE = "non-finite pseudo-gradient"  # the loop should also reset its inner optimizer


@dataclass
class RoundReport:
    """What one outer round did, for logs, the dashboard and tests."""

    epoch: int  # the epoch reached by this round
    averaged: bool  # False: the local pseudo-gradient was used
    group_size: int
    fallback_reason: str | None = None
    dropped_fraction: float = 0.0
    resynced: bool = False
    checksum: str = ""
    samples: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # compute, matchmaking, allreduce, outer, consistency
    bytes_sent: int = 0  # all-reduce tensor payload, framing excluded, as of when our own results were complete
    bytes_received: int = 0


@dataclass
class PeerStats:
    rounds: int = 0
    averaged_rounds: int = 0
    local_rounds: int = 0
    resyncs: int = 0
    tokens_processed: int = 0


Listener = Callable[[str, dict[str, Any]], None]


class Peer:
    """One training peer of one run.

    ``model`` must have been built with ``swarm.seeded_init(manifest)`` so that
    peers who start a run together start from the same weights.
    """

    def __init__(
        self,
        manifest: RunManifest,
        model: torch.nn.Module,
        network: NetworkConfig | None = None,
        *,
        dht: hivemind.DHT | None = None,
        name: str = "",
        device: str = "cpu",
        listener: Listener | None = None,
        progress_interval: float = PUBLISH_INTERVAL,
        progress_ttl: float = RECORD_TTL,
    ):
        if (network is None) == (dht is None):
            raise ValueError("pass exactly one of network= or dht=")
        self.manifest, self.model = manifest, model
        self.run_id = manifest.run_id
        self._network, self._dht, self._owns_dht = network, dht, dht is None
        self.name, self.device = name, device
        self._listener = listener or (lambda kind, data: None)
        self._progress_interval, self._progress_ttl = progress_interval, progress_ttl
        self.params: list[torch.Tensor] = [p for p in model.parameters()]
        self.stats = PeerStats()
        self.inner_step = 0
        self._round_samples = 0
        self._round_started = time.monotonic()
        self._compute_seconds = 0.0
        self._speed = 0.0  # samples per second, smoothed
        self.outer: OuterState | None = None
        self.averager: PseudoGradientAverager | None = None
        self.reporter: ProgressReporter | None = None
        self._started = self._stopped = self._stop_requested = False
        self._next_round_check = 0.0
        self._manifest_published_at = 0.0
        self._last_round_local = False
        self._download_rate: float | None = None  # bytes/s of our last state download

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def dht(self) -> hivemind.DHT:
        assert self._dht is not None, "the peer is not started"
        return self._dht

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def epoch(self) -> int:
        return self.outer.epoch if self.outer is not None else 0

    @property
    def client_mode(self) -> bool:
        return bool(self.dht.client_mode)

    def start(self, resume: tuple[int, Sequence[torch.Tensor]] | None = None) -> None:
        """Join the DHT, announce the run, and catch up with the swarm before the first inner step.

        ``resume`` is (epoch, params + momentum) from a checkpoint: it is kept if the
        swarm is empty or agrees with it, and replaced by a download otherwise.
        """
        install_orphan_reaper()
        if self._dht is None:
            assert self._network is not None
            self._dht = start_dht(self._network)
        self.dht.add_validators([run_validator(self.run_id)])
        self._publish_manifest()
        self.outer = OuterState(self.params, self.manifest.outer)
        avg = self.manifest.averaging
        self._buffers = [torch.zeros_like(p) for p in self.outer.params]
        self.averager = PseudoGradientAverager(
            self._buffers,
            self.dht,
            state_provider=self._current_state,
            start=True,
            prefix=run_prefix(self.run_id),
            target_group_size=avg.target_group_size,
            min_group_size=avg.min_group_size,
            min_matchmaking_time=avg.matchmaking_time,
            request_timeout=min(3.0, avg.matchmaking_time / 2),
            allreduce_timeout=avg.allreduce_timeout,
            next_chunk_timeout=avg.chunk_timeout,
            compression=COMPRESSIONS[avg.compression](),
            allow_state_sharing=False,
            client_mode=self.dht.client_mode,
            declare_state_period=10,
        )
        self.reporter = ProgressReporter(
            self.dht,
            self.run_id,
            self._initial_record(),
            interval=self._progress_interval,
            ttl=self._progress_ttl,
            on_tick=self._on_reporter_tick,
        )
        self.reporter.start()
        self._started = True
        if resume is not None:
            self.outer.load(*resume)
            self.outer.write_to(self.params)
        self._catch_up(resumed=resume is not None)
        self._announce_state()
        self._set_state(PeerState.training, publish=True)
        self._round_started = time.monotonic()

    def __enter__(self) -> Peer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.leave()

    def leave(self) -> None:
        """Mark this peer as gone, stop its averager and DHT, and leave no p2pd behind."""
        if self._stopped:
            return
        self._stopped = True
        if self.reporter is not None:
            self.reporter.update(state=PeerState.leaving.value)
            self.reporter.publish_now()
        if self.averager is not None:
            try:
                self.averager.allow_state_sharing = False
            except Exception:
                pass
            self.averager.shutdown()
        if self.reporter is not None:
            self.reporter.stop(PeerState.left)
        if self._owns_dht and self._dht is not None:
            self._dht.shutdown()
        self._emit("left", {})

    # ---- the training loop's side ---------------------------------------------------------------

    def report_step(
        self, samples: int, loss: float | None = None, compute_seconds: float | None = None
    ) -> RoundReport | None:
        """Count one finished inner step; after the H-th, run the outer round and return its report."""
        assert self._started and not self._stopped, "start() the peer first"
        now = time.monotonic()
        self.inner_step += 1
        self._round_samples += samples
        self.stats.tokens_processed += samples * self.manifest.seq_len
        if compute_seconds is not None:
            self._compute_seconds += compute_seconds
            if compute_seconds > 0:
                rate = samples / compute_seconds
                self._speed = rate if self._speed == 0 else 0.8 * self._speed + 0.2 * rate
        fields: dict[str, Any] = dict(
            inner_step=self.inner_step,
            tokens_processed=self.stats.tokens_processed,
            samples_per_second=float(self._speed),
        )
        if loss is not None and loss == loss:  # not NaN
            fields["last_loss"] = float(loss)
        self.reporter.update(**fields)
        if self.inner_step >= self.manifest.inner_steps or self._round_started_without_us(now):
            return self.run_outer_round()
        return None

    def _round_started_without_us(self, now: float) -> bool:
        """True when enough of our epoch-mates are already matchmaking to form a group without us."""
        avg = self.manifest.averaging
        if not avg.join_rounds_early or now < self._next_round_check:
            return False
        self._next_round_check = now + 1.0
        mates = [p for p in self.view().peers if p.peer_id != self.peer_id and p.epoch == self.epoch]
        busy = [p for p in mates if p.state == PeerState.matchmaking.value]  # a group in all-reduce is closed
        return len(busy) >= max(1, avg.min_group_size - 1) and 2 * len(busy) > len(mates)

    def run_outer_round(self) -> RoundReport:
        """Average pseudo-gradients with whoever is ready, take the outer step, and check consistency."""
        assert self.outer is not None and self.averager is not None
        avg = self.manifest.averaging
        seconds: dict[str, float] = {"compute": self._compute_seconds or (time.monotonic() - self._round_started)}
        start_epoch = self.outer.epoch

        # a late re-check of the previous epoch, now that every peer had time to publish it
        why = self._resync_reason(start_epoch)
        if why is not None:
            return self._resync_round(seconds, why)

        pseudo = self.outer.pseudo_gradient(self.params)
        if not _all_finite(pseudo):  # never send NaN/inf to others: take the swarm's state instead
            return self._resync_round(seconds, NON_FINITE)
        with self.averager.get_tensors() as buffers:
            for buf, grad in zip(buffers, pseudo):
                buf.copy_(grad)

        t0 = time.monotonic()
        stage_times: dict[str, float] = {}
        fallback: str | None = None
        group: tuple[str, ...] = (self.peer_id,)
        dropped = 0.0
        traffic = (0, 0)

        def on_stage(stage: str) -> None:
            stage_times.setdefault(stage, time.monotonic())
            if stage == "RUNNING_ALLREDUCE":
                self._set_state(PeerState.averaging, publish=True)

        self._set_state(PeerState.matchmaking, publish=True)
        wait_until = time.monotonic() + avg.wait_for_peers
        while True:
            fallback = None
            stage_times.clear()
            try:
                outcome = self.averager.average(
                    weight=float(max(1, self._round_samples)),
                    gather=dict(epoch=start_epoch, samples=self._round_samples),
                    group_bits=epoch_group_bits(start_epoch),
                    timeout=avg.matchmaking_timeout,
                    hard_timeout=avg.matchmaking_timeout + avg.allreduce_timeout + 10,
                    on_stage=on_stage,
                    abort_if=lambda: self._abort_reason(start_epoch),
                )
                epochs = {data.get("epoch") for data in outcome.gathered.values() if isinstance(data, dict)}
                if epochs != {start_epoch}:
                    fallback = f"groupmates were at epochs {sorted(map(str, epochs))}"
                else:
                    group, dropped = outcome.group, outcome.dropped_fraction
                traffic = (outcome.bytes_sent, outcome.bytes_received)
            except RoundAborted as e:
                if e.reason == LEAVING:  # keep the last agreed state: it is what a restart resumes from
                    self._set_state(PeerState.leaving, publish=True)
                    return RoundReport(
                        epoch=start_epoch,
                        averaged=False,
                        group_size=1,
                        fallback_reason=LEAVING,
                        checksum=self.outer.checksum(),
                        seconds=seconds,
                    )
                # our pseudo-gradient is for a round that is over: take the swarm's state
                return self._resync_round(seconds, "the swarm finished this round without us")
            except Exception as e:  # no group, a vanished groupmate, a timeout
                fallback = _short_reason(e)
                # epoch-mates still on their way to step H: wait for them rather than step alone and run
                # ahead of the swarm (a failed attempt leaves our pseudo-gradient untouched)
                if time.monotonic() < wait_until and self._mates_coming(start_epoch) and not self._stop_requested:
                    continue
            break
        t1 = time.monotonic()
        t_allreduce = stage_times.get("RUNNING_ALLREDUCE", t1)
        seconds["matchmaking"] = t_allreduce - t0
        seconds["allreduce"] = t1 - t_allreduce

        if fallback is None:
            with self.averager.get_tensors() as buffers:
                update = [b.clone() for b in buffers]
            if not _all_finite(update):  # a groupmate sent garbage: keep our own update
                fallback, group, update = "groupmates sent non-finite values", (self.peer_id,), pseudo
        if fallback is not None:
            update = pseudo
        self.outer.step(update)
        self.outer.write_to(self.params)
        mine = self.outer.checksum()
        seconds["outer"] = time.monotonic() - t1

        self.stats.rounds += 1
        self._last_round_local = fallback is not None
        if fallback is None:
            self.stats.averaged_rounds += 1
        else:
            self.stats.local_rounds += 1
        report = RoundReport(
            epoch=self.outer.epoch,
            averaged=fallback is None,
            group_size=len(group),
            fallback_reason=fallback,
            dropped_fraction=dropped,
            checksum=mine,
            samples=self._round_samples,
            seconds=seconds,
            bytes_sent=traffic[0],
            bytes_received=traffic[1],
        )
        self._begin_round()
        self._announce_state()
        self._set_state(PeerState.training, publish=True)
        self._emit("round", dict(report=report))

        t2 = time.monotonic()
        self._await_groupmates(group, self.outer.epoch, avg.consistency_timeout)
        why = self._resync_reason(self.outer.epoch)
        if why is not None:
            report.resynced = self._resync(f"after the round: {why}")
            report.checksum = self.outer.checksum()
            report.epoch = self.outer.epoch
        seconds["consistency"] = time.monotonic() - t2
        return report

    def resync_now(self, reason: str) -> bool:
        """Replace our state with the swarm's (e.g. after repeated NaN losses); False if nobody could serve it."""
        return self._resync(reason)

    @property
    def download_progress(self) -> float:
        return self.averager.download_progress if self.averager is not None else 0.0

    def view(self) -> SwarmView:
        entries = read_peers(self.dht, self.run_id)
        return build_view(entries, get_dht_time(), self.manifest.inner_steps, self.manifest.samples_per_step)

    def entries(self) -> list[PeerEntry]:
        """Every live record of the run, including peers that are leaving: for dashboards."""
        return read_peers(self.dht, self.run_id)

    # ---- catching up and staying consistent -----------------------------------------------------

    def _catch_up(self, resumed: bool) -> None:
        """Download the state from the swarm if anyone is training; otherwise start from the seed or checkpoint."""
        view = self._wait_for_view()
        others = [p for p in view.peers if p.peer_id != self.peer_id and p.latest_checksum is not None]
        if not others:
            reason = "resumed from checkpoint" if resumed else "first peer of the run: weights from the manifest seed"
            self._emit("initialized", dict(epoch=self.epoch, reason=reason))
            return
        agreed = consensus(view.peers, view.global_epoch) if view.global_epoch is not None else None
        if resumed and agreed is not None and agreed.epoch == self.epoch and agreed.agrees(self.outer.checksum()):
            self._emit("initialized", dict(epoch=self.epoch, reason="checkpoint agrees with the swarm"))
            return
        self._set_state(PeerState.downloading_state, publish=True)
        if not self._download_consensus_state():
            raise StateDownloadError(
                f"{len(others)} peers of run {self.run_id} are training, but none of them served a verified copy "
                "of the training state. Check that this machine can reach them (firewall, --client-mode), then "
                "start again."
            )

    def _wait_for_view(self) -> SwarmView:
        """Records of other peers can take a moment to become visible to a node that just joined."""
        view = self.view()
        if self.dht.initial_peers:
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and not any(p.peer_id != self.peer_id for p in view.peers):
                time.sleep(0.5)
                view = self.view()
        return view

    def request_stop(self) -> None:
        """Ask a round in progress to stop looking for a group, so a leaving peer is not held up."""
        self._stop_requested = True

    def _abort_reason(self, epoch: int) -> str | None:
        if self._stop_requested:
            return LEAVING
        view = self.view()
        return "moved on" if view.global_epoch is not None and view.global_epoch > epoch else None

    def _mates_coming(self, epoch: int) -> bool:
        """True while other live peers are still working towards the end of ``epoch``."""
        active = (PeerState.training.value, PeerState.matchmaking.value, PeerState.averaging.value)
        view = self.view()
        return any(p.peer_id != self.peer_id and p.epoch == epoch and p.state in active for p in view.peers)

    def _resync_reason(self, epoch: int) -> str | None:
        """Why we must take the swarm's state, or None: the swarm is ahead of us, most peers hold another
        checksum for ``epoch``, or we ran ahead of the swarm on our own (local rounds past the majority)."""
        view = self.view()
        if view.global_epoch is not None and view.global_epoch > epoch:
            return f"behind the swarm (epoch {epoch}, the swarm is at {view.global_epoch})"
        if self._last_round_local and view.global_epoch is not None and view.global_epoch < epoch:
            if any(p.peer_id != self.peer_id and p.epoch == view.global_epoch for p in view.peers):
                return f"ran ahead of the swarm on local rounds (epoch {epoch}, the swarm is at {view.global_epoch})"
        agreed = consensus(view.peers, epoch)
        mine = self.outer.checksum() if self.outer.epoch == epoch else None
        if agreed is not None and mine is not None and not agreed.agrees(mine) and agreed.voters > 1:
            return f"disagreed with the majority's checksum at epoch {epoch}"
        return None

    def _await_groupmates(self, group: Sequence[str], epoch: int, timeout: float) -> None:
        """Give groupmates a moment to publish their checksum for ``epoch`` before comparing."""
        others = set(group) - {self.peer_id}
        deadline = time.monotonic() + timeout
        while others and time.monotonic() < deadline:
            published = {p.peer_id for p in self.view().peers if p.checksum_at(epoch) is not None or p.epoch > epoch}
            if others <= published:
                return
            time.sleep(0.2)

    def _resync_round(self, seconds: dict[str, float], why: str) -> RoundReport:
        t0 = time.monotonic()
        resynced = self._resync(why)
        seconds.update(matchmaking=0.0, allreduce=0.0, outer=0.0, resync=time.monotonic() - t0)
        self._begin_round()
        return RoundReport(
            epoch=self.epoch,
            averaged=False,
            group_size=1,
            fallback_reason=why,
            resynced=resynced,
            checksum=self.outer.checksum(),
            seconds=seconds,
        )

    def _resync(self, why: str) -> bool:
        self._set_state(PeerState.resyncing, publish=True)
        self._emit("resync", dict(reason=why, epoch=self.epoch))
        ok = self._download_consensus_state()
        if ok:
            self.stats.resyncs += 1
            self._last_round_local = False
        self.outer.write_to(self.params)  # whatever happened, the model restarts from the global copy
        self._begin_round()
        self._announce_state()
        self._set_state(PeerState.training, publish=True)
        return ok

    def _download_consensus_state(self) -> bool:
        """Fetch the state held by most peers at the global epoch from one of them, verified by its hash."""
        assert self.outer is not None and self.averager is not None
        avg = self.manifest.averaging
        # nobody should copy a state we are replacing; _announce_state offers ours again afterwards
        self.averager.allow_state_sharing = False
        for attempt in range(DOWNLOAD_ATTEMPTS):
            view = self._view_after_round_if_download_is_too_slow()
            if view.global_epoch is None:
                return False
            agreed = consensus(view.peers, view.global_epoch)
            if agreed is None:
                time.sleep(1.0)
                continue
            donors = [
                p.peer_id
                for p in view.peers
                if p.peer_id in agreed.holders and p.peer_id != self.peer_id and not p.client_mode
            ]
            if not donors:
                return agreed.agrees(self.outer.checksum()) and self.outer.epoch == agreed.epoch
            random.shuffle(donors)  # spread joiners over donors
            for donor in donors:
                if self._download_from(donor, avg.chunk_timeout, avg.allreduce_timeout):
                    return True
            time.sleep(min(5.0, 1.0 * (attempt + 1)))
        return False

    def _view_after_round_if_download_is_too_slow(self) -> SwarmView:
        """On a slow link a download can outlast what is left of the swarm's round; the state would be stale
        on arrival and we would download again, forever. Knowing how fast our last download went, wait for
        the swarm's next round to end and download then: a whole round's time for the transfer, and the
        early-join rule lets us average in that same round."""
        view = self.view()
        if self._download_rate is None or view.global_epoch is None or view.eta_next_round is None:
            return view
        expected = sum(t.numel() * t.element_size() for t in self.outer.tensors()) / self._download_rate
        if expected < MIN_DEFERRED_DOWNLOAD or view.eta_next_round >= expected:
            return view
        avg = self.manifest.averaging
        self._emit("download_deferred", dict(eta=view.eta_next_round, expected=expected))
        epoch, deadline = view.global_epoch, time.monotonic() + view.eta_next_round + avg.matchmaking_timeout
        while time.monotonic() < deadline and not self._stop_requested:
            time.sleep(0.5)
            view = self.view()
            if view.global_epoch is None or view.global_epoch > epoch:
                break
        return view

    def _download_from(self, donor: str, chunk_timeout: float, timeout: float) -> bool:
        self._emit("download_started", dict(donor=donor))
        started = time.monotonic()
        try:
            metadata, tensors = self.averager.download_state(donor, chunk_timeout=chunk_timeout, timeout=timeout)
        except Exception as e:
            self._emit("download_failed", dict(donor=donor, reason=_short_reason(e)))
            return False
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._download_rate = nbytes / max(time.monotonic() - started, 1e-3)  # bytes/s, for timing the next one
        n = len(self.outer.params)
        epoch, claimed = metadata.get("epoch"), metadata.get("checksum")
        if metadata.get("run_id") != self.run_id or not isinstance(epoch, int) or len(tensors) != 2 * n:
            self._emit("download_failed", dict(donor=donor, reason="the state does not belong to this run"))
            return False
        actual = checksum(tensors[:n])
        agreed = consensus(self.view().peers, epoch)
        if actual != claimed or agreed is None or not agreed.agrees(actual):
            self._emit("download_failed", dict(donor=donor, reason="the state failed its checksum"))
            return False
        try:
            self.outer.load(epoch, tensors)
        except ValueError as e:
            self._emit("download_failed", dict(donor=donor, reason=str(e)))
            return False
        self.outer.write_to(self.params)
        self._emit("state_loaded", dict(donor=donor, epoch=epoch, checksum=actual))
        return True

    def _current_state(self) -> tuple:
        epoch, digest, tensors = self.outer.snapshot()
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        metadata = dict(run_id=self.run_id, epoch=epoch, checksum=digest, nbytes=nbytes)
        return metadata, tensors, state_tensor_infos(tensors)

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _begin_round(self) -> None:
        self.inner_step = 0
        self._round_samples = 0
        self._compute_seconds = 0.0
        self._round_started = time.monotonic()

    def _announce_state(self) -> None:
        """Publish our checksum for the current epoch and offer our state to others."""
        self.reporter.add_checksum(self.outer.epoch, self.outer.checksum())
        self.reporter.update(epoch=self.outer.epoch, inner_step=self.inner_step, publish_now=True)
        if not self.client_mode:
            self.averager.allow_state_sharing = True

    def _set_state(self, state: PeerState, publish: bool = False) -> None:
        self.reporter.update(state=state.value, epoch=self.epoch, inner_step=self.inner_step, publish_now=publish)
        self._emit("state", dict(state=state.value))

    def _initial_record(self) -> dict[str, Any]:
        return dict(
            peer_id=self.peer_id,
            name=self.name or self.peer_id[-6:],
            device=self.device,
            epoch=0,
            inner_step=0,
            samples_per_second=0.0,
            tokens_processed=0,
            state=PeerState.starting.value,
            last_loss=None,
            client_mode=self.client_mode,
            relayed=self._relayed(),
            checksums=[],
        )

    def _relayed(self) -> bool:
        """True when others can reach us only through a relay (a /p2p-circuit/ address)."""
        try:
            return any("/p2p-circuit" in str(a) for a in self.dht.get_visible_maddrs())
        except Exception:
            return False

    def _publish_manifest(self) -> None:
        publish_manifest(self.dht, self.manifest)
        self._manifest_published_at = time.monotonic()

    def _on_reporter_tick(self) -> None:
        """Runs on the reporter's thread, so the manifest stays alive even while a round blocks training,
        and others see how far a state download has got."""
        if time.monotonic() - self._manifest_published_at > MANIFEST_TTL / 3:
            self._publish_manifest()
        self.reporter.update(download_progress=min(1.0, max(0.0, self.download_progress)))

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        try:
            self._listener(kind, data)
        except Exception:  # a broken listener must not break training
            logger.exception("swarm event listener failed")


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _short_reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:200]
