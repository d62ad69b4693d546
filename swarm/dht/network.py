"""Joining the DHT with settings that suit volunteers.

hivemind listens on loopback by default; a volunteer must listen on all
interfaces on a fixed port that can be forwarded, announce a public address when
behind NAT, keep one peer id across restarts, and hear a clear message when a
bootstrap address is wrong or dead.

Several peers on one host (one per GPU) each need their own port. The libp2p
daemon binds with SO_REUSEPORT, so a second daemon on a taken port does not fail:
it silently shares the port and dials reach the wrong process. ``claim_port``
therefore checks a port itself before the daemon starts: a plain bind (which any
listener, SO_REUSEPORT or not, makes fail) and a per-port lock file (which closes
the race between two peers started at the same moment).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import ipaddress
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

import hivemind
from hivemind.utils.multiaddr import Multiaddr

from swarm.dht.authorizer import SecretAuthorizer
from swarm.dht.config import DEFAULT_PORT, NetworkConfig
from swarm.dht.identity import adopt_identity, temporary_identity
from swarm.dht.records import global_validators
from swarm.errors import BootstrapError, HelperError, NetworkConfigError, PortTakenError
from swarm.hivemind_fixes.beam import narrow_searches
from swarm.hivemind_fixes.group_ids import bind_group_ids
from swarm.hivemind_fixes.helpers import start_and_wait
from swarm.hivemind_fixes.locks import free_stuck_locks
from swarm.hivemind_fixes.messages import bound_messages
from swarm.hivemind_fixes.neighbours import keep_neighbours
from swarm.hivemind_fixes.orphans import install_orphan_reaper
from swarm.hivemind_fixes.remote_addrs import keep_remote_addrs
from swarm.hivemind_fixes.requests import tolerate_departed_senders
from swarm.hivemind_fixes.verdicts import remember_verdicts
from swarm.inputs import check_initial_peer, check_ip

PORT_SEARCH = 64  # with the default port, look this far for a free one
logger = logging.getLogger(__name__)


def parse_initial_peer(text: str) -> Multiaddr:
    """Parse one bootstrap multiaddr, or explain what a good one looks like."""
    return check_initial_peer(text, Multiaddr)


def _maddr(ip: str, port: int) -> str:
    family = "ip6" if ipaddress.ip_address(ip).version == 6 else "ip4"
    return f"/{family}/{ip}/tcp/{port}"


@dataclass
class PortClaim:
    """A port this process may listen on, held (by a lock file) until ``release`` or exit."""

    port: int
    requested: int | None  # what was asked for (None: the default)
    _lock: IO | None = None

    @property
    def moved(self) -> bool:
        """True when the default port was taken and another one was chosen."""
        return self.requested is None and self.port != DEFAULT_PORT

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _lock_port(host_ip: str, port: int) -> tuple[bool, IO | None]:
    """(free, lock): an exclusive lock on this port's lock file, shared by every user of the host."""
    folder = Path(tempfile.gettempdir()) / "swarm-ports"
    try:
        folder.mkdir(mode=0o1777, exist_ok=True)
        os.chmod(folder, 0o1777)
    except OSError:
        pass  # made by another user: its mode is already right
    path = folder / f"{host_ip.replace(':', '_')}-{port}.lock"
    try:
        handle = open(path, "a")  # noqa: SIM115 (held open for the life of the peer)
        os.chmod(path, 0o666)
    except OSError:
        try:
            handle = open(path)  # noqa: SIM115 (another user's file: a read-only handle can hold the lock too)
        except OSError:
            return True, None  # no lock files here: the bind check alone decides
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return False, None
    return True, handle


def _bindable(host_ip: str, port: int) -> bool:
    """True if nothing listens on host_ip:port (a listener with SO_REUSEPORT too; TIME_WAIT leftovers do not count)."""
    family = socket.AF_INET6 if ipaddress.ip_address(host_ip).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host_ip, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise NetworkConfigError(f"Cannot listen on {host_ip}:{port}: {e.strerror}.") from None
    return True


def _try_port(host_ip: str, port: int) -> PortClaim | None:
    free, lock = _lock_port(host_ip, port)
    if not free:
        return None
    if not _bindable(host_ip, port):
        if lock is not None:
            lock.close()
        return None
    return PortClaim(port, None, lock)


