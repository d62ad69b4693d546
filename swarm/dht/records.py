"""What peers write into the DHT, and the validators that keep it honest.

Every record lives under a subkey holding its author's RSA public key, so
``RSASignatureValidator`` refuses any change not signed by that author, and a
``SchemaValidator`` refuses records of the wrong shape. hivemind's schema
validation is built on pydantic.v1 and compares the parsed value with the raw
one, so every field uses a strict type.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from dataclasses import dataclass

import pydantic.v1 as pv1
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator, conbytes

GLOBAL_PREFIX = "swarm"
RUNS_KEY = f"{GLOBAL_PREFIX}_runs"
_RUN_ID_RE = rb"[0-9a-f]{16}"
RunSubkey = conbytes(regex=_RUN_ID_RE + rb":" + RSASignatureValidator.PUBLIC_KEY_REGEX + rb"$")
CHECKSUM_HISTORY = 8  # a peer replaying up to 7 rounds checks each against the majority
# progress records are spread over 2^L bucket keys so that a read returns about BUCKET_SIZE of them, whatever the
# swarm's size (``bucket_of``, ``read_level``); a run of a few peers keeps them all in the one level-0 key
BUCKET_SIZE = 4
MAX_LEVEL = 8  # 256 buckets: about a thousand peers at BUCKET_SIZE
HEX16 = r"^[0-9a-f]{16}$"
HEX64 = r"^[0-9a-f]{64}$"


class PeerState(enum.StrEnum):
    """What a peer is doing; the dashboard's "why am I idle" reads it."""

    starting = "starting"
    downloading_state = "downloading state"
    training = "training"
    matchmaking = "matchmaking"
    averaging = "averaging"
    merging = "merging"  # its group's average is done; the groups' averages are being combined (two-stage rounds)
    resyncing = "re-syncing"
    leaving = "leaving"
    left = "left"


class ManifestRecord(pv1.BaseModel):
    manifest_json: pv1.StrictStr
    name: pv1.StrictStr
    created_at: pv1.StrictFloat


class EpochChecksum(pv1.BaseModel):
    epoch: pv1.conint(ge=0, strict=True)
    checksum: pv1.constr(strict=True, regex=r"^[0-9a-f]{64}$")


class Accusation(pv1.BaseModel):
    """A groupmate caught as a lying reducer, with its own signed receipt of that round (``swarm.defence.bans``)."""

    accused: pv1.StrictStr
    verdict: pv1.StrictStr
    epoch: pv1.conint(ge=0, strict=True)
    receipt: pv1.conbytes(strict=True, max_length=16384)


class ProgressRecord(pv1.BaseModel):
    """One peer's signed self-report, refreshed every few seconds."""

    peer_id: pv1.StrictStr
    name: pv1.constr(strict=True, max_length=64)
    device: pv1.constr(strict=True, max_length=128)
    epoch: pv1.conint(ge=0, strict=True)
    inner_step: pv1.conint(ge=0, strict=True)
    samples_per_second: pv1.confloat(ge=0.0, strict=True)
    tokens_processed: pv1.conint(ge=0, strict=True)
    state: pv1.StrictStr
    last_loss: pv1.StrictFloat | None
    client_mode: pv1.StrictBool
    relayed: pv1.StrictBool
    micro_batch: pv1.conint(ge=0, strict=True) = 0
    download_progress: pv1.confloat(ge=0.0, le=1.0, strict=True) = 0.0  # while downloading state or re-syncing
    checksums: list[EpochChecksum] = []
    accusations: pv1.conlist(Accusation, max_items=8) = []
    time: pv1.StrictFloat

    @pv1.validator("state")
    def _known_state(cls, value: str) -> str:
        PeerState(value)
        return value

    def checksum_at(self, epoch: int) -> str | None:
        return next((c.checksum for c in self.checksums if c.epoch == epoch), None)

    @property
    def latest_checksum(self) -> EpochChecksum | None:
        return max(self.checksums, key=lambda c: c.epoch) if self.checksums else None


@dataclass(frozen=True)
class PeerEntry:
    """A progress record as read back, with when it expires."""

    record: ProgressRecord
    expiration: float


