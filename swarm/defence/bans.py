"""Bans: peers caught by checked reducers, kept out for ``BAN_ROUNDS`` rounds, and the accusations they publish.

A peer bans a groupmate only on evidence it holds itself: its own audit (``swarm.averager.auditing``)
caught it returning a wrong average (or accusing an honest reducer), or, as its reducer, it received
parts from it that no honest client sends (NaN or infinite values, a wrong size, bytes that do not
decode). It then publishes an accusation in its progress record, with the reducer's own signed
receipt inside when there is one. An accusation that carries its proof is applied by every peer that
reads it (``proven_bans``): a reducer's signed receipt listing a digest or a weight that the sender's
statement it signed for does not give, or two digests of one group's average that it signed
(``swarm.defence.proofs``), rest on the accused's own signature. An accusation of a wrong average carries the
receipt, and its accuser serves the rest of the proof (one part of the slice, the parts it was averaged from, and the
digests binding them to the receipt): a reader fetches it, recomputes that part, and bans only if the reducer's
signed average is not what the parts make (``swarm.defence.proof_checks``).
Any other accusation is shown (``accused``; "quorum" when ``QUORUM`` groupmates of the accused, each
named as a sender in its own receipt, accuse it), never applied: keys are free, so two keys that
joined an honest reducer's group could otherwise get it banned by every peer, those whose own audit
of it passed included. A liar still meets an audit in every group it reduces for, and each of its
auditors bans it.

A ban lasts ``BAN_ROUNDS`` outer rounds from the round it was caught in, then is lifted (a peer caught
again is banned again): a peer that was wrongly judged, or whose machine was broken, is not out of
the run forever, and a liar gains one round in ``BAN_ROUNDS`` before its next auditor catches it.

A banned peer is dropped from this peer's swarm view, so it is never a state donor, a
replay donor, a vote on the global epoch or the checksum, or a mate to wait for; the
averager refuses it in matchmaking and as a groupmate. Bans are kept in
``bans.json`` next to the state files, so a restart keeps them.

The rules (``proven_bans``, ``quorum_bans``, ``accusation_entry``) are pure functions of records.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from swarm.defence.audit import FALSE_ACCUSATION, MALFORMED, Verdict
from swarm.defence.proof_checks import Claim, ProofChecks, claims
from swarm.defence.proofs import proves_equivocation, proves_forgery
from swarm.defence.receipts import open_receipt
from swarm.dht.records import PeerEntry, ProgressRecord

logger = logging.getLogger(__name__)

_open_receipt = functools.lru_cache(maxsize=256)(open_receipt)  # records are re-read every second
QUORUM = 2  # distinct groupmates of the accused whose accusations are shown as a quorum (never applied as a ban)
BAN_ROUNDS = 100  # outer rounds a ban lasts, from the round the peer was caught in
MAX_ACCUSATIONS = 8  # kept in our record, newest last


class BanReason(enum.StrEnum):
    wrong_average = Verdict.wrong_average.value  # a reducer's average was not the robust mean of its inputs
    equivocated = Verdict.equivocated.value  # a reducer signed for another average than it sent
    unanswered = Verdict.unanswered.value  # accused by its auditor, it would not let us check it either
    withheld = Verdict.withheld.value  # it signed for rounds, then hid its parts or its average, twice in a row
    forged = Verdict.forged.value  # its signed receipt lists a digest or a weight its sender did not sign
    false_accusation = FALSE_ACCUSATION  # an auditor accused a reducer every other check found honest
    malformed = MALFORMED  # as a sender, it sent us (as its reducer) parts no honest client sends


# the reasons an accusation can prove, each with its check (``swarm.defence.proofs``): the accused it proves, or None
_PROOFS = {
    BanReason.forged: functools.lru_cache(maxsize=256)(proves_forgery),
    BanReason.equivocated: functools.lru_cache(maxsize=256)(lambda proof: proves_equivocation(proof)),
}


@dataclass(frozen=True)
class Ban:
    peer_id: str
    reason: BanReason
    epoch: int  # the round it was caught in
    by: tuple[str, ...]  # who caught it: ourselves ("self"), or the accusers
    since: float  # wall-clock time

    def to_json(self) -> dict:
        return dict(asdict(self), reason=self.reason.value, by=list(self.by))

    def lifted_at(self, epoch: int) -> bool:
        return epoch >= self.epoch + BAN_ROUNDS


def accusation_entry(finding: dict, epoch: int) -> dict | None:
    """The accusation we publish for a ban of ours: with the reducer's signed receipt when there is one (only
    those, for a wrong average or equivocation, count towards a quorum; the rest say why we banned)."""
    if not finding.get("banned"):
        return None
    try:
        reason = BanReason(finding.get("verdict"))
    except ValueError:
        return None
    receipt = finding.get("receipt") if isinstance(finding.get("receipt"), bytes) else b""
    return dict(accused=str(finding["peer"]), verdict=reason.value, epoch=int(epoch), receipt=receipt)


def accused(records: Iterable[ProgressRecord]) -> dict[str, dict]:
    """Every peer someone banned, and why, for dashboards and ``status --json``: ``{peer_id: {"reasons",
    "by", "epoch", "quorum", "proven"}}``; ``quorum`` is whether two of its groupmates accuse it (``quorum_bans``:
    shown, never applied), ``proven`` whether an accusation carries a proof, which every peer applies
    (``proven_bans``)."""
    records = list(records)
    quorum, proven = quorum_bans(records), proven_bans(records)
    found: dict[str, dict] = {}
    for record in records:
        for entry in record.accusations:
            item = found.setdefault(entry.accused, dict(reasons=set(), by=set(), epoch=entry.epoch))
            item["reasons"].add(entry.verdict)
            item["by"].add(record.peer_id)
            item["epoch"] = min(item["epoch"], entry.epoch)
    return {
        peer: dict(
            reasons=sorted(i["reasons"]),
            by=sorted(i["by"]),
            epoch=i["epoch"],
            quorum=peer in quorum,
            proven=peer in proven,
        )  # fmt: skip
        for peer, i in found.items()
    }


def quorum_bans(records: Iterable[ProgressRecord]) -> dict[str, Ban]:
    """Peers accused, each with a receipt signed by the accused, by ``QUORUM`` distinct senders of that receipt."""
    accusers: dict[str, dict[str, tuple[BanReason, int]]] = {}
    for record in records:
        for entry in record.accusations:
            receipt = _open_receipt(entry.receipt)
            if receipt is None or receipt.reducer != entry.accused or record.peer_id not in receipt.senders:
                continue
            if entry.accused == record.peer_id:
                continue
            try:
                reason = BanReason(entry.verdict)
            except ValueError:
                continue
            if reason not in (BanReason.wrong_average, BanReason.equivocated):
                continue  # the other reasons rest on the accuser's word alone
            accusers.setdefault(entry.accused, {})[record.peer_id] = (reason, entry.epoch)
    bans = {}
    for accused, by in accusers.items():
        if len(by) >= QUORUM:
            reason, epoch = min(by.values(), key=lambda item: item[1])
            bans[accused] = Ban(accused, reason, epoch, tuple(sorted(by)), time.time())
    return bans


def proven_bans(records: Iterable[ProgressRecord]) -> dict[str, Ban]:
    """Peers whose accusers published proof that any peer can check (``swarm.defence.proofs``): a receipt signed by
    the accused that lists what its sender's statement does not give (forged), or two digests of one group's
    average both signed by the accused (equivocated). One such accusation is enough: it rests on the accused's own
    signature, not on the accuser's word."""
    bans: dict[str, Ban] = {}
    for record in records:
        for entry in record.accusations:
            proves = _PROOFS.get(entry.verdict)
            if proves is None or entry.accused == record.peer_id or entry.accused in bans:
                continue
            if proves(entry.receipt) == entry.accused:
                reason = BanReason(entry.verdict)
                bans[entry.accused] = Ban(entry.accused, reason, entry.epoch, (record.peer_id,), time.time())
    return bans


