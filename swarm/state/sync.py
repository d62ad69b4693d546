"""Getting the swarm's state: on joining, when behind, after a disagreement, and from our own checkpoint.

Every state that did not come out of our own outer step arrives as a file and is
checked before anything is loaded from it: the header's run and shapes, the sha256 of
the parameters and momentum against what peers published for the epoch the joiner
chose (``trust``), and the momentum's CRC32. Only then is it read into the outer state, and the file
becomes our newest checkpoint as it is. A peer a few rounds behind replays the
rounds it missed instead (``swarm.state.replay``).
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

from swarm.averager.transfer import DownloadStopped
from swarm.averager.trickle import TooSlow
from swarm.dht.records import PeerState
from swarm.dht.view import Consensus, Resync, SwarmView, resync_needed, running_consensus
from swarm.errors import LeaveRequested, StateDownloadError
from swarm.events import (
    AwaitingMajority,
    CheckpointUnusable,
    ClaimDoubted,
    DonorDistrusted,
    DownloadDeferred,
    DownloadFailed,
    DownloadStarted,
    Initialized,
    Resyncing,
    StateLoaded,
    short_reason,
)
from swarm.state import file as state_file
from swarm.state import trust
from swarm.state.checkpoints import Checkpoints
from swarm.state.context import PeerContext
from swarm.state.doubts import Doubts, unserved_claimants
from swarm.state.file import StateFileError
from swarm.state.replay import Replay
from swarm.state.store import residual_path

logger = logging.getLogger(__name__)

DOWNLOAD_ATTEMPTS = 3
MAX_DISTRUSTED = 1024  # donors remembered for serving a bad state (a stranger can make keys: a bound)
MIN_DEFERRED_DOWNLOAD = 2.0  # seconds: a download this quick never waits for the swarm's round to end
VIEW_WAIT = 3.0  # records of other peers can take this long to reach a node that just joined
UNSERVED_PASSES = 2  # download passes that found nobody serving an epoch ahead of ours before its claimants are doubted
MAJORITY_WAIT = 120  # seconds a joiner waits for a state half of the keys hold, while a round's groups ended apart


class Resynced(enum.Enum):
    """What a re-sync did (``StateSync.resync``)."""

    taken = "the swarm's state is ours now"
    failed = "no donor served a verified state"
    doubted = "nobody served the state we were told of: the keys that vouched for it are doubted, ours stands"


class StateSync:
    """``begin_round`` restarts the count of the round's inner steps: the model restarts from the global one.
    ``doubts``: the keys whose claims nobody served (``swarm.state.doubts``), which the view of ``ctx.reader``
    leaves out (the peer builds both); a sync of its own when not given."""

    def __init__(
        self,
        ctx: PeerContext,
        checkpoints: Checkpoints,
        begin_round: Callable[[], None],
        doubts: Doubts | None = None,
    ):
        self.ctx, self.checkpoints, self._begin_round = ctx, checkpoints, begin_round
        self.doubts = doubts if doubts is not None else Doubts(lambda: ctx.outer.epoch)
        self.doubted_claim = False  # the last download doubted the keys that vouched for the state it wanted
        # the keys we averaged with lately: the states a running peer may take without a majority (``trust``)
        self.groupmates = trust.Groupmates()
        self.replay = Replay(ctx, checkpoints, self.vouched)
        self._download_rate: float | None = None  # bytes/s of our last state download
        # donors that served a state file that was not what they voted for, or whose bytes did not match their own
        # header: never asked again by this process (the file is unsigned, so it proves nothing to other peers)
        self.distrusted: dict[str, str] = {}

    # ---- our own checkpoint ---------------------------------------------------------------------

    def load_file(self, path: Path) -> bool:
        """Load one of our state files (a checkpoint found at start); False, with an event, if it is unusable."""
        ctx = self.ctx
        try:
            header = state_file.check(path, run_id=ctx.manifest.run_id, shapes=ctx.outer.shapes)
        except StateFileError as e:
            ctx.emit(CheckpointUnusable(path, str(e)))
            return False
        with ctx.shield():
            ctx.outer.load_file(path, header)
            if ctx.outer.residual is not None:  # what we had not sent yet, if it was saved with this state
                state_file.load_residual(
                    residual_path(path),
                    run_id=ctx.manifest.run_id,
                    checksum=header.checksum,
                    residual=ctx.outer.residual,
                )
            ctx.outer.write_to(ctx.params)
            ctx.averager.note_epoch(header.epoch)
            self.checkpoints.store.use_existing(path, header)
        return True

    # ---- joining --------------------------------------------------------------------------------

    def catch_up(self, resumed: bool, expect_others: bool) -> None:
        """Download the state from the swarm if anyone is training; otherwise start from the seed or checkpoint.
        ``expect_others``: we joined through initial peers, whose records may take a moment to arrive."""
        ctx = self.ctx
        view = self._wait_for_view() if expect_others else ctx.reader.view()
        others = [p for p in view.peers if p.peer_id != ctx.me and p.latest_checksum is not None]
        if not others:
            reason = "resumed from checkpoint" if resumed else "first peer of the run: weights from the manifest seed"
            return self._start_from_own(reason, resumed)
        agreed = trust.wanted(view)
        held = "checkpoint agrees with the swarm" if resumed else "the swarm holds the seed"
        if self._holds(agreed):  # resumed, or a run still at its seed's weights: nothing to download
            return self._start_from_own(held, resumed)
        ctx.set_state(PeerState.downloading_state, True)
        before = ctx.outer.checksum()
        if not self.download_consensus_state(joining=True):
            if ctx.stop_requested():
                raise LeaveRequested("asked to leave while downloading the state")
            raise StateDownloadError(
                f"{len(others)} peers of run {ctx.manifest.run_id} are training, but none of them served a verified "
                "copy of the training state. Check that this machine can reach them (firewall, --client-mode), "
                "then start again."
            )
        if ctx.outer.checksum() == before:  # ours was the swarm's, once the view left out keys that lied
            self._start_from_own(held, resumed)

    def _start_from_own(self, reason: str, resumed: bool) -> None:
        """Start from the state we have (a checkpoint, or the seed's weights, written as our first file)."""
        self.ctx.emit(Initialized(self.ctx.outer.epoch, reason))
        if not resumed:
            self.checkpoints.save()

    def _wait_for_view(self) -> SwarmView:
        ctx = self.ctx
        view = ctx.reader.view()
        deadline = time.monotonic() + VIEW_WAIT
        while time.monotonic() < deadline and not any(p.peer_id != ctx.me for p in view.peers):
            time.sleep(0.5)
            view = ctx.reader.view()
        return view

    # ---- staying consistent --------------------------------------------------------------------

    def resync_needed(self, epoch: int, last_round_local: bool, view: SwarmView | None = None) -> Resync | None:
        """Why we must take the swarm's state at ``epoch``, or None (``swarm.dht.view.resync_needed``; in ``view``,
        or one read now)."""
        outer = self.ctx.outer
        mine = outer.checksum() if outer.epoch == epoch else None
        view = view if view is not None else self.ctx.reader.view()
        return resync_needed(view, self.ctx.me, epoch, mine, last_round_local, self.groupmates.keys())

    def vouched(self) -> frozenset[str]:
        """The keys whose states we may take without a majority's vote (``running_consensus``): ourselves and our
        recent groupmates. A joiner's are none of them: it takes a majority's (``trust.wanted``)."""
        return frozenset({self.ctx.me, *self.groupmates.keys()})

    def resync(self, why: str, keep_model_if_doubted: bool = False) -> Resynced:
        """Replace our state with the swarm's; the model restarts from the global copy, unless nobody served the
        epoch we were told of, its claimants are doubted, our state is the swarm's again in the view without them,
        and ``keep_model_if_doubted`` (the caller's round goes on, with its steps)."""
        ctx = self.ctx
        ctx.set_state(PeerState.resyncing, True)
        ctx.emit(Resyncing(why, ctx.outer.epoch))
        ok = self.download_consensus_state()
        doubted = not ok and self.doubted_claim and self.resync_needed(ctx.outer.epoch, False) is None
        if doubted and keep_model_if_doubted:
            return Resynced.doubted  # the caller offers our state again and goes on
        ctx.outer.write_to(ctx.params)
        self._begin_round()
        self.checkpoints.announce(inner_step=0)
        ctx.set_state(PeerState.training, True)
        return Resynced.taken if ok else Resynced.doubted if doubted else Resynced.failed

    # ---- downloading ---------------------------------------------------------------------------

    def download_consensus_state(self, joining: bool = False) -> bool:
        """Fetch the state held by most peers at the global epoch from one of them, verified by its hash. When two
        passes find nobody serving it, and it is not ours, the keys that vouched for it are doubted
        (``swarm.state.doubts``; ``joining``: only while others say otherwise) and the next pass reads the view
        without them; a peer that is not joining and holds the swarm's state in that view keeps its own (False, with
        ``doubted_claim`` set)."""
        ctx = self.ctx
        avg = ctx.manifest.averaging
        # nobody should copy a state we are replacing; checkpoints.announce offers ours again afterwards
        ctx.averager.allow_state_sharing = False
        self.doubted_claim = False
        if self.replay.missed_rounds():
            return True
        unserved = 0  # passes that found nobody serving the state wanted
        for attempt in range(DOWNLOAD_ATTEMPTS):
            if ctx.stop_requested():
                return False
            view = self._view_after_round_if_download_is_too_slow()
            if view.global_epoch is None:
                return False
            if self.doubted_claim and not joining and self.resync_needed(ctx.outer.epoch, False, view) is None:
                return False  # without the keys that claimed another state, ours is the swarm's
            if joining:
                view = self._until_half_agree(view)
            # a joiner: the latest epoch half of the keys hold (``trust.wanted``); a running peer: half of the keys'
            # checksum, else the most common one that we or a recent groupmate hold (``running_consensus``)
            if joining:
                agreed = trust.wanted(view)
            else:
                agreed = running_consensus(view.peers, view.global_epoch, self.vouched())
            if self._holds(agreed):
                return True
            donors = self._donors(view, agreed)
            for donor in donors:
                if ctx.stop_requested():
                    return False
                if self._download_from(
                    donor, agreed, joining, avg.chunk_timeout, avg.transfer_timeout(ctx.outer.nbytes)
                ):
                    return True
            unserved += 1 if donors else UNSERVED_PASSES  # nobody to ask: no use asking again
            unsettled = joining and not trust.servable(view, agreed, ctx.me)  # nobody claimed what we could not get
            if unserved >= UNSERVED_PASSES and not unsettled and self._doubt(view, joining):
                continue  # the next pass reads the view without them
            time.sleep(min(5.0, 1.0 * (attempt + 1)))
        return False

    def _until_half_agree(self, view: SwarmView) -> SwarmView:
        """A joiner's wait, at most ``MAJORITY_WAIT`` seconds, while no state it could fetch is held by half of the
        keys (``trust.servable``): a round ended with its groups apart, and the running peers' re-syncs to the
        plurality mend that within a round. A joiner never takes a plurality: a fifth of the keys can buy one."""
        ctx = self.ctx
        if view.global_epoch is None or trust.servable(view, trust.wanted(view), ctx.me):
            return view
        ctx.emit(AwaitingMajority(view.global_epoch, MAJORITY_WAIT))
        for _ in range(MAJORITY_WAIT):
            if ctx.stop_requested():
                break
            time.sleep(1.0)
            view = ctx.reader.view()
            if view.global_epoch is None or trust.servable(view, trust.wanted(view), ctx.me):
                break
        return view

    def _donors(self, view: SwarmView, agreed: Consensus | None) -> list[str]:
        """The holders of the consensus that can serve it and did not serve us a bad state, in a random order (to
        spread joiners over donors), those still at its epoch first (the others serve a later one)."""
        if agreed is None:
            return []
        me, holders = self.ctx.me, set(agreed.holders)
        epochs = {
            p.peer_id: p.epoch
            for p in view.peers
            if p.peer_id in holders and p.peer_id != me and not p.client_mode and p.peer_id not in self.distrusted
        }
        donors = list(epochs)
        random.shuffle(donors)
        return sorted(donors, key=lambda donor: epochs[donor] != agreed.epoch)

    def _holds(self, agreed: Consensus | None) -> bool:
        """The swarm's state is ours already, and another peer holds it too (a joiner's seed while the run is at
        its first epoch, a resumed checkpoint, or a view without the keys that vouched for another state)."""
        outer, me = self.ctx.outer, self.ctx.me
        return (
            agreed is not None
            and agreed.epoch == outer.epoch
            and agreed.agrees(outer.checksum())
            and any(holder != me for holder in agreed.holders)
        )

    def _doubt(self, view: SwarmView, joining: bool) -> bool:
        """Doubt the keys that claimed the view's global epoch, which nobody served (``swarm.state.doubts``)."""
        ctx = self.ctx
        vouched = None if joining else self.vouched()
        claim = unserved_claimants(view, ctx.me, ctx.outer.epoch, ctx.outer.checksum(), joining, vouched)
        if not claim:
            return False
        rounds = self.doubts.add(claim, view.global_epoch)
        self.doubted_claim = True
        ctx.emit(ClaimDoubted(len(claim), view.global_epoch, rounds))
        return True

    def _view_after_round_if_download_is_too_slow(self) -> SwarmView:
        """On a slow link a download can outlast what is left of the swarm's round; the state would be stale
        on arrival and we would download again, forever. Knowing how fast our last download went, wait for
        the swarm's next round to end and download then: a whole round's time for the transfer, and the
        early-join rule lets us average in that same round."""
        ctx = self.ctx
        view = ctx.reader.view()
        if self._download_rate is None or view.global_epoch is None or view.eta_next_round is None:
            return view
        expected = ctx.outer.nbytes / self._download_rate
        if expected < MIN_DEFERRED_DOWNLOAD or view.eta_next_round >= expected:
            return view
        ctx.emit(DownloadDeferred(view.eta_next_round, expected))
        deadline = time.monotonic() + view.eta_next_round + ctx.manifest.averaging.matchmaking_timeout
        epoch = view.global_epoch
        while time.monotonic() < deadline and not ctx.stop_requested():
            time.sleep(0.5)
            view = ctx.reader.view()
            if view.global_epoch is None or view.global_epoch > epoch:
                break
        return view

    def _download_from(
        self, donor: str, wanted: Consensus, joining: bool, chunk_timeout: float, timeout: float
    ) -> bool:
        self.ctx.emit(DownloadStarted(donor))
        destination = self.checkpoints.store.temporary_path(f"download-{donor[-8:]}")
        try:
            return self._fetch_and_load(donor, wanted, joining, destination, chunk_timeout, timeout)
        finally:
            destination.unlink(missing_ok=True)  # adopted files were renamed away; anything left is a failure

    def _fetch_and_load(
        self,
        donor: str,
        wanted: Consensus,
        joining: bool,
        destination: Path,
        chunk_timeout: float,
        timeout: float,
    ) -> bool:
        ctx = self.ctx
        started = time.monotonic()
        # a header is well under a kilobyte per tensor; anything much larger is not this run's state
        max_bytes = ctx.outer.nbytes + (1 << 20) + 1024 * len(ctx.outer.params)
        try:
            ctx.averager.download_state(
                donor,
                destination,
                max_bytes=max_bytes,
                chunk_timeout=chunk_timeout,
                min_rate=ctx.manifest.averaging.min_rate,
                timeout=timeout,
                should_stop=ctx.stop_requested,
            )
        except DownloadStopped:
            return False
        except TooSlow as e:  # a trickle: not asked again, so it holds us a minute, not a download's whole bound
            logger.debug("state download from %s was too slow", donor, exc_info=True)
            self._distrust(donor, str(e))
            return False
        except Exception as e:
            logger.debug("state download from %s failed", donor, exc_info=True)
            ctx.emit(DownloadFailed(donor, short_reason(e)))
            return False
        self._download_rate = destination.stat().st_size / max(time.monotonic() - started, 1e-3)
        try:
            header = state_file.read_header(destination, run_id=ctx.manifest.run_id, shapes=ctx.outer.shapes)
            state_file.verify(destination, header)
        except StateFileError as e:  # bytes that do not match their own header: damaged or made up by the donor
            self._distrust(donor, str(e))
            return False
        view = ctx.reader.view()
        refused = trust.refusal(view, header.epoch, header.checksum, wanted, ctx.me, joining, self.vouched())
        if refused is not None:  # the swarm's view decides, not the donor's header
            if trust.served_a_lie(donor, header.epoch, header.checksum, wanted):
                self._distrust(donor, refused)
            else:
                ctx.emit(DownloadFailed(donor, refused))
            return False
        with ctx.shield():  # a stop signal waits for the outer state to be whole again
            ctx.outer.load_file(destination, header)
            ctx.outer.write_to(ctx.params)
            ctx.averager.note_epoch(header.epoch)
            self.checkpoints.store.adopt(destination, header, self.checkpoints.extra())
        ctx.emit(StateLoaded(donor, header.epoch, header.checksum))
        return True

    def _distrust(self, donor: str, reason: str) -> None:
        if len(self.distrusted) >= MAX_DISTRUSTED:
            self.distrusted.pop(next(iter(self.distrusted)))
        self.distrusted[donor] = reason
        self.ctx.emit(DonorDistrusted(donor, reason))