class GroupRecord(pv1.BaseModel):
    """One round's averaging group, registered by its delegate (``swarm.dht.groups``): the group's average (stage
    one), then the swarm's, once the groups' averages are combined (stage two)."""

    epoch: pv1.conint(ge=0, strict=True)
    group: pv1.constr(strict=True, regex=HEX16)  # a tag of the group id
    delegate: pv1.constr(strict=True, max_length=64)  # the peer id of the member that speaks for the group
    size: pv1.conint(ge=1, le=4096, strict=True)  # members
    weight: pv1.confloat(ge=0.0, strict=True)  # their samples
    digest: pv1.constr(strict=True, regex=HEX64) | None = None  # of the group's average (None: a group of one)
    merged: pv1.constr(strict=True, regex=HEX64) | None = None  # of the swarm's average of the epoch, once made
    included: pv1.conlist(pv1.constr(strict=True, regex=HEX16), max_items=256) = []  # the groups it holds
    client_mode: pv1.StrictBool = False  # the delegate takes no incoming connections: it cannot lead the second stage
    time: pv1.StrictFloat


class GlobalSchema(pv1.BaseModel):
    runs: dict[RunSubkey, ManifestRecord | None]


def _run_schema() -> type[pv1.BaseModel]:
    """The run's keys: the progress records' level-0 key and every bucket key, and the groups key."""
    records = (dict[BytesWithPublicKey, ProgressRecord | None], None)
    buckets = {f"progress_L{level}_{b}": records for level in range(1, MAX_LEVEL + 1) for b in range(1 << level)}
    groups = (dict[BytesWithPublicKey, GroupRecord | None], None)
    return pv1.create_model("RunSchema", __module__=__name__, progress=records, groups=groups, **buckets)


RunSchema = _run_schema()


def run_prefix(run_id: str) -> str:
    return f"{GLOBAL_PREFIX}_{run_id}"


def progress_key(run_id: str, level: int = 0, bucket: int = 0) -> str:
    """The key of one bucket of progress records (level 0: the one key every record goes to)."""
    if level == 0:
        return f"{run_prefix(run_id)}_progress"
    return f"{run_prefix(run_id)}_progress_L{level}_{bucket}"


def groups_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}_groups"


def bucket_of(peer_id: str, level: int) -> int:
    """A peer's bucket at ``level``: the first ``level`` bits of a hash of its id, so a bucket's records split
    between two buckets one level down."""
    if level == 0:
        return 0
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") >> (32 - level)


def read_level(peers: float) -> int:
    """The level whose buckets hold about ``BUCKET_SIZE`` records in a run of ``peers``."""
    if peers <= BUCKET_SIZE:
        return 0
    return min(MAX_LEVEL, math.ceil(math.log2(peers / BUCKET_SIZE)))


def write_levels(level: int) -> range:
    """The levels a peer that reads ``level`` writes its record to: that one and its neighbours, so a reader whose
    count of the run differs by up to a level still finds it. Not all levels: a hivemind store first fetches the
    whole value of its key (``benchmarks/results/dht-scale``), so a write to a key holding every record costs as
    much as reading them all (the level-0 key of a run that outgrew it)."""
    return range(max(0, level - 1), min(MAX_LEVEL, level + 1) + 1)


def run_subkey(run_id: str, public_key: bytes) -> bytes:
    return run_id.encode() + b":" + public_key


def run_id_of_subkey(subkey: bytes) -> str | None:
    match = re.match(_RUN_ID_RE, subkey)
    return match.group(0).decode() if match else None


def global_validators() -> list:
    """Validators every node installs at start: signatures, and the shape of run announcements."""
    return [RSASignatureValidator(), SchemaValidator(GlobalSchema, prefix=GLOBAL_PREFIX)]


class RunValidator(SchemaValidator):
    """The run's schema validator, sent to the DHT process as its run id alone: its table of key ids (one per
    bucket key) is made again there. Pickled whole (20 KB), it reached hivemind's DHT process in pieces that its
    non-blocking pipe read refused (``BlockingIOError``), and the DHT process died."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        super().__init__(RunSchema, prefix=run_prefix(run_id))

    def __reduce__(self):
        return RunValidator, (self.run_id,)


def run_validator(run_id: str) -> SchemaValidator:
    return RunValidator(run_id)
