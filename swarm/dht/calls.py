"""DHT reads and writes that never wait forever.

``hivemind.DHT.store`` and ``get`` block until the DHT process answers; if that
process dies (a killed peer's helper, an interpreter shutting down) the caller
would wait forever. Every call here gives up after a timeout instead, and at once (within ``SLICE``) when the
caller is the DHT process's parent and sees it has ended: a peer whose DHT died then leaves without waiting out
each goodbye's timeout.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Any

import hivemind

DHT_TIMEOUT = 10.0
SLICE = 0.25  # seconds between two looks at whether the DHT process still runs, while a call waits
logger = logging.getLogger(__name__)


class DHTGone(RuntimeError):
    """The DHT process has ended: no answer will come."""


def ended(dht: hivemind.DHT) -> bool:
    """Whether the DHT process has ended, as its parent sees it (other processes cannot tell: False)."""
    if getattr(dht, "_parent_pid", None) != os.getpid():
        return False
    try:
        return dht.exitcode is not None
    except (AssertionError, ValueError):  # not our child after all, or closed
        return False


def _result(dht: hivemind.DHT, future: Any, timeout: float) -> Any:
    """``future.result(timeout)``, cut short when the DHT process ends meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        if ended(dht):
            raise DHTGone(f"the DHT process ended (exit code {dht.exitcode})")
        left = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.0, min(SLICE, left)))
        except concurrent.futures.TimeoutError:
            if left <= SLICE:
                raise


def store(
    dht: hivemind.DHT, key: str, subkey: Any, value: Any, expiration_time: float, timeout: float = DHT_TIMEOUT
) -> bool:
    try:
        future = dht.store(key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)
        return bool(_result(dht, future, timeout))
    except Exception:  # timeout, or a DHT that is shutting down: the record simply is not stored
        logger.debug("DHT store of %s failed", key, exc_info=True)
        return False


def get(dht: hivemind.DHT, key: str, timeout: float = DHT_TIMEOUT) -> Any:
    try:
        return _result(dht, dht.get(key, latest=True, return_future=True), timeout)
    except Exception:
        logger.debug("DHT get of %s failed", key, exc_info=True)
        return None


def store_many(
    dht: hivemind.DHT, keys: list[str], subkey: Any, value: Any, expiration_time: float, timeout: float = DHT_TIMEOUT
) -> bool:
    """The same value under several keys at once (the futures run side by side); True if every store took."""
    try:
        futures = [
            dht.store(key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)
            for key in keys
        ]
    except Exception:
        logger.debug("DHT stores of %s failed to start", keys, exc_info=True)
        return False
    stored, deadline = True, time.monotonic() + timeout
    for key, future in zip(keys, futures):
        try:
            stored = bool(_result(dht, future, max(0.0, deadline - time.monotonic()))) and stored
        except Exception:
            logger.debug("DHT store of %s failed", key, exc_info=True)
            stored = False
    return stored
