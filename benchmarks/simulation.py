"""The simulated swarm's pieces, in one process on CPU: the workers' data (each its own disjoint shard of the
built-in corpus, as real peers read), the client's inner step, the held-out score and what the wire does to a
pseudo-gradient. ``benchmarks.diloco_sim`` runs DiLoCo's rounds on them; ``benchmarks.convergence`` compares
the runs."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hivemind.compression import Float16Compression, deserialize_torch_tensor, serialize_torch_tensor

from client.data import SequenceStream, eval_batches, load_tokenizer, shard_order
from client.model import build_model
from client.presets import build_manifest
from client.sources import data_source
from client.step import lr_at
from swarm import RunManifest
from swarm.averager import codecs
from swarm.defence.robust import robust_mean
from swarm.manifest import Aggregation


class Wire(enum.StrEnum):
    fp32 = "fp32"
    fp16 = "fp16"
    fp4 = "fp4"
    sparse = "sparse"

    @property
    def error_feedback(self) -> bool:
        return self in (Wire.fp4, Wire.sparse)


@dataclass
class Curve:
    """One run's held-out loss against the training tokens seen so far."""

    name: str
    kind: str
    tokens: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    optimizer_steps: int = 0
    communication_rounds: int = 0
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)

    def add(self, tokens: int, loss: float) -> None:
        self.tokens.append(tokens)
        self.eval_loss.append(loss)
        print(f"  {self.name:<18} tokens {tokens:>10,}  held-out loss {loss:.4f}", flush=True)

    @property
    def final(self) -> float:
        return self.eval_loss[-1]


@dataclass
class Setup:
    """Sizes and data shared by every run."""

    preset: str
    workers: int
    steps: int  # optimizer steps of each DiLoCo worker (= DDP steps)
    batch: int  # sequences per worker step
    eval_every: int  # DDP-equivalent steps between held-out evaluations
    batches: list[list[torch.Tensor]]  # [worker][step] -> (batch, seq_len)
    eval_set: list[torch.Tensor]
    shards: list[int]
    seed: int = 0  # another seed: another initial model and other shards for the workers (0: the preset's)

    def manifest(self, total_steps: int, extra: list[str] = ()) -> RunManifest:
        """The preset, with the cosine schedule ending at this run's last step."""
        overrides = [f"samples_per_step={self.batch}", f"inner.total_steps={total_steps}", *extra]
        if self.seed:
            overrides.append(f"init_seed={build_manifest(self.preset).init_seed + self.seed}")
        return build_manifest(self.preset, overrides=overrides)

    @property
    def tokens_per_ddp_step(self) -> int:
        return self.workers * self.batch * self.batches[0][0].shape[1]


def worker_seeds(manifest: RunManifest, workers: int, seed: int = 0) -> list[tuple[str, int]]:
    """Peer seeds whose first shards differ, so the simulated workers read disjoint text like real peers."""
    seeds, used, k = [], set(), 0
    prefix = "bench-worker" if not seed else f"bench-worker-seed{seed}"
    while len(seeds) < workers:
        seed_name = f"{prefix}-{len(seeds)}-{k}"
        first = shard_order(manifest.dataset, seed_name)[0]
        if first not in used:
            seeds.append((seed_name, first))
            used.add(first)
            k = 0
        else:
            k += 1
    return seeds


def prepare(
    preset: str, workers: int, steps: int, batch: int | None, eval_sequences: int, eval_every: int, seed: int = 0
) -> Setup:
    base = build_manifest(preset)
    batch = batch or base.samples_per_step
    tokenizer = load_tokenizer(base.tokenizer)
    seeds = worker_seeds(base, workers, seed)
    data = data_source(base.dataset)
    batches = []
    for name, shard in seeds:
        stream = SequenceStream(data, tokenizer, base.seq_len, peer_seed=name)
        batches.append([stream.next_batch(batch) for _ in range(steps)])
        if stream.position.order_index != 0:
            print(f"  note: worker seed {name} ran past its first shard ({shard}); shards may overlap")
    eval_set = eval_batches(data, tokenizer, base.seq_len, eval_sequences)
    return Setup(preset, workers, steps, batch, eval_every, batches, eval_set, [s for _, s in seeds], seed)


def evaluate(model: torch.nn.Module, eval_set: list[torch.Tensor]) -> float:
    """Mean held-out loss, as client.trainer.Trainer.evaluate computes it."""
    model.eval()
    with torch.no_grad():
        losses = [float(model(input_ids=x, labels=x).loss) for x in eval_set]
    model.train()
    return sum(losses) / len(losses)


