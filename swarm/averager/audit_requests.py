"""What an auditor asks of its groupmates' averagers (``swarm.averager.audit_serving`` answers): a reducer's signed
receipt, the parts a sender sent a reducer (from the sender, or as they came to the reducer), a reducer's average again;
and its verdict, told to the whole group.

Every request is bounded by a deadline and retried (``_retried``) while tries and time are left, so that one
broken stream is not taken for a reducer that will not answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import typing

from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from tenacity import AsyncRetrying, RetryCallState, stop_after_attempt, wait_fixed

from swarm.averager.audit_serving import MAX_ACCUSED_PARTS, AuditRequest, AuditRound
from swarm.defence.audit import GUILTY, UNCHECKABLE, Verdict
from swarm.defence.receipts import Receipt, open_receipt, with_statements
from swarm.defence.unpack import bounded_loads
from swarm.manifest import SLOWEST_LINK_MBIT

logger = logging.getLogger(__name__)

# a sender's parts are asked of the reducer this long before the audit's deadline at the latest: twice their time at
# the slowest link allowed, and a few seconds (at most half of the audit's time left), so that a sender that stalls
# its answer leaves an honest reducer time to show them
HELD_SLACK = 5.0
HELD_AT_ONCE = 4  # such requests of one audit open at once: under a reducer's per-requester limit (``AUDIT_LIMITS``)
FETCH_ATTEMPTS = 3  # tries of one request to a groupmate that raised: a stream cut short on a loaded host or link
RETRY_PAUSE = 0.25  # seconds between them


def held_reserve(size: int, left: float) -> float:
    """Seconds kept back, of ``left``, to fetch ``size`` bytes of a sender's parts from the reducer."""
    return min(left / 2, HELD_SLACK + 2 * size * 8 / (SLOWEST_LINK_MBIT * 1e6))


