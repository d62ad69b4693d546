"""Record validation, remembered: a DHT node judges the same record's bytes once, not once per copy and per read.

Works around: ``DHTProtocol._validate_dictionary`` and ``rpc_store`` running every validator (an RSA signature check,
then pydantic v1 models for the schema) on every record of every reply and every store, with no memory of records it
judged a moment before (checked on hivemind 1.1.12, ``dht/protocol.py``, ``dht/validation.py``, ``dht/schema.py``).

A read of a key with subkeys (a bucket of progress records) returns the same records from each of the nodes that hold
a copy, and the next read a second later returns them again: a record is rewritten every ``PUBLISH_INTERVAL`` (2 s),
so each of its bytes was judged many times over. Measured with 12 `tiny` peers on one 2-core machine: the 12 DHT
processes took 1.45 of its 2 cores, about 70% of it in ``SchemaValidator.validate`` (``BaseModel.parse_obj`` and
``.dict``), leaving the 12 trainers 0.24 of a core; matchmaking then took a minute against a 2 s window.

The verdict of ``CompositeValidator.validate`` is a function of the record's bytes alone (its key, subkey, value and
expiration time: no validator here reads the clock; freshness is judged on read, ``swarm.dht.records.fresh``) and of
the validators installed, so it is kept per record, keyed by a 128-bit BLAKE2b digest of all four, in a bounded LRU
table (``MAX_VERDICTS``) that is cleared whenever validators are added (a run's schema arrives after the node
starts). Refusals are kept too: a stranger who sends many distinct records costs the node the same work as before,
never more, and one who sends the same bad record again costs a lookup.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from hivemind.dht.validation import CompositeValidator, DHTRecord

MAX_VERDICTS = 16384  # records remembered per node: about 2 MB, several reads of a few hundred buckets' records

_validate = CompositeValidator.validate
_extend = CompositeValidator.extend
_installed = False


def record_digest(record: DHTRecord) -> bytes:
    """A digest of everything the verdict depends on; each part length-prefixed, so no two records share one."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (record.key, record.subkey, record.value):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    digest.update(struct.pack("<d", record.expiration_time))
    return digest.digest()


def _verdicts(validator: CompositeValidator) -> OrderedDict[bytes, bool]:
    table = validator.__dict__.get("_swarm_verdicts")
    if table is None:
        table = validator.__dict__["_swarm_verdicts"] = OrderedDict()
    return table


def _validate_remembered(self: CompositeValidator, record: DHTRecord) -> bool:
    try:
        digest = record_digest(record)
    except (TypeError, ValueError, struct.error, OverflowError):  # not bytes, or a time that is no float: judge it
        return _validate(self, record)
    table = _verdicts(self)
    verdict = table.get(digest)
    if verdict is not None:
        table.move_to_end(digest)
        return verdict
    verdict = bool(_validate(self, record))
    table[digest] = verdict
    if len(table) > MAX_VERDICTS:
        table.popitem(last=False)
    return verdict


def _extend_forgetting(self: CompositeValidator, validators) -> None:
    _extend(self, validators)
    self.__dict__.pop("_swarm_verdicts", None)  # a new validator may refuse what the old ones took


def remember_verdicts() -> None:
    """From now on, in this process and those it forks (the DHT's), every ``CompositeValidator`` remembers its
    verdicts. Called before the DHT process starts."""
    global _installed
    if not _installed:
        CompositeValidator.validate = _validate_remembered
        CompositeValidator.extend = _extend_forgetting
        _installed = True
