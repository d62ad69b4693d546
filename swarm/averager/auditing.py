"""The averager process's side of checked reducers (``swarm.defence.audit``) and bans.

After every all-reduce, before anything is written into the buffers, each groupmate
serves what it sent each reducer and, as a reducer, its signed receipt; it audits the
reducers ``audit.auditor_of`` gives it, tells the group what it found, re-checks any
accusation itself, and drops the slice of a reducer it caught (read as zeros, as a
vanished reducer's). Every fetch and every wait is bounded: the audits and the verdicts by
``audit_timeout``, and re-checks of accusations by another ``audit_timeout`` after that.

A reducer caught here is banned: ``swarm.averager.refusals`` refuses it from then on.

This is a mixin of ``PseudoGradientAverager``: the coroutines run in the averager process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import typing
from collections import OrderedDict

from swarm.averager.allreduce import ExactAllReduceRunner, encode_average
from swarm.averager.audit_requests import _retried
from swarm.averager.audit_serving import AuditRound, AuditServing
from swarm.averager.bounds import admitted
from swarm.averager.findings import Found, one_a_peer
from swarm.averager.held import Dropped, HeldPart
from swarm.averager.proof_serving import AverageProofs
from swarm.averager.repair import UNANSWERED_STRIKES, SliceRepair, drop_slice, slices_to_repair
from swarm.defence.audit import (
    DROP_ONLY,
    FALSE_ACCUSATION,
    GUILTY,
    UNCHECKABLE,
    Verdict,
    auditor_of,
    judge,
    sample_parts,
    served_as_signed,
    suspect_parts,
    too_few,
)
from swarm.defence.proofs import equivocation_proof, equivocations, forgery_proof
from swarm.defence.receipts import Receipt, digest_of, digest_parts, lists_every_sender, open_receipt, statement_hash

logger = logging.getLogger(__name__)

STRIKES = frozenset({Verdict.unanswered, *UNCHECKABLE})  # verdicts that leave a reducer unchecked: a strike each


class Auditing(AuditServing, SliceRepair, AverageProofs):
    """Checked reducers, in the averager process: our audits of our reducers (serving our groupmates' audits:
    ``AuditServing``; fetching a slice that came in part again: ``SliceRepair``)."""

    def _init_auditing(self, audit: bool, audit_timeout: float, audit_parts: int = 0) -> None:
        self._audit_enabled, self._audit_timeout = audit, audit_timeout
        self._audit_parts = audit_parts  # parts of each reducer's slice an audit checks (0: all)
        self._audit_rounds: OrderedDict[bytes, AuditRound] = OrderedDict()
        self._unanswered: dict[str, int] = {}  # reducer -> our audits of it in a row it left unanswered
        self._init_proofs()

    # ---- one round's audits, phase by phase -----------------------------------------------------------------

    async def _audit_group(self, runner: ExactAllReduceRunner, record: AuditRound, held: list[list[HeldPart]]):
        """Audit this round's reducers; returns the held parts with caught reducers' slices dropped, the
        number of values dropped, what was found (for the host: ``AllReduceOutcome.findings``) and the slices
        that came in part and could not be repaired (``AllReduceOutcome.repair_failures``)."""
        owner = self._index_slices(runner, record, held)
        me = self.peer_id.to_base58()
        own = 0
        if record.outputs.get(me) and not any(isinstance(p, Dropped) for p in record.outputs[me]):
            await self._sign_receipt(runner, record)
            if too_few(runner.counted_parts(), range(len(record.outputs[me]))):  # as our auditor will find it: the
                own = drop_slice(held, owner, me)  # group drops our slice, and so do we (kept, we would end apart)
        record.done = True
        deadline = time.monotonic() + self._audit_timeout
        # a slice we audit that came to us in part is fetched again, audited and its verdict told, beside our audits
        # of the others: a reducer that cuts its stream to its auditor is checked, and the group hears it in time
        refused = {p.to_base58() for p in runner.refused_senders}
        partial = slices_to_repair(record.outputs, me, refused)
        ours = [r for r in partial if self._accuser(record, r) == me]
        # one we audit whose parts we refused (its slice dropped on purpose, and never audited by us): each groupmate
        # checks it itself rather than wait out our verdict (it could send only us bad parts, then lie to the rest)
        unaudited = [r for r in record.outputs if r in refused and r != me and self._accuser(record, r) == me]
        tell = (self._tell_group(record, r, Verdict.withheld, [], deadline) for r in unaudited)
        (early, early_failures, early_found), found, _ = await asyncio.gather(
            self._repair_then_audit(runner, record, held, owner, ours, deadline),
            self._audit_ours(record, _whole(record), deadline),
            asyncio.gather(*tell),
        )
        found += early_found
        reducers = _whole(record)
        # a slice that came in part is fetched again below: its auditor's verdict is heard like the others'
        waiting = self._verdicts_to_wait_for(record, reducers, [r for r in partial if r not in ours])
        await self._hear_verdicts(record, waiting + self._our_auditor_present(record, reducers), deadline)
        found += await self._split_averages(record, found)
        recheck_deadline = time.monotonic() + self._audit_timeout
        rest = [r for r in partial if r not in ours]
        dropped, repair_failures, _, withheld = await self._repair_partial_slices(
            runner, record, held, owner, recheck_deadline, only=rest
        )
        found += withheld
        proven = {peer for peer, verdict, *_ in found if verdict == Verdict.equivocated}
        whole = _whole(record)
        rechecked = [r for r in waiting if r not in proven and r in whole]
        found += await self._recheck_accusations(record, rechecked, recheck_deadline)
        found += self._accusations_of_us(record)
        findings, more = self._apply(found, held, owner)
        record.outputs.clear()
        self._keep_round(runner.group_id)
        return held, own + early + dropped + more, findings, early_failures + repair_failures

    def _index_slices(self, runner: ExactAllReduceRunner, record: AuditRound, held: list[list[HeldPart]]) -> dict:
        """Which groupmate reduced each held part, ``(tensor, part) -> reducer``; and each reducer's average as
        we received it, into ``record.outputs``."""
        container, members = runner.tensor_part_container, record.members
        flat = [(t, j) for t, parts in enumerate(held) for j in range(len(parts))]
        owner, offset = {}, 0
        for index, count in enumerate(container.num_parts_by_peer):
            for t, j in flat[offset : offset + count]:
                owner[(t, j)] = members[index]
            record.outputs[members[index]] = [held[t][j] for t, j in flat[offset : offset + count]]
            # the parts of its average that came back before its stream broke, if it did: a prefix, in order
            record.returned[members[index]] = sum(not isinstance(p, Dropped) for p in record.outputs[members[index]])
            offset += count
        return owner

    async def _sign_receipt(self, runner: ExactAllReduceRunner, record: AuditRound) -> None:
        """As a reducer: sign what each sender sent us (by digest, and weight) and the average we sent back."""
        me = self.peer_id.to_base58()
        senders = [p.to_base58() for p in runner.sender_peer_ids]
        counts = runner.counted_parts()  # of a sender whose stream broke, the parts our average holds
        record.listed = [d[:k] for d, k in zip(runner.input_digests, counts)]
        inputs = [digest_of(d) if d else b"" for d in record.listed]
        record.statements = [
            b"" if p == me else runner.statement_of(i, k) for i, (p, k) in enumerate(zip(senders, counts))
        ]
        receipt = Receipt(runner.group_id, me, tuple(senders), tuple(runner.input_weights), tuple(inputs),
                          digest_parts(record.outputs[me]), tuple(map(statement_hash, record.statements)),
                          runner.nonce, tuple(counts))  # fmt: skip
        record.receipt = await asyncio.get_event_loop().run_in_executor(None, receipt.sign)
        record.own_output = record.outputs[me]
        logger.debug("receipt: %s", [(s[-8:], d.hex()[:12]) for s, d in zip(senders, inputs)])

    async def _audit_ours(self, record: AuditRound, reducers: list[str], deadline: float) -> list[Found]:
        """Audit the reducers we are the auditor of, and tell the group each verdict. A reducer that did not
        answer is usually one that vanished: nothing is dropped on that alone (the group must agree), but one that
        is still around and leaves ``UNANSWERED_STRIKES`` audits of ours in a row unanswered is banned. One that
        withheld its own parts cannot be checked: its slice is dropped, but that alone is no proof (an honest one
        was once seen serving other bytes, cause unknown), so it is a strike, as unanswered."""
        me, group_id = self.peer_id.to_base58(), record.runner.group_id
        mine = [r for r in reducers if auditor_of(record.members, group_id, r) == me]
        results = await asyncio.gather(*(self._audit_one(record, r, deadline) for r in mine))
        receipts = [record.receipts.get((me, r)) for r in mine]
        tell = (self._tell_group(record, r, v, c, deadline, b) for r, (v, _, c), b in zip(mine, results, receipts))
        await asyncio.gather(*tell)
        found = []
        for reducer, (verdict, blob, _) in zip(mine, results):
            strikes = self._strike(reducer, verdict)
            blob = blob if verdict in GUILTY else None  # only a proven lie is published with the liar's receipt
            drop = verdict in GUILTY or verdict in UNCHECKABLE or verdict in DROP_ONLY
            found.append((reducer, verdict, blob, drop, verdict in GUILTY or strikes >= UNANSWERED_STRIKES))
        return found

    async def _split_averages(self, record: AuditRound, found_before: list[Found]) -> list[Found]:
        """Reducers that signed two digests of their slice's average in this group (``proofs.equivocations``): to two
        groupmates, or to one and in their receipt. Every verdict carries the teller's signed outputs and the receipt
        it audited against, so each groupmate that heard the same verdicts drops the same slices; the proof goes
        with the accusation, and every peer that reads it bans the reducer. A reducer our own audit passed (we hold
        the average its receipt names) is found all the same."""
        me, group_id = self.peer_id.to_base58(), record.runner.group_id
        known = {peer for peer, verdict, *_ in found_before if verdict == Verdict.equivocated}
        blobs = [*record.heard_outputs.values(), *record.receipts.values(), *record.runner.output_statements.values()]
        found = await asyncio.get_event_loop().run_in_executor(None, equivocations, blobs, group_id, record.members)
        for reducer in found:
            logger.debug("%s signed two averages of its slice for this group", reducer)
        return [
            (reducer, Verdict.equivocated, proof, True, True)
            for reducer, proof in found.items()
            if reducer in record.members and reducer != me and reducer not in known
        ]

    async def _repair_then_audit(
        self,
        runner: ExactAllReduceRunner,
        record: AuditRound,
        held: list,
        owner: dict,
        ours: list[str],
        deadline: float,
    ) -> tuple[int, list[dict], list[Found]]:
        """The slices we audit that came to us in part: fetched again, then audited and told; one that cannot be had
        again is told at once (``_tell_unrepaired``). The values dropped, the failures, and what was found."""
        if not ours:
            return 0, [], []
        dropped, failures, restored, found = await self._repair_partial_slices(
            runner, record, held, owner, deadline, only=ours
        )
        await self._tell_unrepaired(record, failures, deadline)
        return dropped, failures, found + await self._audit_ours(record, restored, deadline)

    def _verdicts_to_wait_for(self, record: AuditRound, reducers: list[str], partial: list[str] = ()) -> list[str]:
        """The reducers (whole, or ``partial``: to fetch again) audited by another groupmate that is still with us
        (one whose own slice never came is gone)."""
        me, group_id = self.peer_id.to_base58(), record.runner.group_id
        auditor = lambda r: auditor_of(record.members, group_id, r)  # noqa: E731
        return [r for r in [*reducers, *partial] if r != me and auditor(r) != me and auditor(r) in reducers]

    def _our_auditor_present(self, record: AuditRound, reducers: list[str]) -> list[str]:
        """Ourselves, if we reduced a slice and our auditor is still with us: its verdict on us is waited for like
        the others (it tells every groupmate at once), so that an accusation of us is heard before we answer it
        (``_accusations_of_us``); heard late, we went on grouping with a liar our groupmates had banned."""
        me = self.peer_id.to_base58()
        ours = self._accuser(record, me)
        return [me] if me in reducers and ours is not None and ours != me and ours in reducers else []

    async def _hear_verdicts(self, record: AuditRound, waiting: list[str], deadline: float) -> None:
        while any(r not in record.verdicts for r in waiting) and time.monotonic() < deadline:
            record.news.clear()
            try:
                await asyncio.wait_for(record.news.wait(), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break

    async def _recheck_accusations(self, record: AuditRound, waiting: list[str], deadline: float) -> list[Found]:
        """An accusation is checked by every groupmate itself (the accuser's sample included) before anything is
        dropped: one that our check passes bans its author instead."""
        found = []
        for reducer in waiting:
            heard = record.verdicts.get(reducer)
            if heard not in GUILTY and heard not in UNCHECKABLE and heard not in DROP_ONLY:
                continue
            own, blob, _ = await self._audit_one(record, reducer, deadline, record.accused.get(reducer, ()))
            if own in DROP_ONLY:  # a sender it lists as dropped says it sent everything: we drop it too
                found.append((reducer, own, None, True, False))
            elif own == Verdict.inconclusive and heard in UNCHECKABLE and _omits(blob, record, reducer):
                # it says its auditor dropped mid-way, the auditor says it sent everything: one of them lies, so the
                # slice goes for everyone (no strike: that rests on the auditor's word), as it goes for the auditor
                found.append((reducer, Verdict.withheld, None, True, False))
            elif own == Verdict.passed and heard in GUILTY:
                found.append((self._accuser(record, reducer), FALSE_ACCUSATION, None, False, True))
            elif own in GUILTY:
                found.append((reducer, own, blob, True, True))
            elif own in STRIKES:  # it will not let us check it either: we drop
                # its slice, as its auditor does; accused of a lie it will not let us check, it is banned
                strikes = self._strike(reducer, own)
                found.append((reducer, own, None, True, heard in GUILTY or strikes >= UNANSWERED_STRIKES))
        return found

    def _accusations_of_us(self, record: AuditRound) -> list[Found]:
        """Our auditor's word that we lied as a reducer: we know our own average, so it is a false accusation, and
        we ban its author as every groupmate whose own check of us passes does (were we left to group with it, the
        groupmates that banned it and we would merge other groups in the second stage, and end apart)."""
        me = self.peer_id.to_base58()
        if record.verdicts.get(me) not in GUILTY or record.receipt is None:
            return []
        return [(self._accuser(record, me), FALSE_ACCUSATION, None, False, True)]

    @staticmethod
    def _accuser(record: AuditRound, reducer: str) -> str | None:
        return auditor_of(record.members, record.runner.group_id, reducer)

    def _apply(self, found: list[Found], held: list[list[HeldPart]], owner: dict) -> tuple[list[dict], int]:
        """Bans and dropped slices, as found: the findings for the host, and the values dropped."""
        findings, dropped = [], 0
        for peer, verdict, blob, drop, ban in one_a_peer(found):
            if not (drop or ban):
                continue
            if ban:
                self._banned.add(peer)
            if drop:
                dropped += drop_slice(held, owner, peer)
            findings.append(dict(peer=peer, verdict=str(verdict), banned=ban, discarded=drop, receipt=blob))
            logger.debug("audit of %s: %s (dropped: %s, banned: %s)", peer, verdict, drop, ban)
        return findings, dropped

    # ---- one audit --------------------------------------------------------------------------------------------

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
        record.receipts[(me, reducer)] = blob
        if not lists_every_sender(receipt, [p.to_base58() for p in record.runner.sender_peer_ids]):
            logger.debug("audited %s: its signed receipt leaves senders out", reducer)
            return Verdict.withheld, blob, []  # signed, so alive, and uncheckable as it stands: struck
        outputs = record.outputs[reducer]  # whole: we audit no slice that came to us in part
        count, numels = len(outputs), [math.prod(p.size) for p in outputs]  # parts in its slice, and each one's size
        if 0 < self._audit_parts < count:  # a sample: those drawn at random, and those that stand out
            suspects = await asyncio.get_event_loop().run_in_executor(
                None, suspect_parts, outputs, ours, self._audit_parts
            )
            also = [*also, *suspects]
        checked = sample_parts(count, self._audit_parts, also)
        # each sender's parts that are checked: of one whose stream broke, only those the receipt counts of it
        wanted = {s: [i for i in checked if i < k] for s, k in zip(receipt.senders, receipt.counted(count))}
        indices = lambda s: None if len(wanted[s]) == count else wanted[s]  # noqa: E731 (None: all its parts)
        limit = 4 * sum(numels[i] for i in checked) + (1 << 16)
        others = [s for s in receipt.senders if s not in (me, reducer) and wanted[s]]
        compression = record.runner.tensor_part_container.compression.compression_type
        fits = lambda s, parts: admitted(parts, [numels[i] for i in wanted[s]], compression)  # noqa: E731
        counts = dict(zip(receipt.senders, receipt.counted(count)))
        shows = lambda s, parts: served_as_signed(receipt, s, parts, wanted[s], counts[s], listed.get(s))  # noqa: E731

        async def its_own() -> list | None:  # its own parts decide "withheld", which drops its slice: a stream that
            fetch = lambda: self._fetch_parts(record, reducer, reducer, limit, indices=indices(reducer))  # noqa: E731
            for _ in range(2):  # ended short or served other bytes without an error (errors are retried) is fetched
                try:  # once more before that is said
                    parts = await _retried(fetch, deadline)
                except Exception as e:
                    logger.debug("no audit parts from %s: %r", reducer, e)
                    return None
                if fits(reducer, parts) and shows(reducer, parts):
                    break
                logger.debug("%s's own parts did not match its receipt", reducer)
            return parts if fits(reducer, parts) else None

        # a sender that is gone, stalls, or serves other bytes than it signed (a liar's accomplice): its parts as the
        # reducer holds them, checked against the sender's signed statement (``judge``'s ``held``)
        (served, held), own, more_back = await asyncio.gather(  # (a reducer that sent nothing, AUX: none of its own)
            self._parts_of_senders(record, receipt, others, wanted, indices, fits, shows, limit, deadline),
            its_own() if wanted.get(reducer) else asyncio.sleep(0),
            self._a_sender_had_more_back(record, receipt, count, deadline),  # beside the fetches: its own time
        )
        served[me] = [ours[i] for i in wanted.get(me, []) if i < len(ours)]
        if own is not None:
            served[reducer] = own
        returned = {me: record.returned.get(reducer, 0)}  # as it first came, not fetched again

        def check() -> Verdict:
            return judge(
                receipt, record.outputs[reducer], served, numels, self.aggregation,
                lambda values: encode_average(values, compression), indices=checked, listed=listed,
                max_weight=record.runner.max_weight, returned=returned, held=held,
            )  # fmt: skip

        verdict = await asyncio.get_event_loop().run_in_executor(None, check)
        if verdict in (Verdict.inconclusive, Verdict.passed) and more_back:
            verdict = Verdict.omitted
        if verdict == Verdict.forged:  # published with the statement its receipt does not keep to, when one does not
            blob = forgery_proof(blob, receipt) or blob
        elif verdict == Verdict.equivocated:  # and with the digest it signed for the average it returned us
            blob = equivocation_proof([blob, record.runner.output_statements.get(reducer, b"")]) or blob
        elif verdict == Verdict.wrong_average:  # a proof for any peer that reads our accusation, made beside the rest
            self._prove_later(blob, receipt, list(record.outputs[reducer]), [served, held], wanted, listed)
        logger.debug(
            "audited %s: %s (parts from %d of %d senders, %d of %d parts)", reducer, verdict, len(served),
            len(receipt.senders), len(checked), len(numels),
        )  # fmt: skip
        return verdict, blob, [] if len(checked) == count else checked

    async def _a_sender_had_more_back(self, record: AuditRound, receipt: Receipt, parts: int, deadline: float) -> bool:
        """Whether a sender the receipt counts short (its stream broke) says more parts of the reducer's average came
        back to it than the receipt counts of it, which an honest reducer never does (it returns a part's average
        once it counted the sender's part): then the reducer or that sender lies. A sender that is gone says 0."""
        me, counts = self.peer_id.to_base58(), dict(zip(receipt.senders, receipt.counted(parts)))
        short = [s for s in receipt.senders if s in receipt.dropped(parts) and s not in (me, receipt.reducer)]
        asked = lambda sender: self._fetch_returned(record, sender, receipt.reducer)  # noqa: E731
        said = await asyncio.gather(*(_retried(lambda s=s: asked(s), deadline) for s in short), return_exceptions=True)
        return any(isinstance(n, int) and n > counts[s] for s, n in zip(short, said))

    def _strike(self, reducer: str, verdict: Verdict) -> int:
        """Our audits of ``reducer`` in a row it could not be checked in (unanswered or withheld), this one
        included; 0 once it is checked."""
        strikes = self._unanswered.pop(reducer, 0) + 1 if verdict in STRIKES else 0
        if strikes:
            self._unanswered[reducer] = strikes
        return strikes


def _whole(record: AuditRound) -> list[str]:
    """The reducers whose whole average we hold (as it came, or fetched again)."""
    return [m for m, out in record.outputs.items() if out and not any(isinstance(p, Dropped) for p in out)]


def _omits(blob: bytes | None, record: AuditRound, reducer: str) -> bool:
    """Whether ``reducer``'s signed receipt ``blob`` lists its auditor as dropped before its last part."""
    receipt = open_receipt(blob) if blob is not None else None
    auditor = auditor_of(record.members, record.runner.group_id, reducer)
    return receipt is not None and auditor in receipt.dropped(len(record.outputs[reducer]))
