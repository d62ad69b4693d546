"""What peers write into the DHT, and the validators that keep it honest.

Every record lives under a subkey holding its author's RSA public key, so
``RSASignatureValidator`` refuses any change not signed by that author, and a
``SchemaValidator`` refuses records of the wrong shape. hivemind's schema
validation is built on pydantic.v1 and compares the parsed value with the raw
one, so every field uses a strict type.
"""

from __future__ import annotations

import enum
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


class PeerState(enum.StrEnum):
    """What a peer is doing; the dashboard's "why am I idle" reads it."""

    starting = "starting"
    downloading_state = "downloading state"
    training = "training"
    matchmaking = "matchmaking"
    averaging = "averaging"
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


class GlobalSchema(pv1.BaseModel):
    runs: dict[RunSubkey, ManifestRecord | None]


class RunSchema(pv1.BaseModel):
    progress: dict[BytesWithPublicKey, ProgressRecord | None]


def run_prefix(run_id: str) -> str:
    return f"{GLOBAL_PREFIX}_{run_id}"


def progress_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}_progress"


def run_subkey(run_id: str, public_key: bytes) -> bytes:
    return run_id.encode() + b":" + public_key


def run_id_of_subkey(subkey: bytes) -> str | None:
    match = re.match(_RUN_ID_RE, subkey)
    return match.group(0).decode() if match else None


def global_validators() -> list:
    """Validators every node installs at start: signatures, and the shape of run announcements."""
    return [RSASignatureValidator(), SchemaValidator(GlobalSchema, prefix=GLOBAL_PREFIX)]


def run_validator(run_id: str) -> SchemaValidator:
    return SchemaValidator(RunSchema, prefix=run_prefix(run_id))
