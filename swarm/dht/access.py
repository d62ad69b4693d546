"""Closed runs: only peers holding the run's secret take part.

A closed run is one whose peers were started with the same secret (``--secret-file``).
Nothing of the secret leaves the machine; four keys are derived from it (HMAC-SHA256):

- the **access tag**, written into the manifest (``RunManifest.access``): the run id
  is the manifest's hash, so the same manifest under two secrets is two runs, and a
  joiner holding another secret sees at once that the run is not its own;
- the **DHT key**: every DHT request and response carries an HMAC of its bytes under
  it (``SecretAuthorizer``, hivemind's authorizer hook), with a time and a nonce
  against replays (``swarm.dht.authorizer``). A node without the key gets no answer to anything, so an outsider
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
from dataclasses import dataclass, field
from pathlib import Path

from swarm.errors import SecretError
from swarm.inputs import MIN_SECRET_BYTES as MIN_SECRET_BYTES  # re-exported: the secret's rules live there
from swarm.inputs import read_secret_file

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


def check_access(run_id: str, access: str | None, secret: RunSecret | None) -> None:
    """Raise SecretError unless this peer's secret (or its lack of one) fits the run's manifest."""
    if access is None and secret is not None:
        raise SecretError(f"Run {run_id} is open (it has no secret); leave --secret-file out to join it.")
    if access is not None and secret is None:
        raise SecretError(f"Run {run_id} is closed: pass its secret with --secret-file (or SWARM_SECRET_FILE).")
    if access is not None and not hmac.compare_digest(access, secret.tag):
        raise SecretError(f"Your --secret-file holds another secret than run {run_id}'s; ask its operator for it.")
