"""Accusations of a wrong average, checked on their proof: a peer that reads one fetches the proof from the accuser
(``swarm.defence.average_proof``, served by its averager) and bans the accused only if it holds.

Which accusations are worth a fetch is a pure rule (``claims``): one of a wrong average, whose receipt is signed by
the accused, names the accuser among its senders (an auditor or a groupmate that re-checked it: it holds the parts),
and accuses a live peer this peer has not banned. Each (accuser, receipt) is fetched once, whatever it showed (one
that served nothing, over its limits or gone for a moment, is asked again up to ``TRIES`` times, later each time);
the fetches run one at a time in a thread of their own, at most ``CHECKS_PER_MINUTE``, in random order, with at most
``PER_ACCUSER`` claims of one accuser and ``PER_ACCUSED`` against one accused waiting at once, so that a stranger
whose keys publish accusations costs a reader little and can only slow the others': it can make it fetch, never ban.
An accuser whose stream fails or stalls is not asked again.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

from swarm.defence.audit import Verdict
from swarm.defence.receipts import Receipt, open_receipt
from swarm.dht.records import ProgressRecord

logger = logging.getLogger(__name__)

CHECKS_PER_MINUTE = 6
REMEMBERED = 4096  # (accuser, receipt) pairs already fetched
PENDING = 64  # claims waiting for a fetch; more are offered again at the next read of the records
PER_ACCUSER = 2  # of those, one accuser's
PER_ACCUSED = 4  # and those against one accused
TRIES = 5  # fetches of a claim whose accuser served nothing (over its limits: many readers ask at once)
RETRY_AFTER = 20.0  # seconds before the second of them (at random, up to half as long again), doubling each time
IDLE_EXIT = 60.0  # seconds the thread waits with nothing to do before it ends (a new claim starts another)

OPENED = 4096  # receipts whose signature was checked, by hash (records are read again every second)
_opened: OrderedDict[bytes, Receipt | None] = OrderedDict()
_opened_lock = threading.Lock()


def _open_receipt(blob: bytes, key: bytes) -> Receipt | None:
    with _opened_lock:
        if key in _opened:
            return _opened[key]
    receipt = open_receipt(blob)
    with _opened_lock:
        _opened[key] = receipt
        while len(_opened) > OPENED:
            _opened.popitem(last=False)
    return receipt


@dataclass(frozen=True)
class Claim:
    accuser: str
    accused: str
    receipt: bytes  # the accused's signed receipt, as the accusation carries it
    epoch: int

    @property
    def key(self) -> tuple[str, bytes]:
        return self.accuser, hashlib.sha256(self.receipt).digest()


def claims(
    records: Iterable[ProgressRecord], me: str, banned: Container[str], seen: Container[tuple[str, bytes]] = ()
) -> list[Claim]:
    """The accusations of a wrong average among ``records`` whose proof is worth fetching (see the module), but those
    ``seen`` already (their receipt's signature is not checked again)."""
    records = list(records)
    live = {record.peer_id for record in records}
    found = []
    for record in records:
        for entry in record.accusations:
            if entry.verdict != Verdict.wrong_average.value or not entry.receipt:
                continue
            if entry.accused in (me, record.peer_id) or entry.accused in banned or entry.accused not in live:
                continue
            claim = Claim(record.peer_id, entry.accused, entry.receipt, entry.epoch)
            if claim.key in seen:
                continue
            receipt = _open_receipt(entry.receipt, claim.key[1])
            if receipt is None or receipt.reducer != entry.accused or record.peer_id not in receipt.senders:
                continue
            found.append(claim)
    return found


@dataclass
class _Pending:
    claim: Claim
    tries: int = 0
    not_before: float = 0.0


class ProofChecks:
    """Fetches and checks the proofs of ``claims``, one at a time: ``check(accuser, receipt)`` says whether the
    accuser served one that holds (None: it served none); ``proven(claim)`` is called for each that does."""

    def __init__(self, check: Callable[[str, bytes], bool | None], proven: Callable[[Claim], None]):
        self._check, self._proven = check, proven
        self.seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._pending: list[_Pending] = []
        self._started: deque[float] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def offer(self, found: Iterable[Claim]) -> None:
        added = False
        with self._lock:
            for claim in found:
                mine = sum(p.claim.accuser == claim.accuser for p in self._pending)
                theirs = sum(p.claim.accused == claim.accused for p in self._pending)
                full = len(self._pending) >= PENDING or mine >= PER_ACCUSER or theirs >= PER_ACCUSED
                if claim.key in self.seen or full:
                    continue
                self._remember(claim)
                self._pending.append(_Pending(claim))
                added = True
            if self._pending and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="proof-checks", daemon=True)
                self._thread.start()
        if added:
            self._wake.set()

    def _remember(self, claim: Claim) -> None:
        self.seen[claim.key] = None
        while len(self.seen) > REMEMBERED:
            self.seen.popitem(last=False)

    def _next(self) -> _Pending | float | None:
        """A claim due, drawn at random (a stranger's many claims, offered first, do not come first), else seconds
        until one is, else None (nothing pending)."""
        now = time.monotonic()
        due = [p for p in self._pending if p.not_before <= now]
        if due:
            item = random.choice(due)
            self._pending.remove(item)
            return item
        return min((p.not_before - now for p in self._pending), default=None)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._wake.clear()  # an offer after this sets it again
                item = self._next()
            if isinstance(item, _Pending):
                self._attempt(item)
            elif not self._wake.wait(IDLE_EXIT if item is None else item) and item is None:
                with self._lock:
                    if not self._pending:  # nothing came in a while: the thread ends (an offer starts another)
                        self._thread = None
                        return

    def _attempt(self, item: _Pending) -> None:
        claim = item.claim
        self._pace()
        try:
            proven = self._check(claim.accuser, claim.receipt)
        except Exception:
            logger.debug("checking %s's proof against %s failed", claim.accuser, claim.accused, exc_info=True)
            proven = None
        logger.debug("%s's proof that %s averaged wrong: %s", claim.accuser, claim.accused, proven)
        if proven is None and item.tries + 1 < TRIES:  # it served nothing: asked again, later
            with self._lock:
                wait = RETRY_AFTER * 2**item.tries * random.uniform(1.0, 1.5)
                self._pending.append(_Pending(claim, item.tries + 1, time.monotonic() + wait))
        elif proven:
            try:
                self._proven(claim)
            except Exception:  # the ban could not be applied: logged, and the thread goes on
                logger.warning("could not apply a proven ban of %s", claim.accused)
                logger.debug("applying a proven ban", exc_info=True)

    def _pace(self) -> None:
        """Wait until a check may start: at most ``CHECKS_PER_MINUTE`` in any minute."""
        now = time.monotonic()
        while self._started and now - self._started[0] > 60:
            self._started.popleft()
        if len(self._started) >= CHECKS_PER_MINUTE:
            time.sleep(max(0.0, 60 - (now - self._started[0])))
        self._started.append(time.monotonic())