def claim_port(host_ip: str, requested: int | None) -> PortClaim:
    """The port to listen on: ``requested`` if free (else a clear error), the default or the next free one
    after it when None, anything for 0."""
    host_ip = check_ip(host_ip, "--host-ip")
    if requested == 0:
        return PortClaim(0, 0)
    if requested is not None:
        claim = _try_port(host_ip, requested)
        if claim is None:
            raise PortTakenError(
                f"Port {requested} on {host_ip} is taken (another peer on this machine?). Stop that program, or "
                f"pick a free port with --host-port, or leave --host-port out to take the next free one."
            )
        claim.requested = requested
        return claim
    for port in range(DEFAULT_PORT, DEFAULT_PORT + PORT_SEARCH):
        claim = _try_port(host_ip, port)
        if claim is not None:
            return claim
    raise NetworkConfigError(
        f"Ports {DEFAULT_PORT}-{DEFAULT_PORT + PORT_SEARCH - 1} on {host_ip} are all taken; pick one with --host-port."
    )


def dht_kwargs(config: NetworkConfig, port: int | None = None) -> dict:
    """Translate a NetworkConfig into hivemind.DHT arguments, validating each; ``port`` is the claimed port."""
    initial_peers = [str(parse_initial_peer(p)) for p in config.initial_peers]
    host_ip = check_ip(config.host_ip, "--host-ip")
    port = config.host_port if port is None else port
    if port is None:
        port = DEFAULT_PORT
    kwargs: dict = dict(
        initial_peers=initial_peers,
        host_maddrs=[_maddr(host_ip, port)],
        client_mode=config.client_mode,
        use_relay=config.use_relay,
        use_auto_relay=config.use_auto_relay,
        startup_timeout=config.startup_timeout,
        record_validators=global_validators(),
    )
    if config.secret is not None:
        kwargs["authorizer"] = SecretAuthorizer(config.secret.dht_key)
    if config.announce_ip is not None:
        if port == 0:
            raise NetworkConfigError("--announce-ip needs a fixed --host-port (not 0) so others know where to dial.")
        kwargs["announce_maddrs"] = [_maddr(check_ip(config.announce_ip, "--announce-ip"), port)]
    if config.identity_path is not None:
        path = Path(config.identity_path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        kwargs["identity_path"] = str(path)
    return kwargs


def start_dht(config: NetworkConfig, claim: PortClaim | None = None) -> hivemind.DHT:
    """Start a DHT node, turning hivemind's failures into messages a volunteer can act on.

    Pass the ``claim_port`` result to listen where it said (and to say so first); without one the
    port is claimed here, and the claim is kept on the returned node as ``dht.port_claim``.
    """
    dht_kwargs(config)  # a wrong address fails before any port is claimed
    fresh_key, temporary = False, None
    if not config.client_mode:  # records are signed with the libp2p key: one key, one peer id, one vote
        identity = config.identity_path or temporary_identity()
        temporary = identity.parent if config.identity_path is None else None
        fresh_key = adopt_identity(identity)
        config = config.model_copy(update=dict(identity_path=identity))
    claim = claim or claim_port(config.host_ip, config.host_port)
    kwargs = dht_kwargs(config, claim.port)
    if fresh_key:  # hivemind would start a second daemon to ask the swarm whether a brand-new key is taken
        kwargs["check_if_identity_free"] = False
    install_orphan_reaper()  # the DHT process and its p2pd must not outlive a killed peer
    free_stuck_locks()  # one a dead helper kept would hang this DHT at its first future
    remember_verdicts()  # the DHT process judges each record's bytes once, not once per copy and per read
    narrow_searches()  # and asks the nodes that hold a value, not every node of a 20-wide beam
    keep_neighbours()  # and finds its neighbours again if a stall made it drop them all
    tolerate_departed_senders()  # a request whose sender (the averager, leaving) is gone neither kills nor stalls it
    bound_messages()  # and no stream message is buffered past the longest an honest peer sends
    bind_group_ids()  # and a group leader cannot tell its followers different layouts under one group id
    keep_remote_addrs()  # and a handler knows the network a stream came from (serving shares per network)
    try:
        dht = hivemind.DHT(start=False, **kwargs)
        start_and_wait(dht, "DHT")
        dht.port_claim = claim
        dht.run_secret = config.secret  # the averager's matchmaking and downloads use the same keys
        return dht
    except HelperError:
        claim.release()
        raise
    except Exception as e:
        logger.debug("the DHT failed to start", exc_info=True)
        claim.release()
        text = str(e)
        if kwargs["initial_peers"] and ("bootstrap" in text.lower() or "initial_peers" in text):
            raise BootstrapError(refusal_message(kwargs["initial_peers"], closed=config.secret is not None)) from None
        if "address already in use" in text.lower() or "bind" in text.lower():
            raise NetworkConfigError(
                f"Port {claim.port} on {config.host_ip} is taken. Stop the other peer or pick another --host-port."
            ) from None
        raise NetworkConfigError(f"The peer-to-peer daemon could not start: {text}") from None
    finally:
        if temporary is not None:  # p2pd reads its key once, at its start: gone before a peer can be killed
            shutil.rmtree(temporary, ignore_errors=True)


def _listening(maddr: str, timeout: float = 3.0) -> bool:
    """Whether anything accepts TCP connections at a multiaddr's address (for the bootstrap message)."""
    try:
        parsed = Multiaddr(maddr)
        names = {p.name for p in parsed.protocols()}
        host = next(parsed.value_for_protocol(p) for p in ("ip4", "ip6", "dns4", "dns6", "dns") if p in names)
        port = int(parsed.value_for_protocol("tcp"))
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except Exception:
        logger.debug("probing %s failed", maddr, exc_info=True)
        return False


def refusal_message(initial_peers: Sequence[str], closed: bool) -> str:
    """Why a bootstrap failed, as far as this machine can tell: nobody there, or someone who would not talk."""
    listed = ", ".join(initial_peers)
    if any(_listening(m) for m in initial_peers):
        if closed:
            return (
                f"The initial peers ({listed}) are reachable but refused us. Your --secret-file is not this run's "
                "secret (or the run is open: leave --secret-file out), or the address's /p2p/ id is out of date."
            )
        return (
            f"The initial peers ({listed}) are reachable but refused us. If this run is closed, pass its secret "
            "with --secret-file (or SWARM_SECRET_FILE); otherwise check that the address's /p2p/ id is current "
            "(a restarted peer without --identity gets a new one)."
        )
    return (
        f"None of the initial peers answered ({listed}). Check that the address is current (a restarted peer "
        "without --identity gets a new /p2p/ id), that its port is open, and that this machine can reach it; "
        "then try again."
    )


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """Addresses other peers can join with, loopback last."""
    addrs = [str(a) for a in dht.get_visible_maddrs()]
    return sorted(addrs, key=lambda a: ("/127.0.0.1/" in a or "/::1/" in a, a))


@dataclass(frozen=True)
class PeerProbe:
    """One ping of a peer, asking it to dial us back: for the preflight check."""

    peer_id: str
    responded: bool
    dialed_back: bool  # the peer could open a connection to us: we are directly reachable
    clock_offset: float | None  # the peer's DHT (wall) clock minus ours, in seconds
    round_trip: float | None


def probe_peers(dht: hivemind.DHT, maddrs: Sequence[str], timeout: float = 10.0) -> list[PeerProbe]:
    """Ping each initial peer, asking it to dial back; hivemind's DHT time is wall time, so this also
    measures clock skew, which makes records expire early or late."""
    peer_ids = [parse_initial_peer(m).value_for_protocol("p2p") for m in maddrs]
    try:
        rows = dht.run_coroutine(partial(_probe, peer_ids=peer_ids, timeout=timeout), return_future=True).result(
            timeout=timeout + 5
        )
    except Exception:
        logger.debug("probing the initial peers failed", exc_info=True)
        rows = [(peer_id, False, False, None, None) for peer_id in peer_ids]
    return [PeerProbe(*row) for row in rows]


async def _probe(_dht: hivemind.DHT, node: Any, *, peer_ids: list[str], timeout: float) -> list[tuple]:
    """Runs inside the DHT process."""
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2
    from hivemind.utils import get_dht_time

    rows = []
    for peer_id in peer_ids:
        request = dht_pb2.PingRequest(peer=node.protocol.node_info, validate=True)
        try:
            t0 = get_dht_time()
            stub = node.protocol.get_stub(PeerID.from_base58(peer_id))
            response = await asyncio.wait_for(stub.rpc_ping(request, timeout=timeout), timeout)
            t1 = get_dht_time()
        except Exception:
            rows.append((peer_id, False, False, None, None))
            continue
        offset = response.dht_time - (t0 + t1) / 2 if response.dht_time else None
        rows.append((peer_id, True, bool(response.available), offset, t1 - t0))
    return rows
