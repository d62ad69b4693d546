"""Does DiLoCo train as well as data-parallel, at equal tokens? Simulated in one process, on CPU.

Every run sees exactly the same training sequences: M workers each read their own
disjoint shard of the built-in corpus (as real peers do), and

- ``ddp`` takes one step on the concatenation of the M workers' batches (the DDP
  equivalent: M times the batch, one gradient average per step);
- ``diloco-*`` lets each worker take H AdamW steps on its own batches, then applies
  the swarm's own outer step (``swarm.outer.OuterState``) to the averaged
  pseudo-gradient; FP16 runs round-trip every pseudo-gradient and their average
  through hivemind's Float16Compression, as the swarm's all-reduce does on the wire;
- ``single`` is one worker stepping through all the same batches one at a time
  (M times as many steps at the original batch).

The held-out loss is scored on the corpus' held-out shard at the same token counts
for every run. Run: ``python -m benchmarks.convergence``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hivemind.compression import Float16Compression, deserialize_torch_tensor, serialize_torch_tensor

from benchmarks.common import (
    Stopwatch,
    add_common_args,
    command_line,
    finite,
    machine_info,
    print_table,
    pyplot,
    save_figure,
    write_json,
)
from client.data import SequenceStream, eval_batches, load_tokenizer, shard_order
from client.model import build_model, count_parameters
from client.presets import build_manifest
from client.trainer import lr_at
from swarm import RunManifest
from swarm.outer import OuterState

NAME = "convergence"


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

    def manifest(self, total_steps: int) -> RunManifest:
        """The preset, with the cosine schedule ending at this run's last step."""
        return build_manifest(
            self.preset, overrides=[f"samples_per_step={self.batch}", f"inner.total_steps={total_steps}"]
        )

    @property
    def tokens_per_ddp_step(self) -> int:
        return self.workers * self.batch * self.batches[0][0].shape[1]


def worker_seeds(manifest: RunManifest, workers: int) -> list[tuple[str, int]]:
    """Peer seeds whose first shards differ, so the simulated workers read disjoint text like real peers."""
    seeds, used, k = [], set(), 0
    while len(seeds) < workers:
        seed = f"bench-worker-{len(seeds)}-{k}"
        first = shard_order(manifest.dataset, seed)[0]
        if first not in used:
            seeds.append((seed, first))
            used.add(first)
            k = 0
        else:
            k += 1
    return seeds


def prepare(preset: str, workers: int, steps: int, batch: int | None, eval_sequences: int, eval_every: int) -> Setup:
    base = build_manifest(preset)
    batch = batch or base.samples_per_step
    tokenizer = load_tokenizer(base.tokenizer)
    seeds = worker_seeds(base, workers)
    batches = []
    for seed, shard in seeds:
        stream = SequenceStream(base.dataset, tokenizer, base.seq_len, peer_seed=seed)
        batches.append([stream.next_batch(batch) for _ in range(steps)])
        if stream.position.order_index != 0:
            print(f"  note: worker seed {seed} ran past its first shard ({shard}); shards may overlap")
    eval_set = eval_batches(base.dataset, tokenizer, base.seq_len, eval_sequences)
    return Setup(preset, workers, steps, batch, eval_every, batches, eval_set, [s for _, s in seeds])


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


def inner_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, lr: float, clip: float):
    """The client's CPU inner step: loss, backward, clip, AdamW (client.trainer.Trainer._inner_step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
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
    """What one pass over the swarm's FP16 wire does to a tensor (swarm.averaging ExactAllReduceRunner)."""
    kind = Float16Compression().compression_type
    return deserialize_torch_tensor(serialize_torch_tensor(tensor, kind))


def average(pseudo_gradients: list[list[torch.Tensor]], fp16: bool) -> list[torch.Tensor]:
    """Equal-weight mean of the workers' pseudo-gradients; FP16 inputs and output as on the wire, sum in fp32."""
    averaged = []
    for parts in zip(*pseudo_gradients):
        inputs = [fp16_round_trip(p) if fp16 else p for p in parts]
        mean = torch.stack(inputs).mean(dim=0)
        averaged.append(fp16_round_trip(mean) if fp16 else mean)
    return averaged


