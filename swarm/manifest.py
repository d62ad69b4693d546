"""The run manifest: everything that every peer of one run must agree on.

A run is named by the hash of its canonical manifest, so a joiner that knows only
the run id can fetch the manifest from any peer and check that nobody tampered
with it. Volunteers therefore never copy hyperparameters by hand.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from swarm.errors import ManifestError

RUN_ID_LENGTH = 16


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# A name on the Hugging Face hub, ``owner/name`` or ``name``: never a path on a peer's machine. Each part starts with
# a letter or a digit (no ``/``, ``.``, ``~``), has no ``..`` and at most 96 characters, as the hub's repo ids.
HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


def check_hub_name(value: str, field: str) -> str:
    """``value`` if it is a hub name, else a ValueError saying that a manifest names no path on a peer's machine."""
    if not HUB_NAME.fullmatch(value) or ".." in value:
        raise ValueError(
            f"{field} {value!r} is not a hub name ('owner/name' or 'name': letters, digits, '.', '_' and '-', "
            "each part starting with a letter or digit). A manifest never names a path on a peer's machine"
        )
    return value


class TokenizerKind(enum.StrEnum):
    bytes = "bytes"  # the built-in byte-level tokenizer
    auto = "auto"  # AutoTokenizer, from the hub


class TokenizerSpec(_Frozen):
    """``bytes`` is the built-in byte-level tokenizer; ``auto`` loads ``name`` from the hub with AutoTokenizer."""

    kind: TokenizerKind = TokenizerKind.bytes
    name: str | None = None  # a hub name, never a local path

    @model_validator(mode="after")
    def _hub_name_for_auto(self) -> TokenizerSpec:
        if self.kind is TokenizerKind.auto and not self.name:
            raise ValueError("tokenizer.kind 'auto' needs tokenizer.name, a tokenizer's name on the hub")
        if self.name is not None:
            check_hub_name(self.name, "tokenizer.name")
        return self


class DatasetSource(enum.StrEnum):
    builtin = "builtin"  # Python's standard library, which every machine has
    local = "local"  # files each peer names itself (--data-path); the manifest names none
    hub = "hub"  # a dataset on the hub, by name


class DatasetSpec(_Frozen):
    """Where the training text comes from: the built-in corpus, each peer's own files or a hub dataset."""

    source: DatasetSource = DatasetSource.builtin
    path: str | None = None  # hub: the dataset's name (never a path); local: none, each peer names its own files
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = True
    num_shards: int = Field(64, ge=2)  # documents are dealt round-robin; the last shard is held out for eval

    @model_validator(mode="after")
    def _no_path_on_a_peers_machine(self) -> DatasetSpec:
        if self.source is DatasetSource.hub and not self.path:
            raise ValueError("dataset.source 'hub' needs dataset.path, the dataset's name on the hub")
        if self.source is DatasetSource.local and self.path is not None:
            raise ValueError(
                f"dataset.path {self.path!r} cannot be set with dataset.source 'local': a manifest never names a path "
                "on a peer's machine. Each peer, the run's creator included, gives its own files with --data-path "
                "(on the command line: --set dataset.path=null)"
            )
        if self.path is not None:  # builtin ignores it, but a manifest carries no path at all
            check_hub_name(self.path, "dataset.path")
        return self


class InnerOptimizerSpec(_Frozen):
    """AdamW run by every peer between averaging rounds, with linear warmup then cosine decay."""

    lr: PositiveFloat = 4e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    weight_decay: float = Field(0.1, ge=0)
    warmup_steps: int = Field(1000, ge=0)
    total_steps: PositiveInt = 88_000
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: PositiveFloat = 1.0


class OuterOptimizerSpec(_Frozen):
    """SGD with Nesterov momentum on the averaged pseudo-gradient (DiLoCo: lr 0.7, momentum 0.9)."""

    lr: PositiveFloat = 0.7
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OuterOptimizerSpec:
        if self.nesterov and self.momentum == 0:
            raise ValueError("outer.nesterov needs outer.momentum > 0")
        return self


# the slowest link, each way, that a round's bounds leave time for (``AveragingSpec.fetch_seconds``): a home
# connection's upload. A constant, not a manifest field: a new field changes every preset's run id
SLOWEST_LINK_MBIT = 10.0


def at_slowest_link(nbytes: float) -> float:
    """Seconds ``nbytes`` take at ``SLOWEST_LINK_MBIT``."""
    return nbytes / (SLOWEST_LINK_MBIT * 125_000)


