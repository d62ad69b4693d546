"""A closed run's DHT: every request and response carries an HMAC under the run's DHT key (``swarm.dht.access``),
through hivemind's authorizer hook, with a time and a nonce against replays."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any

from hivemind.utils.auth import AuthorizerBase

MAX_CLOCK_SKEW = 600.0  # seconds: a signed DHT request older or newer than this is refused


def _mac(key: bytes, message: Any) -> bytes:
    return hmac.new(key, message.SerializeToString(deterministic=True), hashlib.sha256).digest()


class SecretAuthorizer(AuthorizerBase):
    """hivemind's authorizer hook for the DHT: requests and responses are HMAC'd with the run's DHT key.

    A request is signed over its bytes with ``auth.signature`` empty, after setting ``auth.time`` and a
    fresh ``auth.nonce``; the servicer refuses a bad MAC, a time off by more than ``MAX_CLOCK_SKEW`` or a
    nonce it saw recently. A response is signed over its bytes with the request's nonce in it.
    """

    def __init__(self, key: bytes):
        self._key = key
        self._seen: dict[bytes, float] = {}

    async def sign_request(self, request: Any, service_public_key: Any) -> None:
        auth = request.auth
        auth.time = time.time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = _mac(self._key, request)

    async def validate_request(self, request: Any) -> bool:
        auth = request.auth
        signature = auth.signature
        auth.signature = b""
        expected = _mac(self._key, request)
        auth.signature = signature
        if not hmac.compare_digest(signature, expected):
            return False
        now = time.time()
        if abs(now - auth.time) > MAX_CLOCK_SKEW or auth.nonce in self._seen:
            return False
        if len(self._seen) > 100_000:
            self._seen = {n: t for n, t in self._seen.items() if now - t < 2 * MAX_CLOCK_SKEW}
        self._seen[auth.nonce] = now
        return True

    async def sign_response(self, response: Any, request: Any) -> None:
        if response is None:
            return
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = _mac(self._key, response)

    async def validate_response(self, response: Any, request: Any) -> bool:
        if response is None:
            return False
        auth = response.auth
        if not hmac.compare_digest(auth.nonce, request.auth.nonce):
            return False
        signature = auth.signature
        auth.signature = b""
        expected = _mac(self._key, response)
        auth.signature = signature
        return hmac.compare_digest(signature, expected)