def run_diloco(setup: Setup, inner_steps: int, fp16: bool) -> Curve:
    """M workers, H inner steps each per round, the swarm's OuterState for the outer Nesterov step."""
    manifest = setup.manifest(total_steps=setup.steps)
    name = f"diloco-h{inner_steps}-{'fp16' if fp16 else 'fp32'}"
    models = [build_model(manifest) for _ in range(setup.workers)]
    optimizers = [make_optimizer(m, manifest) for m in models]
    outer = OuterState(list(models[0].parameters()), manifest.outer)
    rounds = setup.steps // inner_steps
    curve = Curve(name, "diloco", optimizer_steps=setup.steps, communication_rounds=rounds)
    curve.settings = dict(inner_steps=inner_steps, fp16=fp16, outer=manifest.outer.model_dump())
    curve.add(0, evaluate(models[0], setup.eval_set))
    for r in range(rounds):
        pseudo_gradients = []
        for w, (model, optimizer) in enumerate(zip(models, optimizers)):
            outer.write_to(list(model.parameters()))
            for h in range(inner_steps):
                step = r * inner_steps + h
                inner_step(model, optimizer, setup.batches[w][step], lr_at(manifest, step), manifest.inner.grad_clip)
            pseudo_gradients.append(outer.pseudo_gradient(list(model.parameters())))
        outer.step(average(pseudo_gradients, fp16))
        done = (r + 1) * inner_steps
        if done % setup.eval_every == 0 or r + 1 == rounds:
            outer.write_to(list(models[0].parameters()))
            curve.add(done * setup.tokens_per_ddp_step, evaluate(models[0], setup.eval_set))
    return curve


def butterfly_bytes(numel: int, workers: int, bytes_per_value: int) -> float:
    """Bytes one worker sends in one butterfly all-reduce: scatter-reduce plus all-gather."""
    return 2 * bytes_per_value * numel * (workers - 1) / workers


def summarize(curves: list[Curve], setup: Setup, numel: int) -> dict:
    by_name = {c.name: c for c in curves}
    ddp = by_name.get("ddp")
    ratios: dict[str, dict] = {}
    for c in curves:
        if c.kind == "diloco" and ddp is not None:
            ratios[f"{c.name}/ddp"] = dict(
                eval_loss_ratio=c.final / ddp.final, perplexity_ratio=math.exp(c.final - ddp.final)
            )
    for c in curves:
        if c.name.endswith("-fp16") and c.name.replace("-fp16", "-fp32") in by_name:
            ref = by_name[c.name.replace("-fp16", "-fp32")]
            ratios[f"{c.name}/{ref.name}"] = dict(
                eval_loss_ratio=c.final / ref.final, perplexity_ratio=math.exp(c.final - ref.final)
            )
    communication = {}
    for c in curves:
        per_round = butterfly_bytes(numel, setup.workers, 2 if c.name.endswith("-fp16") else 4)
        communication[c.name] = dict(
            rounds=c.communication_rounds, bytes_sent_per_worker=c.communication_rounds * per_round
        )
    if ddp is not None:
        for name, comm in communication.items():
            if comm["bytes_sent_per_worker"] and name != "ddp":
                comm["ddp_bytes_over_this"] = (
                    communication["ddp"]["bytes_sent_per_worker"] / comm["bytes_sent_per_worker"]
                )
    return dict(ratios=ratios, communication=communication)


