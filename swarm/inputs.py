"""What a volunteer types that the engine checks: initial peers' multiaddrs, IP addresses, a closed run's secret file.

Each check says what a good value looks like. Nothing here imports torch or hivemind (seconds), so the client
runs these checks on its command line before it loads either (``client.preflight``); ``swarm.dht.network`` and
``swarm.dht.access`` run the same functions where they build the DHT and the run's keys.
"""

from __future__ import annotations

import functools
import importlib.util
import ipaddress
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.errors import NetworkConfigError, SecretError

MIN_SECRET_BYTES = 16
_LIGHT_MULTIADDR = "_swarm_light_multiaddr"  # the name hivemind's vendored parser is loaded under, beside hivemind


def check_initial_peer(text: str, multiaddr: Callable[[str], Any]) -> Any:
    """Parse one bootstrap multiaddr with ``multiaddr`` (a Multiaddr class), or explain what a good one looks like."""
    try:
        maddr = multiaddr(text.strip())
    except Exception as e:  # hivemind's multiaddr raises several unrelated types
        raise NetworkConfigError(
            f"'{text}' is not a valid multiaddr ({e}). An initial peer looks like "
            "/ip4/203.0.113.5/tcp/31337/p2p/QmPeerId...: copy it exactly from the line the run's first peer printed."
        ) from None
    if "p2p" not in [p.name for p in maddr.protocols()]:
        raise NetworkConfigError(
            f"'{text}' has no /p2p/<peer id> part, so the peer behind it cannot be verified. "
            "Copy the full address, ending in /p2p/Qm..., from the line the run's first peer printed."
        )
    return maddr


@functools.cache
def light_multiaddr() -> Callable[[str], Any] | None:
    """hivemind's own Multiaddr class (hivemind/utils/multiaddr, its copy of py-multiaddr), loaded from its files
    without running ``import hivemind``, which imports torch. None where this hivemind keeps no copy there: then
    only ``swarm.dht.network`` checks the addresses (a test checks that the pinned hivemind has it)."""
    hivemind = importlib.util.find_spec("hivemind")  # locates the package without importing it
    if hivemind is None or not hivemind.submodule_search_locations:
        return None
    folder = Path(next(iter(hivemind.submodule_search_locations))) / "utils" / "multiaddr"
    if not (folder / "__init__.py").is_file():
        return None
    spec = importlib.util.spec_from_file_location(
        _LIGHT_MULTIADDR, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[_LIGHT_MULTIADDR] = module  # its relative imports (the codecs) resolve through this entry
    spec.loader.exec_module(module)
    return module.Multiaddr


def check_ip(value: str, what: str) -> str:
    """``value`` as a normalized IPv4 or IPv6 address; ``what`` names the flag in the message."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise NetworkConfigError(f"{what} '{value}' is not an IPv4 or IPv6 address.") from None


def read_secret_file(path: Path) -> bytes:
    """A closed run's secret (surrounding whitespace ignored), or say plainly what is wrong with the file."""
    path = Path(path).expanduser()
    try:
        data = path.read_bytes().strip()
    except OSError as e:
        raise SecretError(f"Cannot read the secret file {path}: {e.strerror}.") from None
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(
            f"The secret in {path} is {len(data)} bytes; a run's secret needs at least {MIN_SECRET_BYTES}. "
            "Make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE"
        )
    return data
