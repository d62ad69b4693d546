"""Accusations of a wrong average, checked on their proof: a peer that reads one fetches the proof from the accuser
(``swarm.defence.average_proof``, served by its averager) and bans the accused only if it holds.

Which accusations are worth a fetch is a pure rule (``claims``): one of a wrong average, whose receipt is signed by
the accused, names the accuser among its senders (an auditor or a groupmate that re-checked it: it holds the parts),
and accuses a live peer this peer has not banned. Each (accuser, receipt) is fetched once, whatever it showed; the
fetches run one at a time in a thread of their own, at most ``CHECKS_PER_MINUTE``, so that a stranger whose keys
publish accusations costs a reader little: it can make it fetch, never ban.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

from swarm.defence.audit import Verdict
from swarm.defence.receipts import open_receipt
from swarm.dht.records import ProgressRecord

logger = logging.getLogger(__name__)

CHECKS_PER_MINUTE = 6
REMEMBERED = 4096  # (accuser, receipt) pairs already fetched
PENDING = 32  # claims waiting for a fetch; more are offered again at the next read of the records


@dataclass(frozen=True)
class Claim:
    accuser: str
    accused: str
    receipt: bytes  # the accused's signed receipt, as the accusation carries it
    epoch: int

    @property
    def key(self) -> tuple[str, bytes]:
        return self.accuser, hashlib.sha256(self.receipt).digest()


def claims(records: Iterable[ProgressRecord], me: str, banned: Container[str]) -> list[Claim]:
    """The accusations of a wrong average among ``records`` whose proof is worth fetching (see the module)."""
    records = list(records)
    live = {record.peer_id for record in records}
    found = []
    for record in records:
        for entry in record.accusations:
            if entry.verdict != Verdict.wrong_average.value or not entry.receipt:
                continue
            if entry.accused in (me, record.peer_id) or entry.accused in banned or entry.accused not in live:
                continue
            receipt = open_receipt(entry.receipt)
            if receipt is None or receipt.reducer != entry.accused or record.peer_id not in receipt.senders:
                continue
            found.append(Claim(record.peer_id, entry.accused, entry.receipt, entry.epoch))
    return found


class ProofChecks:
    """Fetches and checks the proofs of ``claims``, one at a time: ``check(accuser, receipt)`` says whether the
    accuser served one that holds; ``proven(claim)`` is called for each that does."""

    def __init__(self, check: Callable[[str, bytes], bool], proven: Callable[[Claim], None]):
        self._check, self._proven = check, proven
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._pending: deque[Claim] = deque()
        self._started: deque[float] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def offer(self, found: Iterable[Claim]) -> None:
        with self._lock:
            for claim in found:
                if claim.key in self._seen or len(self._pending) >= PENDING:
                    continue
                self._seen[claim.key] = None
                while len(self._seen) > REMEMBERED:
                    self._seen.popitem(last=False)
                self._pending.append(claim)
            if self._pending and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="proof-checks", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                claim = self._pending.popleft() if self._pending else None
                if claim is None:
                    self._wake.clear()
                    continue
            self._pace()
            try:
                proven = self._check(claim.accuser, claim.receipt)
            except Exception:
                logger.debug("checking %s's proof against %s failed", claim.accuser, claim.accused, exc_info=True)
                proven = False
            logger.debug("%s's proof that %s averaged wrong: %s", claim.accuser, claim.accused, proven)
            if proven:
                self._proven(claim)

    def _pace(self) -> None:
        """Wait until a check may start: at most ``CHECKS_PER_MINUTE`` in any minute."""
        now = time.monotonic()
        while self._started and now - self._started[0] > 60:
            self._started.popleft()
        if len(self._started) >= CHECKS_PER_MINUTE:
            time.sleep(max(0.0, 60 - (now - self._started[0])))
        self._started.append(time.monotonic())