class Compression(enum.StrEnum):
    """What pseudo-gradients look like on the wire; each member says what else it means. The values are the
    manifest's words, so a run's id does not depend on this type. The codec objects themselves are
    ``swarm.averager.codecs.codec(compression)``'s."""

    error_feedback: bool  # it keeps what it did not send (fp32, per peer) and sends it with the next round
    on_grid: bool  # values already on its grid come back exactly from encoding (a local round's step as is)
    wire_bytes: float  # bytes per value of an average on the wire, at most (what a transfer's bound is sized by)

    def __new__(cls, value: str, error_feedback: bool, on_grid: bool, wire_bytes: float) -> Compression:
        member = str.__new__(cls, value)
        member._value_ = value
        member.error_feedback, member.on_grid, member.wire_bytes = error_feedback, on_grid, wire_bytes
        return member

    none = "none", False, True, 4.0
    fp16 = "fp16", False, False, 2.0
    scaled_fp16 = "scaled-fp16", False, False, 2.0
    fp4 = "fp4", True, True, 0.5  # FP4 E3M0 in blocks of 1024, deflated: about 0.44 B/value
    # top-k of each chunk of 4096 with two levels: about 0.04 B/value a sender; an average of many senders is
    # denser, at most the 1/8 of fp32 its codec tells hivemind (``SparseCodec.estimate_compression_ratio``)
    sparse = "sparse", True, True, 0.5


class Aggregation(enum.StrEnum):
    """How a reducer combines its groupmates' parts (``swarm.defence.robust``)."""

    mean = "mean"  # the plain weighted mean, as hivemind does (parts still checked)
    centered_clip = "centered-clip"


class StandIn(enum.StrEnum):
    """What an overlapped round's model steps with while the group's average is in flight."""

    own = "own"  # the step of this peer's whole pseudo-gradient (eager updates, arXiv 2502.12996)
    # the step of its own share of the group's average: 1/N of its pseudo-gradient, N the last group's size (the
    # average of N weakly agreeing pseudo-gradients is much shorter than any one of them)
    share = "share"
    blend = "blend"  # that share plus, for the others' shares, the last round's average


