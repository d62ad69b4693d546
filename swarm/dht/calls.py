"""DHT reads and writes that never wait forever.

``hivemind.DHT.store`` and ``get`` block until the DHT process answers; if that
process dies (a killed peer's helper, an interpreter shutting down) the caller
would wait forever. Every call here gives up after a timeout instead.
"""

from __future__ import annotations

import logging
from typing import Any

import hivemind

DHT_TIMEOUT = 10.0
logger = logging.getLogger(__name__)


def store(
    dht: hivemind.DHT, key: str, subkey: Any, value: Any, expiration_time: float, timeout: float = DHT_TIMEOUT
) -> bool:
    try:
        future = dht.store(key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)
        return bool(future.result(timeout=timeout))
    except Exception:  # timeout, or a DHT that is shutting down: the record simply is not stored
        logger.debug("DHT store of %s failed", key, exc_info=True)
        return False


def get(dht: hivemind.DHT, key: str, timeout: float = DHT_TIMEOUT) -> Any:
    try:
        return dht.get(key, latest=True, return_future=True).result(timeout=timeout)
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
    stored = True
    for key, future in zip(keys, futures):
        try:
            stored = bool(future.result(timeout=timeout)) and stored
        except Exception:
            logger.debug("DHT store of %s failed", key, exc_info=True)
            stored = False
    return stored
