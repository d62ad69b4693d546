"""What the state and round code may use of the peer it works for, handed to it at start: never the ``Peer`` itself.

``Peer.start`` builds one ``PeerContext`` and gives it to the state download, the checkpoints and the outer round;
none of them holds the peer or writes into it. What they change of the peer's own bookkeeping comes back to it as
return values (a report, whether a re-sync worked) or through the few callables named here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from swarm.averager.process import PseudoGradientAverager
from swarm.dht.peers import SwarmReader
from swarm.dht.records import PeerState
from swarm.events import PeerEvent
from swarm.manifest import RunManifest
from swarm.state.outer import OuterState


@dataclass(frozen=True)
class PeerContext:
    manifest: RunManifest
    me: str  # this peer's id (base58)
    outer: OuterState  # the global model and its momentum: changed only under ``shield``
    params: Sequence[torch.Tensor]  # the model the training loop trains
    averager: PseudoGradientAverager  # its buffers, its rounds, and files to and from other peers
    reader: SwarmReader  # the swarm's records, and the view the rules read
    emit: Callable[[PeerEvent], None]  # tell the program that runs the peer
    set_state: Callable[[PeerState, bool], None]  # what this peer's record says it does (and whether to publish now)
    shield: Callable[[], AbstractContextManager]  # a stop signal waits while the outer state changes under it
    stop_requested: Callable[[], bool]  # the peer is on its way out: downloads and waits give up
