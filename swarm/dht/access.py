"""Closed runs: only peers holding the run's secret take part.

A closed run is one whose peers were started with the same secret (``--secret-file``).
Nothing of the secret leaves the machine; four keys are derived from it (HMAC-SHA256):

- the **access tag**, written into the manifest (``RunManifest.access``): the run id
  is the manifest's hash, so the same manifest under two secrets is two runs, and a
  joiner holding another secret sees at once that the run is not its own;
- the **DHT key**: every DHT request and response carries an HMAC of its bytes under
  it (``SecretAuthorizer``, hivemind's authorizer hook), with a time and a nonce
  against replays. A node without the key gets no answer to anything, so an outsider
  cannot bootstrap, read a record, or see the swarm view; nor can an insider be fed
  records by an outsider;
- the **matchmaking key**: the averager's schema hash (which a leader compares with
  each join request's) is an HMAC under it, so an outsider's join request is refused;
  the all-reduce stream needs the group id that only accepted groupmates are told;
- the **transfer key**: a state or replay download carries an HMAC of the requester's
  and the donor's libp2p ids (libp2p authenticates both ends), checked by the donor.

Open runs (no secret) are the default and behave exactly as before.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hivemind.utils.auth import AuthorizerBase

from swarm.errors import SecretError
from swarm.inputs import MIN_SECRET_BYTES as MIN_SECRET_BYTES  # re-exported: the secret's rules live there
from swarm.inputs import read_secret_file

MAX_CLOCK_SKEW = 600.0  # seconds: a signed DHT request older or newer than this is refused
TAG_LENGTH = 32


def _derive(secret: bytes, purpose: str) -> bytes:
    return hmac.new(secret, f"swarm/{purpose}".encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class RunSecret:
    """The keys derived from a run's secret (the secret itself is not kept)."""

    tag: str
    dht_key: bytes = field(repr=False)
    schema_key: bytes = field(repr=False)
    transfer_key: bytes = field(repr=False)

    @classmethod
    def from_bytes(cls, secret: bytes) -> RunSecret:
        return cls(
            tag=_derive(secret, "access-tag").hex()[:TAG_LENGTH],
            dht_key=_derive(secret, "dht"),
            schema_key=_derive(secret, "matchmaking"),
            transfer_key=_derive(secret, "transfer"),
        )

    @classmethod
    def from_file(cls, path: Path) -> RunSecret:
        """Read a secret file (surrounding whitespace ignored), or say plainly what is wrong with it."""
        return cls.from_bytes(read_secret_file(path))

    def schema_hash(self, plain: bytes) -> bytes:
        return hmac.new(self.schema_key, plain, hashlib.sha256).digest()

    def transfer_token(self, requester: bytes, donor: bytes) -> bytes:
        return hmac.new(self.transfer_key, b"download|" + requester + b"|" + donor, hashlib.sha256).digest()

    def transfer_token_ok(self, token: bytes, requester: bytes, donor: bytes) -> bool:
        return hmac.compare_digest(token, self.transfer_token(requester, donor))


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


def check_access(run_id: str, access: str | None, secret: RunSecret | None) -> None:
    """Raise SecretError unless this peer's secret (or its lack of one) fits the run's manifest."""
    if access is None and secret is not None:
        raise SecretError(f"Run {run_id} is open (it has no secret); leave --secret-file out to join it.")
    if access is not None and secret is None:
        raise SecretError(f"Run {run_id} is closed: pass its secret with --secret-file (or SWARM_SECRET_FILE).")
    if access is not None and not hmac.compare_digest(access, secret.tag):
        raise SecretError(f"Your --secret-file holds another secret than run {run_id}'s; ask its operator for it.")
