"""The averager process's side of its groupmates' audits (``swarm.averager.auditing``): what it keeps of each round, and
the RPCs that serve it.

For each group's all-reduce it keeps the parts it sent each reducer and, as a reducer, its signed receipt with
the per-part digests under it and its own slice's average, for ``KEEP_ROUNDS`` rounds at most; and it hears the
verdicts of each reducer's auditor. Only groupmates of that round are answered.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import typing
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import dataclass, field

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

from swarm.averager.allreduce import ExactAllReduceRunner
from swarm.averager.held import HeldPart
from swarm.averager.served import served
from swarm.averager.serving_limits import ServingLimits
from swarm.defence.audit import Verdict, auditor_of
from swarm.defence.statements import MAX_STATEMENT_BYTES

logger = logging.getLogger(__name__)


class AuditRequest(enum.StrEnum):
    """What a groupmate's audit asks of us (the ``what`` of its request, as it goes on the wire)."""

    receipt = "receipt"  # our signed receipt as a reducer, with the per-part digests under it
    parts = "parts"  # the parts we sent a reducer: all of them, or those ``indices`` (an audit of a sample)
    output = "output"  # our own slice's average again, as we signed it (a groupmate whose copy came in part)
    returned = "returned"  # how many parts of a reducer's average came back to us (its receipt counts us short)
    # as a reducer, the parts a sender sent us (those ``indices``): its auditor checks them against the sender's signed
    # statement when that sender is gone or serves other bytes, so a lie in our slice needs no sender's help to hide
    held = "held"


# An honest groupmate asks us, in one round, for our receipt and our repair at most once each and for the parts we
# sent each reducer it audits or re-checks (one each, at most a group's size), with a few retries: a few hundred
# requests in the largest groups, and rounds last a minute or more. Past these it is refused at once.
AUDIT_LIMITS = dict(per_peer=8, total=128, per_minute=600)
MAX_ACCUSED_PARTS = 4096  # parts an accusation may name (a sample's; an audit of every part names none past it)
MAX_RECEIPT_BYTES = 4096  # a receipt's signature, key and fields, less the 256 bytes or fewer it takes a sender
KEEP_ROUNDS = 2  # groups whose sent parts and receipts are kept at most (each is let go ``kept_for`` after its audit)


def kept_for(audit_timeout: float) -> float:
    """Seconds a round's record is kept after our own audits of it end. A groupmate may wait ``audit_timeout`` for
    its auditors' verdicts and only then re-check accusations and fetch a cut slice again, for up to another
    ``audit_timeout``: its last request can come two timeouts after its all-reduce ended, and its all-reduce may
    have ended well after ours (a slow stream), which is when our audits began. Kept for one timeout more than
    that; ``KEEP_ROUNDS`` still bounds how many rounds are kept."""
    return 3 * audit_timeout