class AveragingSpec(_Frozen):
    """How pseudo-gradients are averaged, and how long anyone waits for anyone."""

    # on the wire: fp4 (E3M0, deflated: about 0.44 B/value) and sparse (top-k, about 0.04 B/value) keep what they
    # did not send (error feedback) and send it with the next round; fp4 by default, with overlapped rounds
    compression: Compression = Compression.fp4
    sparse_k: int = Field(64, ge=1, le=128)  # sparse: values sent per chunk of 4096
    # overlapped: after H steps the pseudo-gradient is averaged in the background while the next round's inner
    # steps run, from the global model moved by our own pseudo-gradient's step; when the average lands (at the
    # latest, at the next round's start) the group's step replaces that stand-in (eager updates). On by default
    # since damped overlapped fp4 landing 2 steps late ended 0.973 of blocking FP32's held-out loss on three fresh
    # seeds (benchmarks/results/convergence-fresh-seeds/README.md); false: blocking rounds
    overlap: bool = True
    stand_in: StandIn = StandIn.share  # overlapped: what the model steps with until the average lands (share:
    # 1.129 of blocking in benchmarks/results/convergence-standin, own 1.168, blend 1.384)
    # overlapped: the share of the inner steps taken from the stand-in that stays when the average lands 2 or more
    # steps late; below 1 they are damped (the model becomes the new global one plus that share of them), as
    # Streaming DiLoCo's merge damps them: in the simulator (five seeds), landing 5 steps of 10 late, 0.5 took the
    # cost from 12.9% of blocking's held-out loss to 2.0%, at 2 steps from 2.1% to -0.8%, and cost 1.0% at 1 step,
    # so a landing 1 step late keeps them all (benchmarks/results/convergence-merge/README.md). 1: all at any lag
    in_flight_steps_kept: float = Field(0.5, ge=0.0, le=1.0)
    # how a reducer combines its groupmates' parts (swarm.defence.robust): centered-clip caps weights at the median,
    # clips norms to the median and takes CenteredClip, so one peer sending garbage moves the swarm little;
    # mean is hivemind's plain weighted mean (parts are checked for size and finiteness either way)
    aggregation: Aggregation = Aggregation.centered_clip
    # checked reducers (swarm.defence.audit): a reducer signs what it received and returned, a groupmate recomputes its
    # average, and a reducer caught lying has its slice dropped from the round and is banned; the audits take
    # up to allreduce_timeout more per round (half for audits, half for re-checking accusations)
    checked_reducers: bool = True
    # parts of each reducer's slice its auditor checks, drawn at random after the reducer signed its receipt (0:
    # every part), and as many again whose average stands out against what the auditor sent (a large lie). A
    # sample cuts the audits' traffic to about 2 x audit_parts parts per sender on a big model, but a reducer that
    # lies within the honest parts' spread in a share f of its parts is caught with 1 - (1 - f)^audit_parts a round
    audit_parts: NonNegativeInt = 0
    # keep the last K rounds' averages as they came off the wire; a peer 1..K epochs behind replays them
    # instead of downloading the whole state
    replay_rounds: int = Field(4, ge=0, le=7)  # at most CHECKSUM_HISTORY - 1: each step is checked
    matchmaking_time: PositiveFloat = 5.0  # a leader gathers followers for this long
    matchmaking_timeout: PositiveFloat = 60.0  # give up finding a group after this long
    # while epoch-mates are still training towards step H, keep looking for a group up to this long in all,
    # rather than step alone and run ahead of the swarm
    wait_for_peers: NonNegativeFloat = 600.0
    # give up a formed group's all-reduce after this long, or after what its payload takes at the slowest link
    # where that is longer (``allreduce_seconds``); a download (a state, an update) likewise (``transfer_timeout``)
    allreduce_timeout: PositiveFloat = 120.0
    chunk_timeout: PositiveFloat = 20.0  # a peer silent this long in all-reduce is dropped
    target_group_size: PositiveInt = 64
    min_group_size: int = Field(2, ge=2)
    # two-stage rounds (swarm.round.merge): when a round forms several groups, their delegates average the groups'
    # averages, and every peer steps with that one swarm's average; false: each group steps with its own, and the
    # peers outside the group with the most checksum votes re-sync (their round's work is lost)
    merge_groups: bool = True
    # the most a group waits for the swarm's average, beyond the other groups' first stage and one hop of the
    # average down its group's tree (``merge_limit``)
    merge_timeout: PositiveFloat = 60.0
    consistency_timeout: PositiveFloat = 10.0  # wait for groupmates' checksums this long
    # a peer short of H steps joins a round its epoch-mates already started, weighted by the samples it did,
    # so slow or freshly re-synced peers are not left chasing the swarm (dynamic local steps, Async DiLoCo)
    join_rounds_early: bool = True

    def transfer_timeout(self, nbytes: float) -> float:
        """The longest one download of ``nbytes`` (a state file, a round's update) may take: ``allreduce_timeout``,
        or what those bytes take at the slowest link where that is longer. A ``150m`` state (1.7 GB) takes 23
        minutes at 10 Mbit/s; with 120 s, a joiner needed 115 Mbit/s."""
        return max(self.allreduce_timeout, at_slowest_link(nbytes))

    @property
    def min_rate(self) -> float:
        """Bytes a second below which a state or replay download is given up, over a minute
        (``swarm.averager.trickle``): a tenth of the slowest link, 1 Mbit/s, so a 10 Mbit/s donor serving ten
        receivers at once stays above it."""
        return SLOWEST_LINK_MBIT * 125_000 / 10

    def update_timeout(self, numel: int) -> float:
        """One download of a round's update (the swarm's average, a replayed round) of ``numel`` values."""
        return self.transfer_timeout(numel * self.compression.wire_bytes)

    def fetch_seconds(self, numel: int) -> float:
        """One hop of a group's tree at the slowest link: a parent sends an average of ``numel`` values to its two
        children. For ``150m``'s fp4 average (215M values, at most 107 MB), 172 s at 10 Mbit/s; ``tiny``'s, 1 s."""
        return at_slowest_link(2 * numel * self.compression.wire_bytes)

    def allreduce_seconds(self, numel: int) -> float:
        """A formed group's all-reduce of ``numel`` values: ``allreduce_timeout``, or what its payload takes at the
        slowest link where that is longer. Each peer sends its parts and the averages of its slice, and receives as
        much: under 2 x numel x the codec's bytes each way (``fetch_seconds``): 172 s for ``150m``'s fp4 and 880 s
        for ``1b``'s at 10 Mbit/s, where 120 s never let a ``1b`` group on a home link finish."""
        return max(self.allreduce_timeout, self.fetch_seconds(numel))

    def allreduce_limit(self, numel: int) -> float:
        """The longest a formed group's all-reduce of ``numel`` values may last in the averager: with checked
        reducers, the audits may take as long again."""
        return self.allreduce_seconds(numel) * (2 if self.checked_reducers else 1)

    def merge_limit(self, numel: int) -> float:
        """The longest a group waits for the swarm's average of a model of ``numel`` parameters (two-stage rounds):
        the groups still in their first stage when ours ended register within ``allreduce_limit``, then
        ``merge_timeout`` for the second stage, and one hop of its average down the group's tree at the slowest
        link. Without that hop, swarm-sim's ``150m`` groups fell back in 5-7% of peer-rounds at N = 100, every one
        with the average registered and their fetch still under way (``benchmarks/results/swarm-sim-fetch``)."""
        return self.allreduce_limit(numel) + self.merge_timeout + self.fetch_seconds(numel)

    def attempt_limit(self, numel: int) -> float:
        """The longest one averaging attempt of ``numel`` values may last: matchmaking, the all-reduce with its
        audits, and the averager's own ending (``ending_seconds``); after it the attempt is abandoned."""
        return self.matchmaking_timeout + self.allreduce_limit(numel) + self.ending_seconds(numel)

    def ending_seconds(self, numel: int) -> float:
        """What an averager may take past ``allreduce_limit``: a write of the average into the buffers that began
        by then is never cut (``FixedGroups._within_limit``), nor the round's update kept on disk after it. 10 s,
        and per value 20 ns of decoding and its bytes at 50 MB/s: 16.4 s for ``150m``'s fp4, 43 s for ``1b``'s."""
        return 10 + numel * (2e-8 + self.compression.wire_bytes / 50e6)

    @model_validator(mode="after")
    def _times_fit(self) -> AveragingSpec:
        if self.matchmaking_time >= self.matchmaking_timeout:
            raise ValueError("averaging.matchmaking_time must be shorter than averaging.matchmaking_timeout")
        if self.min_group_size > self.target_group_size:
            raise ValueError("averaging.min_group_size cannot exceed averaging.target_group_size")
        return self


