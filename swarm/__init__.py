"""swarm: DiLoCo training over a Hivemind DHT, for volunteers.

The package has no terminal and no argument parsing; ``client/`` builds the
volunteer's application on top of it. Names are imported on first use, so a tool
that needs only ``swarm.errors`` or ``swarm.manifest`` (the health check) does not
pay for torch and hivemind.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "swarm.errors": [
        "BootstrapError",
        "LeaveRequested",
        "ManifestError",
        "NetworkConfigError",
        "PortTakenError",
        "SecretError",
        "StateDownloadError",
        "SwarmError",
    ],
    "swarm.dht.access": ["RunSecret"],
    "swarm.seeding": ["seeded_init"],
    "swarm.manifest": [
        "AveragingSpec",
        "DatasetSpec",
        "InnerOptimizerSpec",
        "OuterOptimizerSpec",
        "RunManifest",
        "TokenizerSpec",
    ],
    "swarm.dht.config": ["NetworkConfig"],
    "swarm.dht.network": ["claim_port", "parse_initial_peer", "start_dht", "visible_maddrs"],
    "swarm.peer": ["Peer"],
    "swarm.events": ["PeerEvent", "PeerStats", "RoundOutcome", "RoundReport"],
    "swarm.dht.records": ["PeerState", "ProgressRecord"],
    "swarm.dht.registry": ["choose_run", "fetch_manifest", "list_runs", "publish_manifest"],
    "swarm.dht.view": ["Consensus", "SwarmView", "consensus"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "AveragingSpec",
    "BootstrapError",
    "Consensus",
    "DatasetSpec",
    "InnerOptimizerSpec",
    "LeaveRequested",
    "ManifestError",
    "NetworkConfig",
    "NetworkConfigError",
    "OuterOptimizerSpec",
    "Peer",
    "PeerEvent",
    "PeerState",
    "PeerStats",
    "PortTakenError",
    "ProgressRecord",
    "RoundOutcome",
    "RoundReport",
    "RunManifest",
    "RunSecret",
    "SecretError",
    "StateDownloadError",
    "SwarmError",
    "SwarmView",
    "TokenizerSpec",
    "choose_run",
    "claim_port",
    "consensus",
    "fetch_manifest",
    "list_runs",
    "parse_initial_peer",
    "publish_manifest",
    "seeded_init",
    "start_dht",
    "visible_maddrs",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'swarm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from swarm.dht.access import RunSecret
    from swarm.dht.config import NetworkConfig
    from swarm.dht.network import claim_port, parse_initial_peer, start_dht, visible_maddrs
    from swarm.dht.records import PeerState, ProgressRecord
    from swarm.dht.registry import choose_run, fetch_manifest, list_runs, publish_manifest
    from swarm.dht.view import Consensus, SwarmView, consensus
    from swarm.errors import (
        BootstrapError,
        LeaveRequested,
        ManifestError,
        NetworkConfigError,
        PortTakenError,
        SecretError,
        StateDownloadError,
        SwarmError,
    )
    from swarm.events import PeerEvent, PeerStats, RoundOutcome, RoundReport
    from swarm.manifest import (
        AveragingSpec,
        DatasetSpec,
        InnerOptimizerSpec,
        OuterOptimizerSpec,
        RunManifest,
        TokenizerSpec,
    )
    from swarm.peer import Peer
    from swarm.seeding import seeded_init
