"""Watching a run without training: for `status`, dashboards and the operator's scripts.

An observer reads the same signed progress records the peers read and applies the
same rules (``swarm_view``), so what it shows is what the peers act on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from swarm.defence.bans import BanReason, accused
from swarm.dht.network import NetworkConfig, start_dht
from swarm.dht.peers import read_peers
from swarm.dht.records import PeerEntry, PeerState, ProgressRecord, run_validator
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


PEERS_LISTED = 100  # entries of a snapshot's "peers", the most useful first (``ranked``); the counts cover every peer
BANNED_LISTED = 10  # entries of "banned", those banned for every peer first
ACCUSERS_LISTED = 8  # peer ids in one banned entry's "by"
EPOCHS_LISTED = 10  # keys of "by_epoch", the most populous epochs; "by_epoch_other" counts the peers at the rest
TEXT_LIMIT = 64  # characters of an accused id or a reason: other peers' accusations say what they like
_ACTIVE = frozenset({PeerState.training.value, PeerState.matchmaking.value, PeerState.averaging.value})


@dataclass(frozen=True)
class Summary:
    """What a long list of peers comes to, in a few numbers (dashboard, ``status``, ``status --json``)."""

    peers: int
    by_state: dict[str, int]  # most common first
    by_epoch: dict[int, int]  # the ``EPOCHS_LISTED`` most populous epochs, most populous (then latest) first
    by_epoch_other: int  # peers at the epochs ``by_epoch`` leaves out
    samples_per_second: float


def summary(peers: Iterable[ProgressRecord]) -> Summary:
    peers = list(peers)
    states = Counter(p.state for p in peers)
    epochs = Counter(p.epoch for p in peers)
    listed = sorted(epochs, key=lambda e: (-epochs[e], -e))[:EPOCHS_LISTED]
    return Summary(
        peers=len(peers),
        by_state=dict(sorted(states.items(), key=lambda item: (-item[1], item[0]))),
        by_epoch={e: epochs[e] for e in listed},
        by_epoch_other=len(peers) - sum(epochs[e] for e in listed),
        samples_per_second=sum(p.samples_per_second for p in peers),
    )


def ranked(peers: Iterable[ProgressRecord], epoch: int | None, banned: Container[str] = ()) -> list[ProgressRecord]:
    """Live peers, those an operator should look at leading: banned by someone; holding a latest checksum that
    fewer peers hold than another of that epoch; off ``epoch`` (the global one), the farthest first; neither
    training nor in a round (downloading state, re-syncing, starting); then the slowest. Ties go by peer id."""
    peers = list(peers)
    votes = Counter((c.epoch, c.checksum) for p in peers for c in p.checksums)
    most: dict[int, int] = {}
    for (at, _), n in votes.items():
        most[at] = max(most.get(at, 0), n)

    def key(p: ProgressRecord) -> tuple:
        latest = p.latest_checksum
        outvoted = latest is not None and votes[(latest.epoch, latest.checksum)] < most[latest.epoch]
        off = abs(p.epoch - epoch) if epoch is not None else 0
        return (p.peer_id not in banned, not outvoted, -off, p.state in _ACTIVE, p.samples_per_second, p.peer_id)

    return sorted(peers, key=key)


def snapshot(manifest: RunManifest, entries: list[PeerEntry]) -> dict[str, Any]:
    """The run as one JSON-able object; its shape is documented and kept stable for scripts, and its size is bounded
    whatever the number of peers and whatever their records say (under 64 KiB as ``status --json`` prints it).

    ``{"run_id", "global_epoch", "peers": [{"peer_id", "name", "epoch", "inner_step", "state",
    "samples_per_second", "checksum": {"epoch", "checksum"} | null, "last_seen"}]}``, where
    ``last_seen`` is the unix time of the peer's latest record. Only live peers are listed, at most
    ``PEERS_LISTED`` (100) of them, the most useful first (``ranked``: banned, outvoted on their checksum, off the
    global epoch, not training, then the slowest). ``"banned": [{"peer_id", "reasons", "by", "epoch", "quorum",
    "proven"}]`` lists the peers a live peer banned (``swarm.defence.bans.accused``): why, who says so, since which
    round, whether a quorum of its groupmates says so (shown, never applied: each peer bans on its own evidence),
    and whether an accusation carries a proof every peer applies; at most ``BANNED_LISTED`` (10) of them, the
    proven first, then those with a quorum and by the most peers, each with at most
    ``ACCUSERS_LISTED`` (8) peer ids in ``by`` and as many reasons as there are ban reasons (6), ids and reasons
    over 64 characters cut.

    The counts cover every live peer: ``"peers_total"`` (live peers), ``"peers_listed"`` (entries of ``peers``),
    ``"by_state": {state: n}``, ``"by_epoch": {"epoch": n}`` (the 10 most populous epochs; ``"by_epoch_other"``
    counts the peers at the others), ``"samples_per_second"`` (the swarm's total), ``"banned_total"``; and
    ``"truncated"`` is true when ``peers``, ``banned`` or a ``by`` holds less than all there is.
    """
    view = view_of(manifest, entries)
    accusations = accused(e.record for e in entries)
    listed = ranked(view.peers, view.global_epoch, accusations)[:PEERS_LISTED]
    peers = []
    for p in listed:
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
    worst = sorted(
        accusations.items(),
        key=lambda item: (not item[1]["proven"], not item[1]["quorum"], -len(item[1]["by"]), item[0]),
    )
    banned = [
        dict(
            peer_id=_clip(peer),
            reasons=[_clip(r) for r in why["reasons"]][: len(BanReason)],
            by=why["by"][:ACCUSERS_LISTED],
            epoch=why["epoch"],
            quorum=why["quorum"],
            proven=why["proven"],
        )
        for peer, why in worst[:BANNED_LISTED]
    ]
    cut = any(
        len(why["by"]) > ACCUSERS_LISTED or len(why["reasons"]) > len(BanReason) for _, why in worst[:BANNED_LISTED]
    )
    counts = summary(view.peers)
    return dict(
        run_id=manifest.run_id,
        global_epoch=view.global_epoch,
        peers_total=counts.peers,
        peers_listed=len(peers),
        truncated=len(peers) < counts.peers or len(banned) < len(accusations) or cut,
        by_state=counts.by_state,
        by_epoch={str(e): n for e, n in counts.by_epoch.items()},
        by_epoch_other=counts.by_epoch_other,
        samples_per_second=round(counts.samples_per_second, 3),
        peers=peers,
        banned_total=len(accusations),
        banned=banned,
    )


def _clip(text: str) -> str:
    return text if len(text) <= TEXT_LIMIT else text[: TEXT_LIMIT - 1] + "…"
