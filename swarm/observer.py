"""Watching a run without training: for `status`, dashboards and the operator's scripts.

An observer reads the same signed progress records the peers read and applies the
same rules (``swarm_view``), so what it shows is what the peers act on.
"""

from __future__ import annotations

from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from swarm.defence.bans import accused
from swarm.dht.network import NetworkConfig, start_dht
from swarm.dht.peers import read_peers
from swarm.dht.records import PeerEntry, run_validator
from swarm.dht.registry import choose_run
from swarm.dht.view import SwarmView, build_view
from swarm.manifest import RunManifest


class Observer:
    """Reads one run's progress records through a DHT node that trains nothing."""

    def __init__(self, dht: hivemind.DHT, manifest: RunManifest, owns_dht: bool = False):
        self.dht, self.manifest, self._owns_dht = dht, manifest, owns_dht
        self.dht.add_validators([run_validator(manifest.run_id)])

    @classmethod
    def connect(cls, network: NetworkConfig, run_id: str | None = None) -> Observer:
        """Join as a client-mode node (no port to open, never asked to store or average), then pick the run."""
        dht = start_dht(network.model_copy(update=dict(client_mode=True)))
        try:
            return cls(dht, choose_run(dht, run_id), owns_dht=True)
        except BaseException:
            dht.shutdown()
            raise

    def entries(self) -> list[PeerEntry]:
        return read_peers(self.dht, self.manifest.run_id)

    def view(self, entries: list[PeerEntry] | None = None) -> SwarmView:
        return view_of(self.manifest, self.entries() if entries is None else entries)

    def close(self) -> None:
        if self._owns_dht:
            self.dht.shutdown()


def view_of(manifest: RunManifest, entries: list[PeerEntry]) -> SwarmView:
    return build_view(entries, get_dht_time(), manifest.inner_steps, manifest.samples_per_step)


def snapshot(manifest: RunManifest, entries: list[PeerEntry]) -> dict[str, Any]:
    """The run as one JSON-able object; its shape is documented and kept stable for scripts.

    ``{"run_id", "global_epoch", "peers": [{"peer_id", "name", "epoch", "inner_step", "state",
    "samples_per_second", "checksum": {"epoch", "checksum"} | null, "last_seen"}]}``, where
    ``last_seen`` is the unix time of the peer's latest record. Only live peers are listed.
    ``"banned": [{"peer_id", "reasons", "by", "epoch", "quorum"}]`` lists every peer a live peer
    banned (``swarm.defence.bans.accused``): why, who says so, since which round, and whether enough
    of its groupmates say so for every peer to refuse it.
    """
    view = view_of(manifest, entries)
    peers = []
    for p in view.peers:
        latest = p.latest_checksum
        peers.append(
            dict(
                peer_id=p.peer_id,
                name=p.name,
                epoch=p.epoch,
                inner_step=p.inner_step,
                state=p.state,
                samples_per_second=round(p.samples_per_second, 3),
                checksum=dict(epoch=latest.epoch, checksum=latest.checksum) if latest else None,
                last_seen=p.time,
            )
        )
    banned = [dict(peer_id=peer, **why) for peer, why in accused(e.record for e in entries).items()]
    return dict(run_id=manifest.run_id, global_epoch=view.global_epoch, peers=peers, banned=banned)