def plot(curves: list[Curve], out: Path, title: str) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for c in curves:
        style = "--" if c.kind != "diloco" else "-"
        ax.plot([t / 1e6 for t in c.tokens[1:]], c.eval_loss[1:], style, marker=".", label=f"{c.name} ({c.final:.3f})")
    ax.set_xlabel("training tokens (millions, all workers together)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out, NAME)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--workers", type=int, default=4, help="M: DiLoCo workers, and the DDP batch multiple")
    p.add_argument("--steps", type=int, default=250, help="optimizer steps of each DiLoCo worker and of DDP")
    p.add_argument("--batch", type=int, default=4, help="sequences per worker step (the tiny preset has 8)")
    p.add_argument("--inner-steps", type=int, nargs="+", default=[10, 50], help="H values for fp32 DiLoCo")
    p.add_argument("--fp16-inner-steps", type=int, nargs="*", default=[50], help="H values also run with FP16")
    p.add_argument("--eval-sequences", type=int, default=64, help="held-out sequences scored at each point")
    p.add_argument("--eval-every", type=int, default=50, help="DDP-equivalent steps between held-out scores")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = p.parse_args(argv)
    if args.smoke:
        args.workers, args.steps, args.inner_steps, args.fp16_inner_steps = 2, 6, [2, 3], [3]
        args.eval_sequences, args.eval_every, args.batch = 8, 3, 2
    for h in {*args.inner_steps, *args.fp16_inner_steps}:
        if args.steps % h or args.steps % args.eval_every:
            p.error(f"--steps {args.steps} must be a multiple of H={h} and of --eval-every {args.eval_every}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = Stopwatch()
    setup = prepare(args.preset, args.workers, args.steps, args.batch, args.eval_sequences, args.eval_every)
    numel = count_parameters(build_model(setup.manifest(args.steps)))
    m = setup.workers
    print(
        f"convergence: {args.preset} preset ({numel / 1e6:.2f}M parameters), M={m} workers x {setup.steps} steps x "
        f"{setup.batch} sequences; {setup.steps * setup.tokens_per_ddp_step:,} tokens per run; shards {setup.shards}"
    )
    plan: list[tuple[str, Callable[[], Curve]]] = [
        (
            "ddp",
            lambda: run_sequential(
                setup, "ddp", "ddp", lambda t: torch.cat([b[t] for b in setup.batches]), setup.steps
            ),
        ),
    ]
    for h in args.inner_steps:
        plan.append((f"h{h}", lambda h=h: run_diloco(setup, h, fp16=False)))
    for h in args.fp16_inner_steps:
        plan.append((f"h{h}-fp16", lambda h=h: run_diloco(setup, h, fp16=True)))
    plan.append(
        (
            "single",
            lambda: run_sequential(setup, "single", "single", lambda t: setup.batches[t % m][t // m], m * setup.steps),
        )
    )
    curves: list[Curve] = []
    for _, run in plan:
        t0 = time.monotonic()
        curve = run()
        curve.seconds = round(time.monotonic() - t0, 1)
        curves.append(curve)
    summary = summarize(curves, setup, numel)
    record = dict(
        benchmark=NAME,
        command=command_line(),
        smoke=args.smoke,
        machine=machine_info(),
        sizes=dict(
            preset=args.preset,
            parameters=numel,
            workers=m,
            steps_per_worker=setup.steps,
            sequences_per_worker_step=setup.batch,
            seq_len=setup.batches[0][0].shape[1],
            tokens_per_run=setup.steps * setup.tokens_per_ddp_step,
            ddp_batch_sequences=m * setup.batch,
            eval_sequences=sum(len(x) for x in setup.eval_set),
            eval_every_ddp_steps=setup.eval_every,
            worker_shards=setup.shards,
            inner_lr=setup.manifest(setup.steps).inner.lr,
            warmup_steps=setup.manifest(setup.steps).inner.warmup_steps,
        ),
        runs=[
            dict(
                name=c.name,
                kind=c.kind,
                final_eval_loss=finite(c.final),
                final_perplexity=finite(math.exp(c.final)),
                tokens=c.tokens,
                eval_loss=[finite(v) for v in c.eval_loss],
                optimizer_steps=c.optimizer_steps,
                communication_rounds=c.communication_rounds,
                seconds=c.seconds,
                settings=c.settings,
            )
            for c in curves
        ],
        **summary,
        wall_seconds=clock.seconds,
    )
    print_table(
        "held-out loss at equal tokens",
        ["run", "final loss", "perplexity", "optimizer steps", "comm. rounds", "seconds"],
        [(c.name, c.final, math.exp(c.final), c.optimizer_steps, c.communication_rounds, c.seconds) for c in curves],
    )
    print_table(
        "ratios (goal: DiLoCo/DDP <= 1.00; paper 150M: 15.02/15.30 = 0.98 in perplexity)",
        ["ratio", "eval loss", "perplexity"],
        [(k, v["eval_loss_ratio"], v["perplexity_ratio"]) for k, v in summary["ratios"].items()],
    )
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(
        curves, args.out, f"{args.preset}: M={m}, {setup.steps * setup.tokens_per_ddp_step / 1e6:.2f}M tokens per run"
    )
    record["plots"] = [png.name] if png else []
    write_json(args.out, NAME, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