class RunManifest(_Frozen):
    """Everything peers must share. Its canonical JSON hash is the run id."""

    name: str = Field("swarm-run", min_length=1, max_length=64)
    model: dict[str, Any] = Field(description="a transformers AutoConfig dict; must hold 'model_type'")
    tokenizer: TokenizerSpec = TokenizerSpec()
    dataset: DatasetSpec = DatasetSpec()
    seq_len: PositiveInt = 256
    samples_per_step: PositiveInt = 32
    inner_steps: PositiveInt = 500  # H: inner steps per outer round
    inner: InnerOptimizerSpec = InnerOptimizerSpec()
    outer: OuterOptimizerSpec = OuterOptimizerSpec()
    averaging: AveragingSpec = AveragingSpec()
    mixed_precision: Literal["fp16", "bf16"] = "fp16"  # on GPUs; bf16 only where the GPU supports it
    init_seed: int = 0
    # a closed run's access tag (swarm.dht.access): derived from its secret, which is never in here; None: open run
    access: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")
    version: Literal[1] = 1

    @model_validator(mode="after")
    def _model_has_type(self) -> RunManifest:
        if "model_type" not in self.model:
            raise ValueError("model must be a transformers config dict with a 'model_type' key")
        return self

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @property
    def run_id(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:RUN_ID_LENGTH]

    @property
    def tokens_per_step(self) -> int:
        return self.samples_per_step * self.seq_len

    @classmethod
    def from_json(cls, text: str) -> RunManifest:
        try:
            return cls.model_validate_json(text)
        except ValueError as e:
            raise ManifestError(f"The manifest is invalid: {e}") from None

    @classmethod
    def from_record(cls, run_id: str, text: str) -> RunManifest:
        """Parse a manifest fetched from the swarm and refuse it unless it hashes to ``run_id``."""
        manifest = cls.from_json(text)
        if manifest.run_id != run_id:
            raise ManifestError(
                f"The manifest published for run {run_id} hashes to {manifest.run_id}: a peer served a "
                "tampered or corrupted manifest. It was refused; ask the run's operator for the right run id."
            )
        return manifest
