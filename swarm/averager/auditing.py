"""The averager process's side of checked reducers (``swarm.defence.audit``) and bans.

After every all-reduce, before anything is written into the buffers, each groupmate
serves what it sent each reducer and, as a reducer, its signed receipt; it audits the
reducers ``audit.auditor_of`` gives it, tells the group what it found, re-checks any
accusation itself, and drops the slice of a reducer it caught (read as zeros, as a
vanished reducer's). Every fetch and every wait is bounded: the audits and the verdicts by
``audit_timeout``, and re-checks of accusations by another ``audit_timeout`` after that.

A reducer caught here is banned: ``swarm.averager.refusals`` refuses it from then on.

This is a mixin of ``PseudoGradientAverager``: the ``rpc_*`` handlers and the
coroutines run in the averager process.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
import typing
from collections import OrderedDict

from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from tenacity import AsyncRetrying, RetryCallState, stop_after_attempt, wait_fixed

from swarm.averager.allreduce import Dropped, ExactAllReduceRunner, HeldPart, encode_average
from swarm.averager.audit_serving import MAX_ACCUSED_PARTS, AuditRound, AuditServing
from swarm.defence.audit import (
    FALSE_ACCUSATION,
    GUILTY,
    UNCHECKABLE,
    Receipt,
    Verdict,
    auditor_of,
    digest_of,
    digest_parts,
    judge,
    open_receipt,
    sample_parts,
    served_as_signed,
    suspect_parts,
)

logger = logging.getLogger(__name__)


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


FETCH_ATTEMPTS = 3  # tries of one request to a groupmate that raised: a stream cut short on a loaded host or link
RETRY_PAUSE = 0.25  # seconds between them


async def _retried(request: typing.Callable[[], typing.Awaitable], deadline: float):
    """``request()``'s result, each try bounded by ``deadline``; a try that raised is made again while tries and
    time are left, so that one broken stream is not taken for a reducer that will not answer (a strike) or for
    a slice that cannot be repaired (dropped, and a re-sync). A groupmate that is gone fails every try: the last
    error is raised."""

    def out_of_time(state: RetryCallState) -> bool:
        return time.monotonic() + RETRY_PAUSE >= deadline

    def before_sleep(state: RetryCallState) -> None:
        logger.debug("a request to a groupmate failed (try %d): again", state.attempt_number,
                     exc_info=state.outcome.exception())  # fmt: skip

    stop = stop_after_attempt(FETCH_ATTEMPTS) | out_of_time
    retrying = AsyncRetrying(stop=stop, wait=wait_fixed(RETRY_PAUSE), before_sleep=before_sleep, reraise=True)
    async for attempt in retrying:
        with attempt:
            return await asyncio.wait_for(request(), _left(deadline))


UNANSWERED_STRIKES = 2  # audits in a row a reducer left unanswered or withheld its parts in, before a ban
STRIKES = frozenset({Verdict.unanswered, *UNCHECKABLE})  # verdicts that leave a reducer unchecked: a strike each


class RepairFailure(enum.StrEnum):
    """Why a slice that came in part could not be had again whole from its reducer (then it is dropped)."""

    no_receipt = "no_receipt"  # the reducer did not hand over the receipt it signed for the round
    unreachable = "unreachable"  # fetching its average again failed or ran out of time
    not_signed = "not_signed"  # what it served is not the average it signed (part count or digest)
    disagrees = "disagrees"  # a part differs from what it streamed to us the first time


def slices_to_repair(outputs: dict[str, list], me: str, refused: set[str]) -> list[str]:
    """The reducers whose slice came to us in part, to fetch again whole. Not one whose own parts we refused as
    its reducer (``ExactAllReduceRunner.refused_senders``): its slice was dropped on purpose, and its round, waiting
    for the average we never send it, signs no receipt before our audits' time is out (15 s a round, seen)."""
    return [
        m for m, out in outputs.items() if m != me and m not in refused and any(isinstance(p, Dropped) for p in out)
    ]


