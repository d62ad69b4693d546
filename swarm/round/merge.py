"""The second stage of a round: the groups' averages made into the swarm's one average (``swarm.dht.groups``).

After its group's all-reduce a peer does not step yet. Its group's delegate registers the group; once no peer of the
epoch is still averaging in a group, the delegates average their groups' averages (weighted by the groups' samples,
robustly, audited: the same all-reduce as the first stage, under the epoch's second-stage key) and each registers the
digest of the result. Every member then takes that swarm's average: its delegate's (or any holder's) file, checked
against the digest the delegates registered, decoded into the averaging buffers, and kept as the epoch's update for
replay. A round that formed one group registers its own average as the swarm's at once. A peer that found no group,
while others did, joins the second stage as a group of one. Bounded by ``averaging.merge_limit()``: a group that hears
of no swarm's average by then, or sees all its holders leave, steps with its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import replace

from swarm.averager.bounds import max_update_bytes
from swarm.averager.codecs import codec
from swarm.averager.fixed_group import fixed_group_id, partial_merge
from swarm.averager.handle import AllReduceOutcome
from swarm.averager.held import check_parts, decode_into, held_digest, likeness
from swarm.averager.transfer import read_update
from swarm.dht import groups
from swarm.dht.groups import Decision, Merged, Plan, Stage2, delegate_decision, group_record, group_tag
from swarm.dht.records import GroupRecord, PeerState
from swarm.dht.view import SwarmView
from swarm.events import MergeSource, short_reason
from swarm.round.merge_state import MergeState
from swarm.round.no_shows import NoShows, given_up_on
from swarm.round.vouched import groupmates_elsewhere, impostors_dropped, lone_lie, others_result, ours_result, unlike
from swarm.state.checkpoints import Checkpoints
from swarm.state.context import PeerContext

logger = logging.getLogger(__name__)

READ_EVERY = 0.5  # seconds between two reads of the groups key while a merge waits
FETCH_EVERY = 1.0  # seconds between two tries to fetch the swarm's average from its holders
STAND_IN_EVERY = 2.0  # seconds between two looks at whether our group's delegate is gone (a view read)
LEFT_LOOK_MAX = 8  # peers that could serve the swarm's average, at most, for a look at whether they all left
STAGE2_TRIES = 2  # a second stage that found no group is tried once more, while no swarm's average is registered


class Merger:
    """Drives the second stage of the round's flights (``OuterRound``), one ``MergeState`` each."""

    def __init__(
        self, ctx: PeerContext, checkpoints: Checkpoints, no_shows: NoShows, mates: Callable[[], Collection] = tuple
    ):
        self.ctx, self.checkpoints, self.no_shows = ctx, checkpoints, no_shows
        self.mates = mates  # our groupmates of the last rounds: whose swarm's average we take (``vouched``)

    def after_group(self, epoch: int, outcome: AllReduceOutcome, samples: dict[str, int]) -> MergeState:
        """Our group's all-reduce is done: register it (if we are its delegate) and start waiting."""
        members = outcome.group
        state = MergeState(
            epoch=epoch, tag=group_tag(outcome.group_id), delegate=groups.delegate_of(members, outcome.group_id),
            members=members, size=len(members), weight=float(sum(samples.values())), digest=outcome.digest,
            deadline=time.monotonic() + self._limit,
            distrusted=frozenset(f["peer"] for f in outcome.findings if f.get("banned")),
        )  # fmt: skip
        self._start(state)
        return state

    def alone(self, epoch: int, samples: int) -> MergeState:
        """No group: join the second stage as a group of one (with our own pseudo-gradient in the buffers)."""
        me = self.ctx.me
        state = MergeState(
            epoch=epoch, tag=group_tag(f"{me}/{epoch}".encode()), delegate=me, members=(me,), size=1,
            weight=float(max(1, samples)), digest=None, deadline=time.monotonic() + self._limit,
        )  # fmt: skip
        self._start(state)
        return state

    @property
    def _limit(self) -> float:
        return self.ctx.manifest.averaging.merge_limit(self.ctx.outer.numel)

    def others_at(self, epoch: int) -> bool:
        """Other groups registered this epoch (for a peer without a group: a second stage to join)."""
        return bool(groups.groups_at(self._read_wide(), epoch))

    def _start(self, state: MergeState) -> None:
        self.ctx.set_state(PeerState.merging, True)
        if state.delegate == self.ctx.me:
            self._register(state)

    # ---- while it waits ------------------------------------------------------------------------------------------

    def poll(self, state: MergeState, blocking: bool) -> bool:
        """Advance the merge; True once the buffers hold what the round steps with."""
        if state.done:
            return True
        ctx, now = self.ctx, time.monotonic()
        if state.stage2 is not None:
            if not self._poll_stage2(state):
                return False
        if state.unregistered is not None and now - state.register_tried_at >= READ_EVERY:
            self._register(state, **state.unregistered)  # a slow DHT (a neighbour vanishing): again
        if now - state.read_at >= READ_EVERY:
            state.read_at, state.records = now, self._read(state, now)
        result = ours_result(state.records, state.epoch, state.tag, state.digest)  # our delegate's: holds our work
        if state.delegate != ctx.me and (
            groups.delegate_disagrees(state.records, state.epoch, state.tag, state.delegate, state.digest)
            or lone_lie(state.records, state.epoch, state.tag, state.digest)
            or (result is not None and result.digest in state.refused)  # its bytes were unlike our group's
        ):
            state.fallback = "our delegate registered another average of our group: our own was applied"
            return self._finish(state, counted=False)
        if result is None and (state.delegate == ctx.me or now > state.deadline - self._patience):
            trusted = (frozenset(self.mates()) | state.partners) - {ctx.me, *state.members}  # (``vouched``: never
            result = others_result(state.records, state.epoch, trusted, state.refused)  # one of our group's)
        if result is not None:
            return self._take(state, result, blocking)
        if state.delegate != ctx.me and now - state.looked_at >= STAND_IN_EVERY:
            self._stand_in_if_gone(state, now, blocking)
        deciding = state.delegate == ctx.me and not state.decided and state.stage2 is None
        if deciding and state.stage2_tries < STAGE2_TRIES and self._roster_step(state, now):
            return False
        if deciding and state.stage2_tries < STAGE2_TRIES:
            view = ctx.reader.view(state.members) if blocking else ctx.reader.recent_view()
            view = self.no_shows.waiting_view(view)  # keys that missed earlier rounds are not waited for
            waited = now - state.registered_at if state.registered_at is not None else 0.0
            patience = ctx.manifest.averaging.merge_timeout / 2  # the rest is for fetching the swarm's average
            decision = Decision.wait if view is None else delegate_decision(
                view, state.records, state.epoch, state.members, state.tag, waited, patience,
                ctx.manifest.averaging.allreduce_limit(ctx.outer.numel),
            )  # fmt: skip
            if decision != Decision.wait and state.merge_at is None:  # (polled until our turn to write the roster)
                seen = [
                    (g.group, g.delegate[-6:], g.merged and g.merged[:8])
                    for g in groups.groups_at(state.records, state.epoch)
                ]
                logger.debug("merge of epoch %d, group %s: %s after %.1f s; groups %s", state.epoch, state.tag,
                             decision.value, waited, seen)  # fmt: skip
            if decision != Decision.wait and waited >= patience:  # we gave up on those still working towards it
                self._note_no_shows(view, state)
            if decision == Decision.alone:  # the round's only group
                return self._alone(state, "no other group this round")
            if decision == Decision.merge:
                state.merge_at = now if state.merge_at is None else state.merge_at
                self._roster_step(state, now)
                return False
        if now > state.deadline:
            state.fallback = "no swarm's average in time: our group's own was applied"
            return self._finish(state, counted=False)
        return False

    def _alone(self, state: MergeState, why: str) -> bool:
        """Our group's average is the swarm's (registered as such, its members take it), or, a group of one with no
        group to merge with, we step with our own pseudo-gradient: True once the buffers hold what we step with."""
        if state.digest is None:
            state.fallback = why
            return self._finish(state, counted=False)
        self.ctx.averager.finalize_update(state.epoch)  # served before it is announced
        state.decided = True
        self._register(state, merged=state.digest, included=[state.tag], peers=state.size)
        state.read_at = -float("inf")
        return False

    def _note_no_shows(self, view: SwarmView, state: MergeState) -> None:
        """The keys the merge waited for all its patience that still work towards the round: not waited for a while
        (``swarm.round.no_shows``; noted here: a key that follows the swarm's epoch is past it when the round ends)."""
        missed = given_up_on(view, state.records, self.ctx.me, state.epoch, state.members, state.tag)
        self.no_shows.note(missed, state.epoch, "never came to the merge")

    def _stand_in_if_gone(self, state: MergeState, now: float, blocking: bool) -> None:
        """Our delegate died in the all-reduce, moved on without registering the group, or lied to us in it: one
        member speaks for the group (``groups.stands_in``), so that its average reaches the swarm's in time."""
        state.looked_at = now
        view = self.ctx.reader.view([state.delegate]) if blocking else self.ctx.reader.recent_view()
        distrusted = state.distrusted | {m for m in state.members if self.ctx.reader.banned(m)}
        args = (state.epoch, state.members, state.delegate, state.tag, self.ctx.me, distrusted)
        if view is None or not groups.stands_in(view, state.records, *args):
            return
        state.read_at, state.records = now, self._read(state, now)  # as they are now: it may have just registered
        if not groups.stands_in(view, state.records, *args):
            return
        why = "distrusted" if state.delegate in distrusted else "gone"
        logger.debug("epoch %d: group %s's delegate is %s; we speak for the group", state.epoch, state.tag, why)
        state.delegate = self.ctx.me
        self._register(state)
        state.read_at = -float("inf")

    @property
    def _patience(self) -> float:  # the merge's last part, when a member takes another group's swarm's average
        return self.ctx.manifest.averaging.merge_timeout / 4

    def _poll_stage2(self, state: MergeState) -> bool:
        """The delegates' all-reduce: True once it is over (then its average is registered, or it failed)."""
        try:
            if not state.stage2.poll():
                return False
            outcome = state.stage2.result()
        except Exception as e:  # no second-stage group (the others' may still come), a vanished delegate
            logger.debug("the second stage failed", exc_info=True)
            self.ctx.averager.ensure_idle()
            state.stage2, state.fallback = None, f"second stage: {short_reason(e)}"
            return True
        state.stage2 = None
        state.bytes_sent += outcome.bytes_sent
        state.bytes_received += outcome.bytes_received
        # whatever became of the try, those it caught are banned at the round's end, and none of their records is
        # taken now: a caught liar's own registration was the one swarm's average its honest partners, who did not
        # register theirs (its slice dropped), would have taken
        state.findings += outcome.findings
        state.caught |= {f["peer"] for f in outcome.findings if f.get("banned")}
        if partial_merge(outcome.dropped_fraction, outcome.excluded_senders):  # (not written into our buffers)
            # a delegate of the group we started did not take part (it saw other groups, or none): its slice is
            # zeros and its group's work is missing, yet the group names it. Not a swarm's average: try again with
            # the groups registered now, or take the one the others made
            logger.debug("the second stage of epoch %d ran without some delegates: not registered", state.epoch)
            state.absent |= (frozenset(outcome.absent) | state.caught) - {self.ctx.me}  # the next try runs without them
            state.fallback = "second stage: some delegates did not take part"
            return True
        state.partners = frozenset(outcome.group) - {self.ctx.me}
        included = sorted({d.get("group") for d in outcome.gathered.values() if isinstance(d, dict)} - {None})
        if not self.ctx.averager.finalize_update(state.epoch):  # the swarm's average, served for replay
            logger.debug("the merged update of epoch %d was not kept", state.epoch)
        sizes = {r.group: r.size for r in groups.groups_at(state.records, state.epoch)}
        peers = groups.peers_in(frozenset(included), sizes, 0)
        self._register(state, merged=outcome.digest, included=included, peers=peers)
        state.read_at = -float("inf")
        return True

    def _roster_step(self, state: MergeState, now: float) -> bool:
        """Follow a roster that holds our group (whether or not we decided to merge yet), or, once we decided, write
        it when it is our turn (``groups.stage2_plan``). True once the second stage started."""
        waited = now - state.merge_at if state.merge_at is not None else -1.0
        plan = groups.stage2_plan(state.records, state.epoch, state.tag, self.ctx.me, waited)
        if plan.action == Stage2.wait:
            return False
        if plan.action == Stage2.write:
            state.absent |= groupmates_elsewhere(plan.roster, state.tag, state.members)  # never named (``vouched``)
            plan = replace(plan, roster=tuple(g for g in plan.roster if g.delegate not in state.absent))
            state.roster = tuple(g.group for g in plan.roster)
            self._register(state)
            logger.debug("epoch %d: we wrote the second stage's roster of %d groups", state.epoch, len(state.roster))
        self._start_stage2(state, plan)
        return True

    def _start_stage2(self, state: MergeState, plan: Plan) -> None:
        """The delegates' all-reduce, among the delegates of the roster's groups (every one of them that follows the
        same roster runs the same group: ``swarm.averager.fixed_group``)."""
        ctx, avg = self.ctx, self.ctx.manifest.averaging
        members = [(g.delegate, g.client_mode, dict(epoch=state.epoch, samples=int(g.weight), group=g.group))
                   for g in plan.roster if g.delegate not in state.absent]  # fmt: skip
        label = f"{ctx.manifest.run_id}/{state.epoch}/merge/{plan.writer}/{state.stage2_tries}"
        state.stage2_tries += 1
        others = {g.delegate for g in groups.groups_at(state.records, state.epoch)} - state.absent - {ctx.me}
        if len(members) < 2 and not others:  # the other delegates registered were all absent from our last try: a
            self._alone(state, "second stage: the other delegates did not take part")  # stranger's made-up group
            return  # held every round of a one-group swarm until ``merge_limit``, then it stepped with its own
        if len(members) < 2:  # groups we did not merge with are registered: their average may still be ours to take
            state.fallback = "second stage: the other delegates did not take part"
            return
        state.stage2 = ctx.averager.start_fixed_averaging(
            group_id=fixed_group_id(label, members),
            members=members,
            weight=state.weight,
            hard_timeout=avg.allreduce_limit(ctx.outer.numel) + avg.ending_seconds(ctx.outer.numel),
            leaving=ctx.stop_requested,
        )

    # ---- the swarm's average -------------------------------------------------------------------------------------

    def _take(self, state: MergeState, result: Merged, blocking: bool = True) -> bool:
        """Go on from the swarm's average: ours as it is, or fetched (at most one try a second) from our parent in
        the group's tree, or later a holder (``groups.fetch_sources``), and checked. A delegate that takes another
        group's registers it as its group's, so its members take it too."""
        counted = state.tag in result.included
        held = result.digest == state.digest or state.delegate == self.ctx.me and self._holds(state, result)
        now = time.monotonic()
        state.seen_at = now if state.seen_at is None else state.seen_at
        if not held and now - state.fetched_at < FETCH_EVERY:
            return False
        if not held:
            state.fetched_at = now
            sources = groups.fetch_sources(
                state.members, state.tag, state.delegate, self.ctx.me, result.holders, now - state.seen_at
            )
            fetched = (s for s in sources if result.digest not in state.refused)  # (refused: fetched no more)
            got = next((source for source in fetched if self._fetch(state, source, result.digest)), None)
            held = got is not None
            if held:
                state.source = MergeSource.holder if got in result.holders else MergeSource.groupmate
            if held and state.delegate == self.ctx.me:
                self._register(state, merged=result.digest, included=sorted(result.included), peers=result.peers)
        if held:
            logger.debug("epoch %d, group %s: the swarm's average %s of %d groups (ours: %s)", state.epoch, state.tag,
                         result.digest[:8], len(result.included), counted)  # fmt: skip
            state.result, state.groups, state.fallback = result, max(1, len(result.included)), None
            state.contributors = max(1, result.peers)
            return self._finish(state, counted=counted)
        if now > state.deadline or self._holders_left(state, result, now, blocking):
            state.fallback = f"the swarm's average {'could not be fetched' if now > state.deadline else 'left with it'}"
            state.fallback += ": our group's own was applied"
            return self._finish(state, counted=False)
        return False

    def _holders_left(self, state: MergeState, result: Merged, now: float, blocking: bool) -> bool:
        """Whether every peer we could fetch the swarm's average from left, seen in two looks ``STAND_IN_EVERY`` apart
        once we ask them all (our ancestors may still be fetching it): the rest of ``merge_limit`` (576 s for
        ``150m``) would wait for nobody. A look reads each one's bucket: not past ``LEFT_LOOK_MAX`` of them."""
        args = (state.members, state.tag, state.delegate, self.ctx.me, result.holders)
        sources, asked = groups.fetch_candidates(*args), groups.fetch_sources(*args, now - state.seen_at)
        if now - state.looked_at < STAND_IN_EVERY or len(sources) > LEFT_LOOK_MAX or set(asked) != set(sources):
            return False
        state.looked_at = now
        view = self.ctx.reader.view(sources) if blocking else self.ctx.reader.recent_view()
        state.left_looks = state.left_looks + 1 if view is not None and groups.all_left(view, sources) else 0
        return state.left_looks >= 2

    def _holds(self, state: MergeState, result: Merged) -> bool:
        """As a second-stage delegate: our buffers hold that very average (we registered it)."""
        ours = (r for r in groups.groups_at(state.records, state.epoch) if r.delegate == self.ctx.me)
        return any(r.merged == result.digest for r in ours)

    def _fetch(self, state: MergeState, holder: str, digest: str) -> bool:
        ctx, avg = self.ctx, self.ctx.manifest.averaging
        destination = self.checkpoints.store.temporary_path(f"merged-{state.epoch}-{holder[-8:]}")
        try:
            ctx.averager.download_update(
                holder,
                state.epoch,
                destination,
                max_bytes=max_update_bytes(codec(avg.compression).compression_type, ctx.outer.numels),
                chunk_timeout=avg.chunk_timeout,
                timeout=avg.update_timeout(ctx.outer.numel),
                should_stop=ctx.stop_requested,
            )
            held = read_update(destination, ctx.manifest.run_id, state.epoch, len(ctx.outer.params))
            if held_digest(held) != digest:
                raise ValueError("it is not the average the delegates registered")
            with ctx.averager.get_tensors() as buffers:  # our group's average, until the swarm's is written
                for tensor, parts in zip(buffers, held):
                    check_parts(tensor, parts, codec(ctx.manifest.averaging.compression).compression_type)
                why = unlike(likeness(tensor, parts) for tensor, parts in zip(buffers, held))
                if why is not None:
                    state.refused |= {digest}
                    logger.info("epoch %d: the swarm's average %s %s: not taken", state.epoch, digest[:8], why.value)
                    return False
                for tensor, parts in zip(buffers, held):
                    decode_into(tensor, parts)
            ctx.averager.adopt_update(state.epoch, destination)
            return True
        except Exception:
            logger.debug("the merged average of epoch %d from %s is unusable", state.epoch, holder, exc_info=True)
            return False
        finally:
            destination.unlink(missing_ok=True)

    def _finish(self, state: MergeState, counted: bool) -> bool:
        state.counted, state.done = counted, True
        if state.delegate != self.ctx.me and state.result is not None and state.result.digest == state.digest:
            self.ctx.averager.finalize_update(state.epoch)  # our group's average is the swarm's
        elif state.fallback is not None and state.digest is not None:
            self.ctx.averager.finalize_update(state.epoch)  # stepping with our group's own
        return True

    # ---- the DHT ---------------------------------------------------------------------------------------------

    def _read(self, state: MergeState, now: float) -> list[GroupRecord]:
        """The groups key as a delegate, or when a member may take another's average; else our group's bucket."""
        waited = None if state.seen_at is None else now - state.seen_at
        args = (state.members, state.tag, state.delegate, self.ctx.me, state.deadline - now, self._patience, waited)
        wide = groups.reads_wide(*args)
        records = (
            self._read_wide()
            if wide
            else self._kept(groups.read_bucket(self.ctx.reader.dht, self.ctx.manifest.run_id, state.tag))
        )
        return [
            r
            for r in impostors_dropped(records, state.epoch, state.tag, state.members)
            if r.delegate not in state.caught
        ]

    def _read_wide(self) -> list[GroupRecord]:
        return self._kept(groups.read_groups(self.ctx.reader.dht, self.ctx.manifest.run_id))

    def _kept(self, records: list[GroupRecord]) -> list[GroupRecord]:
        self.ctx.reader.other_records += len(records)
        # a group whose delegate we banned is refused in the second stage's all-reduce anyway: waiting for it, or
        # naming it in a roster, cost every round a failed try (30 s a round, seen in the byzantine benchmark)
        return [r for r in records if not self.ctx.reader.banned(r.delegate)]

    def _register(self, state: MergeState, **merge) -> None:
        client_mode = bool(self.ctx.averager.client_mode)
        record = group_record(state.epoch, state.tag, self.ctx.me, state.size, state.weight, state.digest, client_mode,
                              state.roster, **merge)  # fmt: skip
        state.register_tried_at = time.monotonic()
        if groups.register(self.ctx.reader.dht, self.ctx.manifest.run_id, record):
            state.registered_at, state.unregistered = state.registered_at or time.monotonic(), None
        else:
            logger.debug("the DHT did not take our group's record of epoch %d; again shortly", state.epoch)
            state.unregistered = merge
