"""The "why am I idle?" line: what this peer is waiting for, in plain words.

Volunteers cannot tell a stuck node from one that waits for slower peers; this
line names the wait and, where it can, how long it should last.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm import PeerState, SwarmView


@dataclass(frozen=True)
class OwnState:
    peer_id: str | None
    state: str
    epoch: int
    inner_step: int
    inner_steps: int  # H
    samples_per_step: int
    download_fraction: float = 0.0
    download_donor: str | None = None
    has_initial_peers: bool = False
    samples_per_second: float = 0.0
    # an overlapped round's stage (matchmaking, averaging) while this peer trains the next round's steps; its
    # record says that stage, for the others' matchmaking, and ``state`` says training (``shown_state``)
    round_in_background: str | None = None


_ROUND_STAGES = (PeerState.matchmaking, PeerState.averaging)


def shown_state(published: str, round_in_background: bool) -> tuple[str, str | None]:
    """What this peer is doing, for its own status file and dashboard, and its round's stage if that runs in the
    background (``Peer.round_in_background``): (state, round_in_background). An overlapped peer publishes
    matchmaking from a round's first moment until its average lands, while it trains the next round's steps."""
    if round_in_background and published in _ROUND_STAGES:
        return PeerState.training.value, published
    return published, None


NAMED = 3  # slower peers a dashboard's idle line names before "and N more"
NAME_CHARS = 20


def why_idle(me: OwnState, view: SwarmView | None, names: int = 0) -> str:
    """``names``: how many of the slower peers to name, the slowest first (the rest are "and N more"); 0 names
    none, and the line is as long whatever the number of peers."""
    others = [p for p in view.peers if p.peer_id != me.peer_id] if view is not None else []
    if me.state == PeerState.starting:
        return "starting: loading the model and joining the swarm"
    if me.state in (PeerState.downloading_state, PeerState.resyncing):
        source = f" from peer {me.download_donor[-8:]}" if me.download_donor else ""
        prefix = "re-syncing: " if me.state == PeerState.resyncing else ""
        return f"{prefix}downloading state {100 * me.download_fraction:.0f}%{source}"
    if me.state == PeerState.leaving:
        return "leaving: finishing the step and writing a checkpoint"
    if view is not None and not others:
        if me.has_initial_peers:
            return "no peers reachable: check --initial-peers (training alone meanwhile)"
        if me.state == PeerState.matchmaking:
            return "alone in the swarm: this round falls back to a local outer step"
        return "training alone: nobody else has joined this run yet"
    if me.state == PeerState.averaging:
        return "averaging pseudo-gradients with the group"
    if me.state == PeerState.matchmaking:
        mates = [p for p in others if p.epoch == me.epoch]
        behind = [p for p in mates if p.state == PeerState.training and p.inner_step < me.inner_steps]
        if behind:
            eta = _eta(behind, me.inner_steps, me.samples_per_step)
            plural = "peer" if len(behind) == 1 else "peers"
            when = f" (ETA {eta:.0f} s)" if eta is not None else ""
            named = f": {slowest(behind, me.inner_steps, me.samples_per_step, names)}" if names > 0 else ""
            return f"waiting for {len(behind)} {plural} to reach step {me.inner_steps}{when}{named}"
        if not mates:
            return f"looking for a group: no other peer is at epoch {me.epoch} yet"
        return f"matchmaking with {len(mates)} peer(s) at epoch {me.epoch}"
    if me.state == PeerState.training:
        eta = _eta([me], me.inner_steps, me.samples_per_step)
        when = f", round in ~{eta:.0f} s" if eta is not None else ""
        behind = f"; the last round is {me.round_in_background} in the background" if me.round_in_background else ""
        return f"not idle: training step {me.inner_step}/{me.inner_steps}{when}{behind}"
    return me.state


def _eta(peers: list, inner_steps: int, samples_per_step: int) -> float | None:
    times = [
        (inner_steps - p.inner_step) * samples_per_step / p.samples_per_second
        for p in peers
        if p.samples_per_second > 0
    ]
    return max(times) if times else None


def slowest(peers: list, inner_steps: int, samples_per_step: int, names: int = NAMED) -> str:
    """The ``names`` slowest of ``peers`` (the most time left; a peer with no speed yet counts as slowest), then
    "and N more": as long for a thousand peers as for four."""

    def left(p) -> float:
        if p.samples_per_second <= 0:
            return float("inf")
        return (inner_steps - p.inner_step) * samples_per_step / p.samples_per_second

    order = sorted(peers, key=lambda p: (-left(p), p.peer_id))
    shown = [_short(p.name) for p in order[:names]]
    more = len(peers) - len(shown)
    if more > 0:
        return ", ".join(shown) + f" and {more} more"
    if len(shown) > 1:
        return ", ".join(shown[:-1]) + " and " + shown[-1]
    return "".join(shown)


def _short(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"
