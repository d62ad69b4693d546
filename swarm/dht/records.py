"""What peers write into the DHT, and the validators that keep it honest.

Every record lives under a subkey holding its author's RSA public key, so
``RSASignatureValidator`` refuses any change not signed by that author, and a
``SchemaValidator`` refuses records of the wrong shape. hivemind's schema
validation is built on pydantic.v1 and compares the parsed value with the raw
one, so every field uses a strict type.

Every field is bounded (strings by length and alphabet, lists by count, numbers to finite values in a sane range),
so a record an honest node accepts is small; the DHT nodes run these validators on store and on get. A record's
lifetime is bounded too, on read (``fresh``): one whose expiration lies further ahead than its writer could have set
it is refused, so a key cannot keep a record (and its votes) alive long after its process is gone.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic.v1 as pv1
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator, conbytes
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

logger = logging.getLogger(__name__)

GLOBAL_PREFIX = "swarm"
RUNS_KEY = f"{GLOBAL_PREFIX}_runs"
_RUN_ID_RE = rb"[0-9a-f]{16}"
MAX_SUBKEY = 2048  # bytes: "[owner:ssh-rsa ...]" of an RSA key up to 8192 bits (hivemind's and libp2p's: 2048)
RunSubkey = conbytes(regex=_RUN_ID_RE + rb":" + RSASignatureValidator.PUBLIC_KEY_REGEX + rb"\Z", max_length=MAX_SUBKEY)
OwnerSubkey = conbytes(regex=b".*" + RSASignatureValidator.PUBLIC_KEY_REGEX + b".*", max_length=MAX_SUBKEY)
CHECKSUM_HISTORY = 8  # a peer replaying up to 7 rounds checks each against the majority
MAX_ACCUSATIONS = 8  # in one progress record (``swarm.defence.bans`` keeps its newest 8)
# progress records are spread over 2^L bucket keys so that a read returns about BUCKET_SIZE of them, whatever the
# swarm's size (``bucket_of``, ``read_level``); a run of a few peers keeps them all in the one level-0 key
BUCKET_SIZE = 4
MAX_LEVEL = 8  # 256 buckets: about a thousand peers at BUCKET_SIZE
# group records go to the groups key (delegates read it whole, to make the roster) and to one of 2^GROUP_BITS bucket
# keys by their tag (``group_bucket_key``), which the group's members read while they wait for the swarm's average
GROUP_BITS = 8
MAX_GROUP, MAX_GROUPS = 4096, 256  # members of a group; groups in a swarm's average or a roster
HEX16 = r"^[0-9a-f]{16}\Z"  # \Z, not $: a regex's $ also matches before a final newline
HEX64 = r"^[0-9a-f]{64}\Z"
# a libp2p peer id in base58 is at most about 61 characters (sha2-256 multihash: 46, "Qm..."; identity multihash of
# an ed25519 key: 52, "12D3KooW..."); letters and digits, not strictly base58, so that tests and the simulator may
# name peers "peer001" (a reader keeps a record only if its id is the one its signing key gives: ``peers``)
PEER_ID = r"^[0-9A-Za-z]{1,64}\Z"
TEXT = r"^[^\x00-\x1f\x7f-\x9f]*\Z"  # no control characters (C0, DEL, C1): a name is printed on others' terminals
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
MAX_COUNT = 2**40  # epochs, steps: a peer doing a round a second for 30,000 years stays below
MAX_TOKENS = 2**62  # msgpack's integers end at 2**64
MAX_TIME = 2.0**40  # seconds since the epoch: the year 36,800
MAX_RATE = 1e12  # samples per second
MAX_NAME, MAX_DEVICE = 64, 128  # characters of a peer's display name and of its device's
MAX_MANIFEST_JSON = 65536  # characters: a manifest holds a transformers config (a few KB)

# seconds a record lives, as its writer stores it (``presence``, ``groups``, ``registry``), and the slack a reader
# allows on top for clock skew: the writer's clock sets the expiration, so a writer ahead of the reader by d seconds
# gives a record that looks d seconds longer-lived. hivemind calls DHT clocks more than 3 s apart out of sync
# (``MAX_DHT_TIME_DISCREPANCY_SECONDS``; ``swarm-client doctor`` fails above 3 s); 10 s lets an honest peer with a
# clock thrice that far off be seen, while a dead peer's progress record still lives at most 25 s
RECORD_TTL = 15.0  # progress records, refreshed every few seconds
GROUP_TTL = 600.0  # seconds a group's record lives: past the round, for peers that replay it
MANIFEST_TTL = 120.0  # manifests, republished every MANIFEST_TTL / 3
EXPIRY_SLACK = 10.0

_Count = pv1.conint(ge=0, le=MAX_COUNT, strict=True)
_Time = pv1.confloat(ge=0.0, le=MAX_TIME, strict=True, allow_inf_nan=False)
_Fraction = pv1.confloat(ge=0.0, le=1.0, strict=True, allow_inf_nan=False)
PeerId = pv1.constr(strict=True, regex=PEER_ID)
Checksum = pv1.constr(strict=True, regex=HEX64)
Tag = pv1.constr(strict=True, regex=HEX16)


def fresh(expiration: Any, now: float, ttl: float) -> bool:
    """Whether a record read back with ``expiration`` is kept: a finite time, not past, and no further ahead than
    its writer could have set it (``ttl``, plus ``EXPIRY_SLACK`` for clock skew). One set further ahead is refused,
    not clamped: a clamp is applied again at every read, and the record would never expire."""
    if isinstance(expiration, bool) or not isinstance(expiration, (int, float)) or not math.isfinite(expiration):
        return False
    return now <= expiration <= now + ttl + EXPIRY_SLACK


def live_items(found: Any, now: float, ttl: float) -> list[tuple[Any, Any, float]]:
    """(subkey, value, expiration) of every fresh record in what a DHT read of a key with subkeys returned (None:
    nothing; anything else that is not hivemind's dictionary of values with expirations: nothing either)."""
    items = getattr(found, "value", None)
    if not isinstance(items, dict):
        return []
    kept = []
    for subkey, item in items.items():
        value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", None)
        if value is not None and fresh(expiration, now, ttl):
            kept.append((subkey, value, expiration))
    return kept


Model = TypeVar("Model", bound=pv1.BaseModel)


def parse_record(model: type[Model], value: Any) -> Model | None:
    """``value`` as a ``model``, or None if it is not one (logged at debug level: others' malformed records)."""
    try:
        return model.parse_obj(value)
    except (ValueError, TypeError):  # TypeError: a dict whose keys are not strings
        logger.debug("refused a malformed %s", model.__name__, exc_info=True)
        return None


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


class AccusationVerdict(enum.StrEnum):
    """Why an accusation's author banned the accused: the values of ``swarm.defence.bans.BanReason``, which reads
    these records (so this layer cannot import it); ``tests/test_records_fuzz.py`` keeps the two equal."""

    wrong_average = "wrong average"
    equivocated = "equivocated"
    unanswered = "did not answer its audit"
    withheld = "withheld its own parts"
    forged = "forged a sender's digest or weight"
    false_accusation = "false accusation"
    malformed = "sent malformed parts"


class ManifestRecord(pv1.BaseModel):
    manifest_json: pv1.constr(strict=True, max_length=MAX_MANIFEST_JSON)
    name: pv1.constr(strict=True, min_length=1, max_length=MAX_NAME, regex=TEXT)  # the manifest's name
    created_at: _Time


class EpochChecksum(pv1.BaseModel):
    epoch: _Count
    checksum: Checksum


class Accusation(pv1.BaseModel):
    """A groupmate caught as a lying reducer, with its own signed receipt of that round (``swarm.defence.bans``)."""

    accused: PeerId
    verdict: pv1.StrictStr  # an ``AccusationVerdict``'s value
    epoch: _Count
    receipt: pv1.conbytes(strict=True, max_length=16384)

    @pv1.validator("verdict")
    def _known_verdict(cls, value: str) -> str:
        AccusationVerdict(value)
        return value


class ProgressRecord(pv1.BaseModel):
    """One peer's signed self-report, refreshed every few seconds."""

    peer_id: PeerId
    name: pv1.constr(strict=True, max_length=MAX_NAME, regex=TEXT)
    device: pv1.constr(strict=True, max_length=MAX_DEVICE, regex=TEXT)
    epoch: _Count
    inner_step: _Count
    samples_per_second: pv1.confloat(ge=0.0, le=MAX_RATE, strict=True, allow_inf_nan=False)
    tokens_processed: pv1.conint(ge=0, le=MAX_TOKENS, strict=True)
    state: pv1.StrictStr  # a ``PeerState``'s value
    last_loss: pv1.confloat(strict=True, allow_inf_nan=False) | None  # finite (``presence`` publishes others as None)
    client_mode: pv1.StrictBool
    relayed: pv1.StrictBool
    micro_batch: _Count = 0
    download_progress: _Fraction = 0.0  # while downloading state or re-syncing
    checksums: pv1.conlist(EpochChecksum, max_items=CHECKSUM_HISTORY) = []
    accusations: pv1.conlist(Accusation, max_items=MAX_ACCUSATIONS) = []
    time: _Time

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

    epoch: _Count
    group: Tag  # a tag of the group id
    delegate: PeerId  # the peer id of the member that speaks for the group
    size: pv1.conint(ge=1, le=MAX_GROUP, strict=True)  # members
    weight: pv1.confloat(ge=0.0, le=MAX_TOKENS, strict=True, allow_inf_nan=False)  # their samples
    digest: Checksum | None = None  # of the group's average (None: a group of one)
    merged: Checksum | None = None  # of the swarm's average of the epoch, once made
    included: pv1.conlist(Tag, max_items=MAX_GROUPS) = []  # the groups it holds
    peers: pv1.conint(ge=0, le=MAX_GROUP * MAX_GROUPS, strict=True) = 0  # the peers whose work it holds (0: not said)
    client_mode: pv1.StrictBool = False  # the delegate takes no incoming connections: it cannot lead the second stage
    roster: pv1.conlist(Tag, max_items=MAX_GROUPS) = []  # written by one delegate: the groups whose delegates merge
    time: _Time


class GlobalSchema(pv1.BaseModel):
    runs: dict[RunSubkey, ManifestRecord | None]


def _one_key(name: str, record: type[pv1.BaseModel]) -> type[pv1.BaseModel]:
    """A schema of one key's records: subkeys that hold an owner's public key, each a ``record`` (or None: deleted)."""
    model = pv1.create_model(name, __module__=__name__, records=(dict[OwnerSubkey, record | None], None))
    model.Config.extra = pv1.Extra.forbid
    return model


ProgressKeySchema = _one_key("ProgressKeySchema", ProgressRecord)
GroupsKeySchema = _one_key("GroupsKeySchema", GroupRecord)


def run_prefix(run_id: str) -> str:
    return f"{GLOBAL_PREFIX}_{run_id}"


def progress_key(run_id: str, level: int = 0, bucket: int = 0) -> str:
    """The key of one bucket of progress records (level 0: the one key every record goes to)."""
    if level == 0:
        return f"{run_prefix(run_id)}_progress"
    return f"{run_prefix(run_id)}_progress_L{level}_{bucket}"


def groups_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}_groups"


