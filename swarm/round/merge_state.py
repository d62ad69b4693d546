"""What one flight's second stage holds as it goes (``swarm.round.merge``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.averager.handle import Averaging
from swarm.dht.groups import Merged
from swarm.dht.records import GroupRecord
from swarm.events import MergeSource


@dataclass
class MergeState:
    """One flight's second stage, as it goes."""

    epoch: int
    tag: str
    delegate: str
    members: tuple[str, ...]
    size: int
    weight: float
    digest: str | None  # of our group's average (None: a group of one)
    deadline: float
    registered_at: float | None = None
    unregistered: dict | None = None  # a registration the DHT did not take (its merge fields): tried again
    register_tried_at: float = -float("inf")
    decided: bool = False  # as the round's only group, our average was registered as the swarm's
    stage2: Averaging | None = None
    stage2_tries: int = 0
    merge_at: float | None = None  # when we (a delegate) decided to merge: the roster's writers take turns from it
    roster: tuple[str, ...] = ()  # the groups of the second stage, when we wrote its roster
    absent: frozenset[str] = frozenset()  # delegates that did not take part in a try of the second stage
    read_at: float = -float("inf")
    looked_at: float = -float("inf")  # at whether our delegate, or every holder of the swarm's average, is gone
    left_looks: int = 0  # looks in a row that found every peer we could fetch the swarm's average from gone
    fetched_at: float = -float("inf")
    seen_at: float | None = None  # when we first saw a swarm's average to take (our group's tree counts from it)
    source: MergeSource = MergeSource.held  # where the swarm's average we took came from
    records: list[GroupRecord] = field(default_factory=list)
    result: Merged | None = None
    counted: bool = False  # our group's average is in the swarm's
    groups: int = 1  # groups the swarm's average holds
    contributors: int = 1  # peers whose pseudo-gradients it holds
    done: bool = False
    bytes_sent: int = 0
    bytes_received: int = 0
    findings: tuple[dict, ...] = ()  # of every try of our second stage
    caught: frozenset[str] = frozenset()  # by a try of it: their records are not read
    fallback: str | None = None  # why we step with our own group's average
    distrusted: frozenset[str] = frozenset()  # groupmates our first stage's findings ban: not waited for as delegate
    refused: frozenset[str] = frozenset()  # swarm's averages whose bytes were unlike our group's (``vouched.unlike``)
    partners: frozenset[str] = frozenset()  # who our second stage ran whole with (pipeline drops the caught)