@dataclass
class AuditRound:
    """One group's all-reduce, as this peer's auditors and its own audits need it."""

    members: list[str]
    runner: ExactAllReduceRunner
    receipt: bytes | None = None  # ours, signed, once our own all-reduce is complete
    listed: list[list[bytes]] = field(default_factory=list)  # ours: each sender's per-part digests, receipt order
    statements: list[bytes] = field(default_factory=list)  # ours: each sender's signed statement, receipt order
    outputs: dict[str, list[HeldPart]] = field(default_factory=dict)  # each reducer's average as received
    returned: dict[str, int] = field(default_factory=dict)  # reducer -> parts of its average that came to us first
    own_output: list[HeldPart] | None = None  # our own slice's average, for a groupmate whose copy came in part
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # reducer -> what its auditor told us
    accused: dict[str, list[int]] = field(default_factory=dict)  # reducer -> the parts its accuser checked
    # what each reducer signed of its average, as we and our groupmates hold it: its ``Output`` to each groupmate
    # (``(groupmate, reducer)``), and its receipt as its auditor fetched it; two digests of one slice prove it lied
    heard_outputs: dict[tuple[str, str], bytes] = field(default_factory=dict)
    receipts: dict[tuple[str, str], bytes] = field(default_factory=dict)  # (its auditor or we, reducer) -> receipt
    news: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False  # our receipt is final (or there will be none)
    fetched_bytes: int = 0  # parts downloaded by our audits: their cost in traffic

    def sent_to(self, reducer: str) -> list[runtime_pb2.Tensor] | None:
        return self.runner.sent_parts.get(self.members.index(reducer)) if reducer in self.members else None

    def served_sent(self, reducer: str, indices: object) -> Iterator[runtime_pb2.Tensor] | None:
        """The parts we sent ``reducer`` (all, or ``indices``: another machine's list, checked) as a groupmate's
        audit asks for them, read from disk one at a time as its stream takes them (read whole, a slice per request
        and eight requests per groupmate were held at once); None if we sent it none or the indices are wrong."""
        count = self.runner.sent_parts.count(self.members.index(reducer)) if reducer in self.members else None
        if count is None or (indices is not None and not _valid_indices(indices, count)):
            return None
        return self.runner.sent_parts.each(self.members.index(reducer), indices)

    def held_of(self, sender: str, indices: object) -> Iterator[runtime_pb2.Tensor] | None:
        """The parts ``indices`` (another machine's list: checked) that ``sender`` sent us as its reducer, read one
        at a time; None if it sent us none or the indices are not some of them."""
        senders = [p.to_base58() for p in self.runner.sender_peer_ids]
        if sender not in senders:
            return None
        index = senders.index(sender)
        count = self.runner.received_parts.count(index)
        if count is None or not _valid_indices(indices, count):
            return None
        return self.runner.received_parts.each(index, indices)