class BanList:
    """This peer's bans, kept in a JSON file (``bans.json``) so a restart keeps them."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.bans: dict[str, Ban] = {}
        try:
            for item in json.loads(self.path.read_text()):
                ban = Ban(str(item["peer_id"]), BanReason(item["reason"]), int(item["epoch"]), tuple(item["by"]),
                          float(item["since"]))  # fmt: skip
                self.bans[ban.peer_id] = ban
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("%s is unreadable; starting with no bans", self.path)
            logger.debug("bans file", exc_info=True)

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self.bans

    def add(self, ban: Ban) -> bool:
        """True if the peer was not banned before (the file is rewritten then)."""
        if ban.peer_id in self.bans:
            return False
        self.bans[ban.peer_id] = ban
        self._write()
        return True

    def lift(self, epoch: int) -> list[Ban]:
        """Lift the bans that have lasted ``BAN_ROUNDS`` by round ``epoch``; those lifted."""
        lifted = [ban for ban in self.bans.values() if ban.lifted_at(epoch)]
        for ban in lifted:
            del self.bans[ban.peer_id]
        if lifted:
            self._write()
        return lifted

    def _write(self) -> None:
        tmp = self.path.with_name(f".tmp-{self.path.name}")
        try:
            tmp.write_text(json.dumps([b.to_json() for b in self.bans.values()], indent=1))
            os.replace(tmp, self.path)
        except OSError:
            logger.debug("could not write %s", self.path, exc_info=True)


class Guard:
    """Keeps a peer's bans, from its own evidence; publishes its accusations; lifts bans that have lasted.
    ``refuse`` is given every peer banned now, each time that changes."""

    def __init__(
        self,
        bans: BanList,
        own_peer_id: str,
        *,
        publish: Callable[[list[dict]], None],
        refuse: Callable[[Iterable[str]], None],
        announce: Callable[[Ban], None],
        check: Callable[[str, bytes], bool | None] | None = None,
    ):
        """``check(accuser, receipt)``: whether the accuser serves a proof that the receipt's reducer averaged wrong
        (``swarm.averager.proof_serving``); without it, such accusations are only shown."""
        self.bans, self.own_peer_id = bans, own_peer_id
        self._publish, self._refuse, self._announce = publish, refuse, announce
        self.accusations: list[dict] = []
        self._epoch: int | None = None  # the latest round we had findings for
        self._lock = threading.Lock()  # bans come from the reader's thread, the rounds' and the proof checks'
        self._checks = None if check is None else ProofChecks(check, self._on_proof)
        if bans.bans:
            refuse(bans.bans)

    def on_findings(self, findings: Sequence[dict], epoch: int) -> None:
        """What a round's audits found (``AllReduceOutcome.findings``)."""
        self._epoch = epoch
        for finding in findings:
            if finding.get("banned"):
                self._ban(Ban(str(finding["peer"]), BanReason(finding["verdict"]), epoch, ("self",), time.time()))
            entry = accusation_entry(finding, epoch)
            if entry is not None:
                self.accusations = (self.accusations + [entry])[-MAX_ACCUSATIONS:]
                self._publish(self.accusations)
        with self._lock:
            lifted = self.bans.lift(epoch)
            if lifted:
                logger.info("bans lifted after %d rounds: %s", BAN_ROUNDS, ", ".join(b.peer_id[-8:] for b in lifted))
                self._refuse(list(self.bans.bans))

    def filter(self, entries: Sequence[PeerEntry]) -> list[PeerEntry]:
        """The entries of peers that are not banned. Others' accusations are applied only when they carry their
        proof (``proven_bans``); the rest are shown (``accused``)."""
        for ban in proven_bans(e.record for e in entries).values():
            lifted = self._epoch is not None and ban.lifted_at(self._epoch)  # its accuser still shows it
            if ban.peer_id != self.own_peer_id and ban.peer_id not in self.bans and not lifted:
                epoch = ban.epoch if self._epoch is None else min(ban.epoch, self._epoch)  # no ban from the future
                self._ban(replace(ban, epoch=epoch))
        if self._checks is not None:  # a wrong average, whose proof the accuser serves: fetched, checked, then applied
            found = claims((e.record for e in entries), self.own_peer_id, self.bans, self._checks.seen)
            self._checks.offer(c for c in found if self._epoch is None or c.epoch + BAN_ROUNDS > self._epoch)
        return [e for e in entries if e.record.peer_id not in self.bans]

    def _on_proof(self, claim: Claim) -> None:
        epoch = claim.epoch if self._epoch is None else min(claim.epoch, self._epoch)  # no ban from the future
        if self._epoch is None or epoch + BAN_ROUNDS > self._epoch:
            self._ban(Ban(claim.accused, BanReason.wrong_average, epoch, (claim.accuser,), time.time()))

    def _ban(self, ban: Ban) -> None:
        with self._lock:  # the averager is told the bans in the order they were made
            if not self.bans.add(ban):
                return
            self._refuse(list(self.bans.bans))
        self._announce(ban)