def group_bucket_key(run_id: str, tag: str) -> str:
    """The bucket key of a group's records: the first ``GROUP_BITS`` bits of its tag (a hash), so a bucket holds
    about groups / 2^GROUP_BITS of a round's records."""
    return f"{run_prefix(run_id)}_groups_B{int(tag[: GROUP_BITS // 4], 16)}"


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


class RunValidator(RecordValidatorBase):
    """The run's keys, each checked against its own one-field schema: the progress records' level-0 key and every
    bucket key (``ProgressKeySchema``), and the groups key and its buckets (``GroupsKeySchema``); other keys are other
    validators'.

    hivemind's ``SchemaValidator`` with one model of all 512 keys as fields did the same check, but pydantic v1 walks
    every field of a model for each record it parses and dumps: 0.52 ms a record against 0.07 here, on every store
    and every copy a read brings back (12 peers on 2 cores spent most of their DHT processes' time there). The check
    is hivemind's: the value, with its subkey, must parse and dump back unchanged (no type conversions), and a value
    without a subkey must not be a dict. Not a ``SchemaValidator``, so that hivemind does not merge it into the
    global one. Sent to the DHT process as its run id alone: its table of key ids is made again there (pickled
    whole, a validator of 20 KB reached hivemind's DHT process in pieces that its non-blocking pipe read refused,
    ``BlockingIOError``, and the DHT process died)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        prefix = run_prefix(run_id)
        names = [
            "progress",
            *(f"progress_L{level}_{b}" for level in range(1, MAX_LEVEL + 1) for b in range(1 << level)),
        ]
        self._schemas: dict[bytes, type[pv1.BaseModel]] = {
            DHTID.generate(source=f"{prefix}_{name}").to_bytes(): ProgressKeySchema for name in names
        }
        for name in ["groups", *(f"groups_B{b}" for b in range(1 << GROUP_BITS))]:
            self._schemas[DHTID.generate(source=f"{prefix}_{name}").to_bytes()] = GroupsKeySchema

    def __reduce__(self):
        return RunValidator, (self.run_id,)

    def validate(self, record: DHTRecord) -> bool:
        schema = self._schemas.get(record.key)
        if schema is None:
            return True  # not one of this run's keys
        try:
            value = MSGPackSerializer.loads(record.value)
            if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
                if isinstance(value, dict):  # a dictionary must come as subkeys, each with its own expiration
                    return False
            else:
                value = {MSGPackSerializer.loads(record.subkey): value}
            return schema.parse_obj({"records": value}).dict(by_alias=True)["records"] == value
        except (pv1.ValidationError, ValueError, TypeError) as e:  # bytes msgpack cannot read, or a record out of shape
            logger.debug("a record of %s refused: %s", self.run_id, e)
            return False


def run_validator(run_id: str) -> RunValidator:
    return RunValidator(run_id)