class Auditing(AuditServing):
    """Checked reducers, in the averager process: our audits of our reducers (serving our groupmates' audits:
    ``AuditServing``)."""

    def _init_auditing(self, audit: bool, audit_timeout: float, audit_parts: int = 0) -> None:
        self._audit_enabled, self._audit_timeout = audit, audit_timeout
        self._audit_parts = audit_parts  # parts of each reducer's slice an audit checks (0: all)
        self._audit_rounds: OrderedDict[bytes, AuditRound] = OrderedDict()
        self._unanswered: dict[str, int] = {}  # reducer -> our audits of it in a row it left unanswered

    # ---- auditing ---------------------------------------------------------------------------------

    async def _request(self, peer: str, fields: dict) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        target = PeerID.from_base58(peer)
        stub = self.get_stub(self._p2p, target, namespace=self.prefix)
        if self._secret is not None:
            fields["token"] = self._secret.transfer_token(self._p2p.peer_id.to_bytes(), target.to_bytes())
        return await stub.rpc_audit_fetch(averaging_pb2.DownloadData(metadata=self.serializer.dumps(fields)))

    async def _fetch_receipt(self, record: AuditRound, reducer: str) -> tuple[Receipt | None, bytes | None, dict]:
        """``reducer``'s signed receipt, its blob, and the per-part digests it lists under it, by sender (checked
        against the receipt by ``audit.judge`` where a sample needs them)."""
        stream = await self._request(reducer, dict(group_id=record.runner.group_id, what="receipt"))
        async for message in stream:
            reply = self.serializer.loads(message.metadata)
            blob = reply.get("receipt") if isinstance(reply, dict) else None
            receipt = open_receipt(blob) if isinstance(blob, bytes) else None
            ok = receipt is not None and receipt.group_id == record.runner.group_id and receipt.reducer == reducer
            if ok and set(receipt.senders) <= set(record.members):
                listed = reply.get("listed")
                usable = isinstance(listed, list) and len(listed) == len(receipt.senders)
                listed = dict(zip(receipt.senders, listed)) if usable else {}
                return receipt, blob, {s: d for s, d in listed.items() if isinstance(d, list)}
            break
        return None, None, {}

    async def _fetch_parts(
        self, record: AuditRound, sender: str, reducer: str, limit: int, what="parts", indices=None
    ) -> list:
        fields = dict(group_id=record.runner.group_id, what=what, reducer=reducer)
        if indices is not None:
            fields["indices"] = list(indices)
        stream = await self._request(sender, fields)
        parts, total = [], 0
        async for message in stream:
            total += len(message.tensor_part.buffer)
            record.fetched_bytes += len(message.tensor_part.buffer)
            if total > limit:
                raise AllreduceException(f"{sender[-8:]} sent more audit data than it could have sent")
            parts.append(message.tensor_part)
        return parts

    async def _audit_one(
        self, record: AuditRound, reducer: str, deadline: float, also: typing.Sequence[int] = ()
    ) -> tuple[Verdict, bytes | None, list[int]]:
        """Fetch the receipt and every other sender's parts for ``reducer`` (all, or a sample drawn now, with the
        parts ``also``), and judge; fetches end by ``deadline``. Returns the verdict, the receipt's blob and the
        parts of the sample it checked (none when it checked every part)."""
        me = self.peer_id.to_base58()
        ours = record.sent_to(reducer)
        if ours is None:
            return Verdict.inconclusive, None, []
        try:
            receipt, blob, listed = await _retried(lambda: self._fetch_receipt(record, reducer), deadline)
        except Exception:
            logger.debug("no receipt from %s", reducer, exc_info=True)
            receipt, blob, listed = None, None, {}
        if receipt is None:
            logger.debug("audited %s: no valid receipt", reducer)
            return Verdict.unanswered, None, []
        count, numels = len(ours), [math.prod(p.size) for p in ours]  # parts in its slice, and each one's size
        if 0 < self._audit_parts < count:  # a sample: those drawn at random, and those that stand out
            outputs, size = record.outputs[reducer], self._audit_parts
            suspects = await asyncio.get_event_loop().run_in_executor(None, suspect_parts, outputs, ours, size)
            also = [*also, *suspects]
        checked = sample_parts(count, self._audit_parts, also)
        whole = len(checked) == count
        ours = ours if whole else [ours[i] for i in checked]
        indices = None if whole else checked  # None: the sender's every part, as when the audit checks them all
        limit = 4 * sum(len(p.buffer) for p in ours) + (1 << 16)
        others = [s for s in receipt.senders if s != me]
        fetch = lambda sender: self._fetch_parts(record, sender, reducer, limit, indices=indices)  # noqa: E731
        fetched = await asyncio.gather(
            *(_retried(lambda s=s: fetch(s), deadline) for s in others), return_exceptions=True
        )
        if reducer in others:  # its own parts decide "withheld", which drops its slice: a stream that ended short
            i = others.index(reducer)  # or served other bytes without an error (errors were retried above) is
            parts = fetched[i]  # fetched once more before that is said
            if not isinstance(parts, BaseException) and not served_as_signed(
                receipt, reducer, parts, checked, count, listed.get(reducer)
            ):
                logger.debug("%s's own parts did not match its receipt: fetching them once more", reducer)
                again = _retried(lambda: fetch(reducer), deadline)
                fetched[i] = (await asyncio.gather(again, return_exceptions=True))[0]
        served = {me: ours}
        for sender, parts in zip(others, fetched):
            if isinstance(parts, BaseException):
                logger.debug("no audit parts from %s: %r", sender, parts)
            else:
                served[sender] = parts
        compression = record.runner.tensor_part_container.compression.compression_type

        def check() -> Verdict:
            return judge(
                receipt, record.outputs[reducer], served, numels, self.aggregation,
                lambda values: encode_average(values, compression), indices=checked, listed=listed,
            )  # fmt: skip

        verdict = await asyncio.get_event_loop().run_in_executor(None, check)
        logger.debug(
            "audited %s: %s (parts from %d of %d senders, %d of %d parts)", reducer, verdict, len(served),
            len(receipt.senders), len(checked), len(numels),
        )  # fmt: skip
        return verdict, blob, indices or []

    async def _repair_slice(self, record: AuditRound, reducer: str, deadline: float) -> list[HeldPart] | RepairFailure:
        """``reducer``'s whole average, fetched again from it when our copy came in part (its stream to us was
        cut): accepted only if it is what the reducer signed in its receipt, which its auditor checked, and
        agrees with every part we did receive. So every groupmate applies the same slice, instead of one
        dropping it alone and leaving the round with another state than the others'. Otherwise, why not."""
        have = record.outputs[reducer]
        numels = [p.numel if isinstance(p, Dropped) else math.prod(p.size) for p in have]
        try:
            receipt, _, _ = await _retried(lambda: self._fetch_receipt(record, reducer), deadline)
            if receipt is None:
                logger.debug("no receipt from %s to repair its slice with", reducer)
                return RepairFailure.no_receipt
            limit = 4 * sum(numels) + (1 << 16)
            parts = await _retried(lambda: self._fetch_parts(record, reducer, reducer, limit, "output"), deadline)
        except Exception:
            logger.debug("could not fetch %s's average again", reducer, exc_info=True)
            return RepairFailure.unreachable
        if len(parts) != len(have) or digest_parts(parts) != receipt.output:
            logger.debug("%s's average again: %d parts of %d, digest as signed: %s", reducer, len(parts), len(have),
                         digest_parts(parts) == receipt.output)  # fmt: skip
            return RepairFailure.not_signed
        for index, (got, held, numel) in enumerate(zip(parts, have, numels)):
            if math.prod(got.size) != numel or (
                not isinstance(held, Dropped) and got.SerializeToString() != held.SerializeToString()
            ):
                logger.debug("%s's average again: part %d differs from what we received", reducer, index)
                return RepairFailure.disagrees
        return parts

    @staticmethod
    def _restore_slice(held: list[list[HeldPart]], owner: dict, peer: str, parts: list[HeldPart]) -> int:
        """``peer``'s slice from ``parts`` (in the order it reduced them); the number of values restored."""
        restored = 0
        for (t, j), part in zip([key for key, who in owner.items() if who == peer], parts):
            if isinstance(held[t][j], Dropped):
                restored += held[t][j].numel
            held[t][j] = part
        return restored

    @staticmethod
    def _drop_slice(held: list[list[HeldPart]], owner: dict, peer: str) -> int:
        """Every part of ``peer``'s slice read as zeros; the number of values newly dropped."""
        dropped = 0
        for (t, j), who in owner.items():
            if who == peer and not isinstance(held[t][j], Dropped):
                numel = math.prod(held[t][j].size)
                held[t][j] = Dropped(numel)
                dropped += numel
        return dropped

    def _strike(self, reducer: str, verdict: Verdict) -> int:
        """Our audits of ``reducer`` in a row it could not be checked in (unanswered or withheld), this one
        included; 0 once it is checked."""
        strikes = self._unanswered.pop(reducer, 0) + 1 if verdict in STRIKES else 0
        if strikes:
            self._unanswered[reducer] = strikes
        return strikes

    async def _tell_group(
        self, record: AuditRound, reducer: str, verdict: Verdict, checked: list[int], deadline: float
    ) -> None:
        """Our verdict on ``reducer`` to every groupmate; an accusation names the parts we checked, so that each
        groupmate's own check of it includes them."""
        me = self.peer_id.to_base58()
        fields = dict(group_id=record.runner.group_id, reducer=reducer, verdict=verdict.value)
        if verdict in GUILTY or verdict in UNCHECKABLE:
            fields["parts"] = checked[:MAX_ACCUSED_PARTS]

        async def tell(peer: str) -> None:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            message = dict(fields)
            if self._secret is not None:
                message["token"] = self._secret.transfer_token(me_bytes, PeerID.from_base58(peer).to_bytes())
            await stub.rpc_audit_verdict(averaging_pb2.DownloadData(metadata=self.serializer.dumps(message)))

        me_bytes = self._p2p.peer_id.to_bytes()
        others = [m for m in record.members if m != me]
        await asyncio.gather(*(_retried(lambda p=p: tell(p), deadline) for p in others), return_exceptions=True)

    async def _audit_group(self, runner: ExactAllReduceRunner, record: AuditRound, held: list[list[HeldPart]]):
        """Audit this round's reducers; returns the held parts with caught reducers' slices dropped, the
        number of values dropped, what was found (for the host: ``AllReduceOutcome.findings``) and the slices
        that came in part and could not be repaired (``AllReduceOutcome.repair_failures``)."""
        members, me = record.members, self.peer_id.to_base58()
        container = runner.tensor_part_container
        flat = [(t, j) for t, parts in enumerate(held) for j in range(len(parts))]
        owner, offset = {}, 0
        for index, count in enumerate(container.num_parts_by_peer):
            for t, j in flat[offset : offset + count]:
                owner[(t, j)] = members[index]
            record.outputs[members[index]] = [held[t][j] for t, j in flat[offset : offset + count]]
            offset += count
        reducers = [m for m, out in record.outputs.items() if out and not any(isinstance(p, Dropped) for p in out)]
        if me in reducers:
            senders = [p.to_base58() for p in runner.sender_peer_ids]
            full = len(runner.parts_for_local_averaging)
            record.listed = [d if len(d) == full else [] for d in runner.input_digests]
            inputs = [digest_of(d) if d else b"" for d in record.listed]
            receipt = Receipt(runner.group_id, me, tuple(senders), tuple(runner.input_weights), tuple(inputs),
                              digest_parts(record.outputs[me]))  # fmt: skip
            record.receipt = await asyncio.get_event_loop().run_in_executor(None, receipt.sign)
            record.own_output = record.outputs[me]
            logger.debug("receipt: %s", [(s[-8:], d.hex()[:12]) for s, d in zip(senders, inputs)])
        record.done = True

        deadline = time.monotonic() + self._audit_timeout
        mine = [r for r in reducers if auditor_of(members, runner.group_id, r) == me]
        results = await asyncio.gather(*(self._audit_one(record, r, deadline) for r in mine))
        await asyncio.gather(*(self._tell_group(record, r, v, c, deadline) for r, (v, _, c) in zip(mine, results)))
        # (peer, verdict, receipt, drop its slice, ban it): our own audits first. A reducer that did not answer
        # our audit is usually one that vanished: nothing is dropped on that alone (the group must agree), but one
        # that is still around and leaves UNANSWERED_STRIKES audits of ours in a row unanswered is banned
        found = []
        # A reducer that withheld its own parts cannot be checked: its slice is dropped, but that alone is no
        # proof (an honest one was once seen serving other bytes, cause unknown), so it is a strike, as unanswered
        for reducer, (verdict, blob, _) in zip(mine, results):
            strikes = self._strike(reducer, verdict)
            blob = blob if verdict in GUILTY else None  # only a proven lie is published with the liar's receipt
            drop = verdict in GUILTY or verdict in UNCHECKABLE
            found.append((reducer, verdict, blob, drop, verdict in GUILTY or strikes >= UNANSWERED_STRIKES))

        # verdicts to wait for: those of auditors that are still with us (one whose own slice never came is gone)
        waiting = [
            r for r in reducers if r not in mine and r != me and auditor_of(members, runner.group_id, r) in reducers
        ]
        while any(r not in record.verdicts for r in waiting) and time.monotonic() < deadline:
            record.news.clear()
            try:
                await asyncio.wait_for(record.news.wait(), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
        recheck_deadline = time.monotonic() + self._audit_timeout
        for reducer in waiting:  # an accusation is checked by every groupmate itself before anything is dropped
            heard = record.verdicts.get(reducer)
            if heard not in GUILTY and heard not in UNCHECKABLE:
                continue
            own, blob, _ = await self._audit_one(record, reducer, recheck_deadline, record.accused.get(reducer, ()))
            if own == Verdict.passed and heard in GUILTY:
                found.append((auditor_of(members, runner.group_id, reducer), FALSE_ACCUSATION, None, False, True))
            elif own in GUILTY:
                found.append((reducer, own, blob, True, True))
            elif own in STRIKES:  # it will not let us check it either: we drop
                # its slice, as its auditor does; accused of a lie it will not let us check, it is banned
                strikes = self._strike(reducer, own)
                found.append((reducer, own, None, True, heard in GUILTY or strikes >= UNANSWERED_STRIKES))

        findings, dropped = [], 0
        # a slice that came in part (its reducer vanished mid-way, or cut its stream to us) is fetched again from
        # its reducer and checked against its receipt; failing that it is dropped whole, since a liar could fail
        # one part to us and have the rest applied unchecked (then our state differs from the group's, and the
        # consistency check re-syncs us)
        refused = {p.to_base58() for p in runner.refused_senders}
        partial = slices_to_repair(record.outputs, me, refused)
        repairs = await asyncio.gather(*(self._repair_slice(record, p, recheck_deadline) for p in partial))
        repair_failures = []
        for peer, parts in zip(partial, repairs):
            if isinstance(parts, RepairFailure):
                dropped += self._drop_slice(held, owner, peer)
                repair_failures.append(dict(peer=peer, failure=parts.value))
            else:
                dropped -= self._restore_slice(held, owner, peer, parts)
                logger.debug("the average of %s came in part: fetched again, whole", peer)
        for peer, verdict, blob, drop, ban in found:
            if not (drop or ban):
                continue
            if ban:
                self._banned.add(peer)
            if drop:
                dropped += self._drop_slice(held, owner, peer)
            findings.append(dict(peer=peer, verdict=str(verdict), banned=ban, discarded=drop, receipt=blob))
            logger.debug("audit of %s: %s (dropped: %s, banned: %s)", peer, verdict, drop, ban)
        record.outputs.clear()
        self._keep_round(runner.group_id)
        return held, dropped, findings, repair_failures