def _fitting(task: asyncio.Future, sender: str, fits: typing.Callable[[str, list], bool]) -> list | None:
    """A finished fetch's parts, if they fit their bounds; None for one that raised, was cancelled or is not done."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return None
    return task.result() if fits(sender, task.result()) else None


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


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


def returned_count(metadata: bytes) -> int:
    """A groupmate's reply to ``AuditRequest.returned``: the parts it says came back, or 0 for anything else that
    its bytes hold (never raises)."""
    try:
        reply = bounded_loads(metadata)
    except Exception:  # another machine's bytes
        logger.debug("an unreadable reply to a returned-count request", exc_info=True)
        return 0
    returned = reply.get("returned") if isinstance(reply, dict) else None
    return returned if isinstance(returned, int) and not isinstance(returned, bool) and 0 <= returned < 2**31 else 0


class AuditRequests:
    """A mixin of ``PseudoGradientAverager`` (its ``_p2p``, ``prefix``, ``serializer`` and ``_secret``)."""

    async def _request(self, peer: str, fields: dict) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        target = PeerID.from_base58(peer)
        stub = self.get_stub(self._p2p, target, namespace=self.prefix)
        if self._secret is not None:
            fields["token"] = self._secret.transfer_token(self._p2p.peer_id.to_bytes(), target.to_bytes())
        return await stub.rpc_audit_fetch(averaging_pb2.DownloadData(metadata=self.serializer.dumps(fields)))

    async def _fetch_receipt(self, record: AuditRound, reducer: str) -> tuple[Receipt | None, bytes | None, dict]:
        """``reducer``'s signed receipt, its blob, and the per-part digests it lists under it, by sender (checked
        against the receipt by ``audit.judge`` where a sample needs them)."""
        request = dict(group_id=record.runner.group_id, what=AuditRequest.receipt.value)
        stream = await self._request(reducer, request)
        async for message in stream:
            reply = bounded_loads(message.metadata)
            blob = reply.get("receipt") if isinstance(reply, dict) else None
            receipt = open_receipt(blob) if isinstance(blob, bytes) else None
            if receipt is not None:  # with the senders' statements it serves beside it (``audit.vouching``)
                receipt = with_statements(receipt, reply.get("statements"))
            ok = receipt is not None and receipt.group_id == record.runner.group_id and receipt.reducer == reducer
            if ok and set(receipt.senders) <= set(record.members):
                listed = reply.get("listed")
                usable = isinstance(listed, list) and len(listed) == len(receipt.senders)
                listed = dict(zip(receipt.senders, listed)) if usable else {}
                return receipt, blob, {s: d for s, d in listed.items() if isinstance(d, list)}
            break
        return None, None, {}

    async def _fetch_returned(self, record: AuditRound, sender: str, reducer: str) -> int:
        """``sender``'s word of how many parts of ``reducer``'s average came back to it before its stream broke, if it
        did (0 if it says nothing we can read)."""
        request = dict(group_id=record.runner.group_id, what=AuditRequest.returned.value, reducer=reducer)
        stream = await self._request(sender, request)
        async for message in stream:
            return returned_count(message.metadata)
        return 0

    async def _fetch_parts(
        self,
        record: AuditRound,
        sender: str,
        reducer: str,
        limit: int,
        what: AuditRequest = AuditRequest.parts,
        indices=None,
        of: str | None = None,
    ) -> list:
        fields = dict(group_id=record.runner.group_id, what=what.value, reducer=reducer)
        if indices is not None:
            fields["indices"] = list(indices)
        if of is not None:  # ``AuditRequest.held``: the parts ``of`` sent the reducer, asked of the reducer
            fields["sender"] = of
        stream = await self._request(sender, fields)
        parts, total = [], 0
        async for message in stream:
            total += len(message.tensor_part.buffer)
            record.fetched_bytes += len(message.tensor_part.buffer)
            if total > limit:
                raise AllreduceException(f"{sender[-8:]} sent more audit data than it could have sent")
            parts.append(message.tensor_part)
        return parts

    async def _parts_of_senders(
        self, record: AuditRound, receipt: Receipt, senders: list[str], wanted: dict[str, list[int]],
        indices: typing.Callable[[str], list[int] | None], fits: typing.Callable[[str, list], bool],
        shows: typing.Callable[[str, list], bool], limit: int, deadline: float,
    ) -> tuple[dict[str, list], dict[str, list | None]]:  # fmt: skip
        """Each of ``senders``' parts ``wanted`` for the audit of ``receipt.reducer`` (asked as ``indices`` gives them:
        None for all) that ``fits`` its bounds, as that sender serves them; and, for one that has not served parts
        that ``shows`` (they are what it signed) by the time kept back for it (``held_reserve``: it is gone, stalls,
        or serves other bytes), as they came to the reducer (``AuditRequest.held``; None where the reducer did not
        show them in bounds). A sender that stalls cannot use up the reducer's time: the request to the reducer
        starts by then however long the sender's runs."""
        reducer, ours = receipt.reducer, record.sent_to(receipt.reducer) or []
        at_once = asyncio.Semaphore(HELD_AT_ONCE)

        async def one(sender: str) -> tuple[list | None, list | None, bool]:
            asked = indices(sender)
            own = asyncio.ensure_future(
                _retried(lambda: self._fetch_parts(record, sender, reducer, limit, indices=asked), deadline)
            )
            try:  # however the audit ends (cancelled with its round), the sender's request ends with it
                return await from_either(sender, own)
            finally:
                own.cancel()

        async def from_either(sender: str, own: asyncio.Future) -> tuple[list | None, list | None, bool]:
            size = sum(len(ours[i].buffer) for i in wanted[sender] if i < len(ours))  # as large as ours
            hedge = deadline - held_reserve(size, deadline - time.monotonic())
            await asyncio.wait({own}, timeout=max(0.0, hedge - time.monotonic()))
            if shows(sender, parts := _fitting(own, sender, fits)):
                return parts, None, False
            held = None
            try:
                async with at_once:  # under the reducer's per-requester limit (``AUDIT_LIMITS``)
                    held = await _retried(
                        lambda: self._fetch_parts(record, reducer, reducer, limit, AuditRequest.held, wanted[sender],
                                                  of=sender),
                        deadline,
                    )  # fmt: skip
            except Exception:  # every try raised: it did not show them
                logger.debug("%s did not show %s's parts it holds", reducer, sender, exc_info=True)
            held = held if held is not None and fits(sender, held) else None
            if not shows(sender, held) and not own.done():  # the sender's own may still come in time
                await asyncio.wait({own}, timeout=max(0.0, deadline - time.monotonic()))
            return _fitting(own, sender, fits), held, True

        results = await asyncio.gather(*(one(s) for s in senders))
        served = {s: own for s, (own, _, _) in zip(senders, results) if own is not None}
        held = {s: from_reducer for s, (_, from_reducer, asked) in zip(senders, results) if asked}
        return served, held

    async def _tell_group(
        self, record: AuditRound, reducer: str, verdict: Verdict, checked: list[int], deadline: float,
        receipt: bytes | None = None,
    ) -> None:  # fmt: skip
        """Our verdict on ``reducer`` to every groupmate; an accusation names the parts we checked, so that each
        groupmate's own check of it includes them. With it go the reducer's signed ``receipt`` and the ``Output``
        every reducer signed for the average it returned us: each groupmate compares them with its own."""
        me = self.peer_id.to_base58()
        fields = dict(group_id=record.runner.group_id, reducer=reducer, verdict=verdict.value)
        fields["outputs"] = dict(record.runner.output_statements)
        if receipt is not None:
            fields["receipt"] = receipt
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