def make_optimizer(model: torch.nn.Module, manifest: RunManifest) -> torch.optim.AdamW:
    spec = manifest.inner
    return torch.optim.AdamW(
        model.parameters(), lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
    )


def inner_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    lr: float,
    clip: float,
    grads: list[list[torch.Tensor | None]] | None = None,
):
    """The client's CPU inner step: loss, backward, clip, AdamW (client.trainer.Trainer._inner_step). With
    ``grads``, the clipped gradients the step used are appended to it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if grads is not None:
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run_sequential(setup: Setup, name: str, kind: str, batch_at: Callable[[int], torch.Tensor], steps: int) -> Curve:
    """One model, ``steps`` optimizer steps: the single worker and the DDP equivalent."""
    manifest = setup.manifest(total_steps=steps)
    model = build_model(manifest)
    optimizer = make_optimizer(model, manifest)
    curve = Curve(name, kind, optimizer_steps=steps, communication_rounds=steps if kind == "ddp" else 0)
    tokens_per_step = setup.tokens_per_ddp_step * setup.steps // steps
    eval_every = max(1, setup.eval_every * steps // setup.steps)
    curve.add(0, evaluate(model, setup.eval_set))
    for step in range(steps):
        inner_step(model, optimizer, batch_at(step), lr_at(manifest, step), manifest.inner.grad_clip)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.add((step + 1) * tokens_per_step, evaluate(model, setup.eval_set))
    return curve


def fp16_round_trip(tensor: torch.Tensor) -> torch.Tensor:
    """What one pass over the swarm's FP16 wire does to a tensor (swarm.averager.allreduce ExactAllReduceRunner)."""
    kind = Float16Compression().compression_type
    return deserialize_torch_tensor(serialize_torch_tensor(tensor, kind))


def through_wire(tensor: torch.Tensor, wire: Wire, average: bool) -> torch.Tensor:
    """A sender's values (``average`` False) or a reducer's average as every groupmate decodes them. fp4 and
    sparse senders' values are already on the codec's grid (error feedback quantized them)."""
    flat = tensor.reshape(-1)
    if wire == Wire.fp16:
        return fp16_round_trip(tensor)
    if wire == Wire.fp4 and average:
        return codecs.fp4_decode(codecs.fp4_encode(flat), flat.numel()).view(tensor.shape)
    if wire == Wire.sparse and average:
        return codecs.sparse_decode(codecs.sparse_encode_average(flat), flat.numel()).view(tensor.shape)
    return tensor


def average(pseudo_gradients: list[list[torch.Tensor]], wire: Wire, robust: bool = False) -> list[torch.Tensor]:
    """Equal-weight mean of the workers' pseudo-gradients, summed in fp32, through the wire both ways; or, with
    ``robust``, the swarm reducer's robust mean (swarm.defence.robust), per tensor (the reducers take it per
    all-reduce part, slices of the same flat vector)."""
    averaged = []
    for parts in zip(*pseudo_gradients):
        inputs = [through_wire(p, wire, average=False) for p in parts]
        if robust:
            flat = [i.reshape(-1) for i in inputs]
            mean = robust_mean(flat, [1.0] * len(flat), Aggregation.centered_clip).view(parts[0].shape)
        else:
            mean = torch.stack(inputs).mean(dim=0)
        averaged.append(through_wire(mean, wire, average=True))
    return averaged


def bytes_per_param(sent: list[torch.Tensor], averaged: list[torch.Tensor], wire: Wire) -> float:
    """One encoded pseudo-gradient per parameter, averaged over both directions (a sender's, the average)."""
    numel = sum(t.numel() for t in sent)
    if not wire.error_feedback:
        return 4.0 if wire == Wire.fp32 else 2.0
    encode = codecs.fp4_encode if wire == Wire.fp4 else codecs.sparse_encode
    encode_average = codecs.fp4_encode if wire == Wire.fp4 else codecs.sparse_encode_average
    out = sum(len(encode(t.reshape(-1))) for t in sent)
    back = sum(len(encode_average(t.reshape(-1))) for t in averaged)
    return (out + back) / 2 / numel


def butterfly_bytes(numel: int, workers: int, bytes_per_value: float) -> float:
    """Bytes one worker sends in one butterfly all-reduce: scatter-reduce plus all-gather."""
    return 2 * bytes_per_value * numel * (workers - 1) / workers