class AuditServing:
    """What a groupmate's audit of our round asks of this averager."""

    _audit_rounds: OrderedDict[bytes, AuditRound]
    _audit_timeout: float

    def _open_audit(self, runner: ExactAllReduceRunner, members: list[str]) -> AuditRound:
        record = AuditRound(members, runner)
        self._audit_rounds[runner.group_id] = record
        while len(self._audit_rounds) > KEEP_ROUNDS:
            self._forget_round(next(iter(self._audit_rounds)))
        return record

    def _keep_round(self, group_id: bytes) -> None:
        """Our audits of this round are over: what we sent stays for groupmates still re-checking an accusation
        or repairing a slice, then goes (it is c x N bytes)."""
        record = self._audit_rounds.get(group_id)
        asyncio.get_event_loop().call_later(kept_for(self._audit_timeout), self._forget_round, group_id, record)

    def _forget_round(self, group_id: bytes, record: AuditRound | None = None) -> None:
        """A round no auditor will ask about any more: its record goes (``record`` only, if given: never a later
        round's), and the parts we sent (on disk) with it."""
        if record is not None and self._audit_rounds.get(group_id) is not record:
            return
        record = self._audit_rounds.pop(group_id, None)
        if record is not None:
            record.runner.sent_parts.close()
            record.runner.received_parts.close()

    def _audit_limits(self) -> ServingLimits:
        """Per requester, how many audit requests it may have open and start in a minute (``serving_limits``)."""
        if getattr(self, "_audit_serving", None) is None:
            self._audit_serving = ServingLimits(**AUDIT_LIMITS)
        return self._audit_serving

    async def rpc_audit_fetch(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # hivemind registers handlers by typing's hints
        """A groupmate's audit: what its ``AuditRequest`` asks for; nothing past its limits (``AUDIT_LIMITS``)."""
        requester = context.remote_id.to_base58()
        async with aclosing(
            served(self._audit_limits(), requester, self._serve_audit(request, context), "an audit")
        ) as messages:
            async for message in messages:
                yield message

    async def _serve_audit(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        fields = self._admitted(request, context)
        if fields is None or not isinstance(fields.get("group_id"), bytes):
            return
        record = self._audit_rounds.get(fields["group_id"])
        if record is None or context.remote_id.to_base58() not in record.members:
            return
        try:
            what = AuditRequest(fields.get("what"))
        except (ValueError, TypeError):  # another machine's request: not one we know
            return
        match what:
            case AuditRequest.receipt:  # with the per-part digests under it, for audits of a sample
                await self._until_final(record)
                if record.receipt is not None:
                    reply = dict(receipt=record.receipt, listed=record.listed, statements=record.statements)
                    yield averaging_pb2.DownloadData(metadata=self.serializer.dumps(reply))
            case AuditRequest.returned:  # a reducer whose receipt counts us short: how much of its average came back?
                await self._until_final(record)
                reply = dict(returned=record.returned.get(str(fields.get("reducer")), 0))
                yield averaging_pb2.DownloadData(metadata=self.serializer.dumps(reply))
            case AuditRequest.output:  # our own slice's average again, as we signed it in the receipt
                await self._until_final(record)
                for part in record.own_output or ():
                    yield averaging_pb2.DownloadData(tensor_part=part)
            case AuditRequest.held:  # a sender's parts as they came to us, its reducer
                await self._until_final(record)
                for part in record.held_of(str(fields.get("sender")), fields.get("indices")) or ():
                    yield averaging_pb2.DownloadData(tensor_part=part)
            case AuditRequest.parts:  # all of them, or those ``indices`` (an audit of a sample)
                parts = record.served_sent(str(fields.get("reducer")), fields.get("indices"))
                logger.debug("serving parts sent to %s: %s (done: %s)", fields.get("reducer"), parts is not None,
                             record.done)  # fmt: skip
                for part in parts or ():
                    yield averaging_pb2.DownloadData(tensor_part=part)

    async def _until_final(self, record: AuditRound) -> None:
        """Until our receipt for the round is final (or there will be none), within ``audit_timeout``."""
        deadline = time.monotonic() + self._audit_timeout
        while not record.done and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def rpc_audit_verdict(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """An auditor's verdict on one of our group's reducers (only the reducer's auditor is heard, within its
        limits)."""
        requester, limits = context.remote_id.to_base58(), self._audit_limits()
        if not limits.acquire(requester):
            return averaging_pb2.DownloadData()
        limits.release(requester)  # a verdict is read at once: only its rate counts
        fields = self._admitted(request, context)
        record = self._audit_rounds.get(fields.get("group_id")) if fields and "group_id" in fields else None
        sender = context.remote_id.to_base58()
        if record is not None and sender in record.members:
            _keep_signed_outputs(record, sender, fields)
            reducer = fields.get("reducer")
            try:
                verdict = Verdict(fields.get("verdict"))
            except ValueError:
                verdict = None
            if verdict is not None and auditor_of(record.members, record.runner.group_id, reducer) == sender:
                record.verdicts[reducer] = verdict
                parts = fields.get("parts")
                if isinstance(parts, list) and len(parts) <= MAX_ACCUSED_PARTS:  # checked against the slice later
                    record.accused[reducer] = [i for i in parts if isinstance(i, int)]
                record.news.set()
        return averaging_pb2.DownloadData()


def _valid_indices(indices: object, count: int) -> bool:
    """Whether another machine's ``indices`` are a list of at most ``count`` part indices below ``count``."""
    return (
        isinstance(indices, list)
        and len(indices) <= count
        and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in indices)
    )


def _keep_signed_outputs(record: AuditRound, sender: str, fields: dict) -> None:
    """What a groupmate's verdict carries of what reducers signed of their averages: the ``Output`` each reducer
    sent it (checked, with the receipt, once every verdict is in: ``proofs.equivocations``), and, from a reducer's
    auditor, the receipt it fetched. Only sizes are looked at here."""
    outputs, reducer, receipt = fields.get("outputs"), fields.get("reducer"), fields.get("receipt")
    if isinstance(outputs, dict) and len(outputs) <= len(record.members):
        for name, blob in outputs.items():
            if name in record.members and isinstance(blob, bytes) and len(blob) <= MAX_STATEMENT_BYTES:
                record.heard_outputs[(sender, name)] = blob
    if reducer in record.members and auditor_of(record.members, record.runner.group_id, reducer) == sender:
        if isinstance(receipt, bytes) and len(receipt) <= MAX_RECEIPT_BYTES + 256 * len(record.members):
            record.receipts[(sender, reducer)] = receipt
