"""swarm: DiLoCo training over a Hivemind DHT, for volunteers.

The package has no terminal and no argument parsing; ``client/`` builds the
volunteer's application on top of it.
"""

from swarm.errors import BootstrapError, ManifestError, NetworkConfigError, StateDownloadError, SwarmError
from swarm.init import seeded_init
from swarm.manifest import (
    AveragingSpec,
    DatasetSpec,
    InnerOptimizerSpec,
    OuterOptimizerSpec,
    RunManifest,
    TokenizerSpec,
)
from swarm.network import NetworkConfig, parse_initial_peer, start_dht, visible_maddrs
from swarm.peer import Peer, PeerStats, RoundReport
from swarm.records import PeerState, ProgressRecord
from swarm.registry import choose_run, fetch_manifest, list_runs, publish_manifest
from swarm.swarm_view import Consensus, SwarmView, consensus

__all__ = [
    "AveragingSpec",
    "BootstrapError",
    "Consensus",
    "DatasetSpec",
    "InnerOptimizerSpec",
    "ManifestError",
    "NetworkConfig",
    "NetworkConfigError",
    "OuterOptimizerSpec",
    "Peer",
    "PeerState",
    "PeerStats",
    "ProgressRecord",
    "RoundReport",
    "RunManifest",
    "StateDownloadError",
    "SwarmError",
    "SwarmView",
    "TokenizerSpec",
    "choose_run",
    "consensus",
    "fetch_manifest",
    "list_runs",
    "parse_initial_peer",
    "publish_manifest",
    "seeded_init",
    "start_dht",
    "visible_maddrs",
]
