"""How a peer joins the DHT, as the volunteer said it: addresses, port, identity, relays, a closed run's keys.

Built once from the command line (``client.preflight``) and checked where the DHT starts (``swarm.dht.network``).
Importing it does not import hivemind or torch: the client builds it before those imports, in a fraction of a
second.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from swarm.dht.access import RunSecret

DEFAULT_PORT = 31337


class NetworkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    initial_peers: list[str] = Field(default_factory=list)
    host_ip: str = "0.0.0.0"
    # None: DEFAULT_PORT, or the next free port after it; a number: exactly that port; 0: any port (tests)
    host_port: int | None = Field(None, ge=0, le=65535)
    announce_ip: str | None = None
    identity_path: Path | None = None
    client_mode: bool = False
    use_relay: bool = True
    use_auto_relay: bool = False
    startup_timeout: float = 30.0
    secret: RunSecret | None = None  # a closed run's keys (swarm.dht.access); None: an open run
