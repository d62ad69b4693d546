"""One key, one vote: a peer's records are signed with its libp2p identity key.

hivemind signs DHT records with ``RSAPrivateKey.process_wide()`` and puts the
public key in the record's subkey (``[owner:ssh-rsa ...]``); its validator refuses a
change not signed with that key. On its own that proves who wrote a record, not
that the ``peer_id`` inside it is the writer's. Here the process-wide key *is* the
peer's libp2p identity key (``identity.key``; a temporary one when none is given),
so the peer id is a function of the signing key (libp2p: the multihash of the
public key), and a reader drops any record whose ``peer_id`` is not the one its
subkey's key gives. Nobody can pose as another peer, nor as several with one key;
the votes (global epoch, checksum consensus) count records, which are now keys.
A new key is still free to make: one machine can run many peers (Sybil), each
paying for its own compute and identity.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import tempfile
from pathlib import Path

import base58
import multihash
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

logger = logging.getLogger(__name__)

_OWNER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)


def adopt_identity(path: Path) -> bool:
    """Make the libp2p identity key at ``path`` the key this process signs DHT records with, creating the file
    if needed (True then: a new key, which nobody else can be using); call before the DHT starts, so its
    validators and every record's subkey use it."""
    path = Path(path).expanduser()
    created = not path.exists()
    if created:
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    key = identity_key(path)
    with RSAPrivateKey._process_wide_key_lock:
        RSAPrivateKey._process_wide_key = key
    return created


def identity_key(path: Path) -> RSAPrivateKey:
    """The RSA key in a libp2p identity file (as ``P2P.generate_identity`` writes it)."""
    data = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes()).data
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = serialization.load_der_private_key(data, password=None)
    return key


def temporary_identity() -> Path:
    """An identity file for a peer that was given none (it gets a new peer id each start)."""
    folder = Path(tempfile.mkdtemp(prefix="swarm-identity-"))  # start_dht removes it once p2pd has read the key
    return folder / "identity.key"


@functools.lru_cache(maxsize=4096)
def peer_id_of_owner(subkey: bytes) -> str | None:
    """The libp2p peer id (base58) of the RSA key in an ``[owner:...]`` subkey; None if there is none."""
    found = _OWNER.search(subkey) if isinstance(subkey, bytes) else None
    if found is None:
        return None
    try:
        public = serialization.load_ssh_public_key(found.group(1))
    except (ValueError, TypeError, UnsupportedAlgorithm):  # not a key, or of a kind (curve) this library lacks
        logger.debug("a subkey's owner is not a public key", exc_info=True)
        return None
    if not isinstance(public, rsa.RSAPublicKey):
        return None
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()
