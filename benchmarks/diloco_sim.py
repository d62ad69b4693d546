"""DiLoCo's rounds in one process (``run_diloco``): M simulated workers, H inner steps each, the swarm's own
outer step (``swarm.state.outer.OuterState``), blocking or overlapped, through a chosen wire. Each ``Variant`` is one
configuration; ``benchmarks.convergence`` runs them side by side at equal tokens."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from benchmarks.simulation import (
    Curve,
    Setup,
    Wire,
    average,
    bytes_per_param,
    evaluate,
    inner_step,
    make_optimizer,
)
from client.model import build_model
from client.step import lr_at
from swarm.averager import codecs
from swarm.state.outer import OuterState


class Mode(enum.StrEnum):
    blocking = "blocking"  # the outer step at the round's end
    delayed = "delayed"  # from the old global model, every worker moved by the same step when the average lands
    eager = "eager"  # a stand-in step at once, corrected to the average when it lands
    merge = "merge"  # Streaming DiLoCo: go on from one's own model, merged with the new global one when it lands


class Guess(enum.StrEnum):
    """An eager worker's stand-in for the average in flight (``stand_in_gradient``, ``AverageFit``)."""

    own = "own"
    share = "share"
    blend = "blend"
    fit = "fit"


class Source(enum.StrEnum):
    raw = "raw"  # the pseudo-gradient as computed (the client's since 2026-11-25)
    sent = "sent"  # after the codec's rounding and error feedback


class Moments(enum.StrEnum):
    keep = "keep"
    forget = "forget"


@dataclass(frozen=True)
class Variant:
    """One DiLoCo configuration. ``mode``: ``blocking`` (the outer step at the round's end), ``delayed`` (the
    workers go on from the old global model; the average lands ``delay`` inner steps into the next round, and
    moves every worker by the same step), ``eager`` (each worker steps at once with its own pseudo-gradient as a
    stand-in, corrected to the average when it lands; arXiv 2502.12996). A delay of H or more lands at the next
    round's end, after its H steps: the latest a client's average lands (it waits for it there)."""

    inner_steps: int
    wire: Wire = Wire.fp32
    mode: Mode = Mode.blocking
    delay: int = 0
    outer_lr: float | None = None  # None: the preset's
    outer_momentum: float | None = None
    robust: bool = False  # the reducers' robust mean (the manifest's default aggregation), not the plain mean
    # eager: own (whole own pseudo-gradient), share (own/N), blend (+ (1-1/N) last average),
    # fit (a * own + b * last average, a and b each worker's least-squares fit of the averages it has seen so far)
    stand_in: Guess = Guess.own
    # eager: the stand-in from the pseudo-gradient as computed (raw, as the client does since 2026-11-25) or as sent
    # (after the codec's rounding and error feedback: what the runs before then measured)
    stand_in_source: Source = Source.raw
    # eager: what the inner optimizer's first moment keeps of the steps taken from the stand-in once the average
    # lands: all of it (keep), or none (forget: each such step's gradient, measured at the stand-in and not where
    # the model turned out to be, is taken out of AdamW's exp_avg; the steps themselves stay)
    moments: Moments = Moments.keep
    # merge (Streaming DiLoCo, arXiv 2501.18512): the share of one's own model kept when the average lands,
    # ``p <- mix * p + (1 - mix) * global`` (the paper's alpha; 0.5 its choice)
    mix: float = 0.5
    # eager: the share of the inner steps taken from the stand-in that stays when the average lands (1: all of
    # them, the client's); below 1 they are damped, as Streaming DiLoCo's merge damps them
    keep: float = 1.0

    @property
    def name(self) -> str:
        name = f"diloco-h{self.inner_steps}-{self.wire}"
        if self.mode != Mode.blocking:
            name += f"-{self.mode}{self.delay}"
        if self.outer_lr is not None or self.outer_momentum is not None:
            name += f"-outer{self.outer_lr}m{self.outer_momentum}"
        if self.robust:
            name += "-robust"
        if self.mode == Mode.eager and self.stand_in != Guess.own:
            name += f"-{self.stand_in}"
        if self.mode == Mode.eager and self.stand_in_source != Source.raw:
            name += f"-from{self.stand_in_source}"
        if self.mode == Mode.eager and self.moments != Moments.keep:
            name += f"-{self.moments}"
        if self.mode == Mode.eager and self.keep != 1.0:
            name += f"-keep{self.keep}"
        if self.mode == Mode.merge:
            name += f"-mix{self.mix}"
        return name

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``h=10,wire=fp4,mode=eager,delay=5,lr=1.0,momentum=0,agg=robust,standin=blend``"""
        fields = dict(item.split("=", 1) for item in text.split(","))
        return cls(
            inner_steps=int(fields.pop("h")),
            wire=Wire(fields.pop("wire", "fp32")),
            mode=Mode(fields.pop("mode", "blocking")),
            delay=int(fields.pop("delay", 0)),
            outer_lr=float(fields["lr"]) if "lr" in fields else None,
            outer_momentum=float(fields["momentum"]) if "momentum" in fields else None,
            robust=fields.get("agg", "mean") == "robust",
            stand_in=Guess(fields.get("standin", "own")),
            stand_in_source=Source(fields.get("standinfrom", "raw")),
            moments=Moments(fields.get("moments", "keep")),
            mix=float(fields.get("mix", 0.5)),
            keep=float(fields.get("keep", 1.0)),
        )


def _tentative_step(outer: OuterState, pseudo_gradient: list[torch.Tensor]) -> list[torch.Tensor]:
    """How much ``outer.step(pseudo_gradient)`` would move the parameters, without moving them."""
    trial = OuterState(outer.params, outer.spec, epoch=outer.epoch)
    trial.momentum = [m.clone() for m in outer.momentum]
    before = [p.clone() for p in trial.params]
    trial.step(pseudo_gradient)
    return [a - b for a, b in zip(trial.params, before)]


def stand_in_gradient(
    own: list[torch.Tensor], last_average: list[torch.Tensor] | None, group: int, kind: Guess
) -> list[torch.Tensor]:
    """What an eager worker steps with while the average is in flight: its own pseudo-gradient (``own``), its
    own share of the average alone (``share``), or that plus the last round's average for the others' shares
    (``blend``)."""
    share = 1.0 / group
    if kind == Guess.share:
        return [o.mul(share) for o in own]
    if kind == Guess.own or last_average is None:
        return own
    return [o.mul(share).add_(a, alpha=1.0 - share) for o, a in zip(own, last_average)]


class AverageFit:
    """One worker's least-squares guess of the coming average from what it knows when its round ends: its own
    pseudo-gradient and the last round's average, ``average ~ a * own + b * last``. The normal equations are
    summed over the rounds seen so far, each scaled by its average's squared norm and decayed by ``decay``
    per round; until there is one to go by, the guess is one's own share (``a = 1/N``)."""

    def __init__(self, group: int, decay: float = 0.8):
        self.group, self.decay = group, decay
        self.xx = torch.zeros(2, 2, dtype=torch.float64)
        self.xa = torch.zeros(2, dtype=torch.float64)
        self.seen = 0

    def coefficients(self) -> tuple[float, float]:
        if not self.seen:
            return 1.0 / self.group, 0.0
        a, b = torch.linalg.lstsq(self.xx, self.xa.unsqueeze(1)).solution.squeeze(1).tolist()
        return a, b

    def guess(self, own: list[torch.Tensor], last: list[torch.Tensor] | None) -> list[torch.Tensor]:
        a, b = self.coefficients()
        if last is None:
            return [o.mul(1.0 / self.group) for o in own]
        return [o.mul(a).add_(x, alpha=b) for o, x in zip(own, last)]

    def learn(self, own: list[torch.Tensor], last: list[torch.Tensor] | None, average: list[torch.Tensor]) -> None:
        if last is None:
            return
        dot = lambda xs, ys: sum(float((x.double() * y.double()).sum()) for x, y in zip(xs, ys))  # noqa: E731
        scale = dot(average, average) or 1.0
        feats = (own, last)
        xx = torch.tensor([[dot(u, v) for v in feats] for u in feats], dtype=torch.float64) / scale
        xa = torch.tensor([dot(u, average) for u in feats], dtype=torch.float64) / scale
        self.xx.mul_(self.decay).add_(xx)
        self.xa.mul_(self.decay).add_(xa)
        self.seen += 1


def run_diloco(setup: Setup, variant: Variant) -> Curve:
    """M workers, H inner steps each per round, the swarm's OuterState for the outer Nesterov step."""
    h = variant.inner_steps
    overrides = []
    if variant.outer_lr is not None:
        overrides.append(f"outer.lr={variant.outer_lr}")
    if variant.outer_momentum is not None:
        nesterov = "true" if variant.outer_momentum else "false"
        overrides += [f"outer.momentum={variant.outer_momentum}", f"outer.nesterov={nesterov}"]
    manifest = setup.manifest(total_steps=setup.steps, extra=overrides)
    models = [build_model(manifest) for _ in range(setup.workers)]
    optimizers = [make_optimizer(m, manifest) for m in models]
    params = [list(m.parameters()) for m in models]
    outer = OuterState(params[0], manifest.outer)
    residuals = [[torch.zeros_like(p) for p in outer.params] for _ in models]
    rounds = setup.steps // h
    curve = Curve(variant.name, "diloco", optimizer_steps=setup.steps, communication_rounds=rounds)
    curve.settings = dict(
        inner_steps=h,
        wire=variant.wire,
        mode=variant.mode,
        delay=variant.delay,
        outer=manifest.outer.model_dump(),
        outer_lr=variant.outer_lr,  # the variant's own outer settings (None: the preset's)
        outer_momentum=variant.outer_momentum,
        aggregation="robust" if variant.robust else "mean",
        stand_in=variant.stand_in if variant.mode == Mode.eager else None,
        moments=variant.moments if variant.mode == Mode.eager else None,
        mix=variant.mix if variant.mode == Mode.merge else None,
        keep=variant.keep if variant.mode == Mode.eager else None,
    )
    curve.add(0, evaluate(models[0], setup.eval_set))
    pending: tuple[list[torch.Tensor], list[list[torch.Tensor]] | None] | None = None
    last_average: list[torch.Tensor] | None = None  # the last round's, as applied: blend's guess of the others'
    wire_bytes: list[float] = []

    displaced: list[list[list[torch.Tensor | None]]] = [[] for _ in models]  # per worker, steps from the stand-in
    fits = [AverageFit(setup.workers) for _ in models]
    features: list[tuple[list[torch.Tensor], list[torch.Tensor] | None]] = []  # fit: what each guess was made of
    beta1 = manifest.inner.betas[0]

    def land() -> None:
        averaged, stand_ins = pending
        for fit, (own, last) in zip(fits, features):
            fit.learn(own, last, averaged)
        features.clear()
        moved = _tentative_step(outer, averaged)
        before = [p.clone() for p in outer.params] if variant.keep != 1.0 else None
        outer.step(averaged)
        with torch.no_grad():
            if variant.mode == Mode.merge:
                for worker in params:
                    for p, g in zip(worker, outer.params):
                        p.mul_(variant.mix).add_(g, alpha=1.0 - variant.mix)
                return
            for w, worker in enumerate(params):
                for i, p in enumerate(worker):
                    if before is not None and stand_ins is not None:  # p = new global + keep * the steps taken
                        p.sub_(before[i]).sub_(stand_ins[w][i]).mul_(variant.keep).add_(outer.params[i])
                        continue
                    p.add_(moved[i] - (stand_ins[w][i] if stand_ins is not None else 0))
                steps = displaced[w]
                for n, grads in enumerate(steps):  # exp_avg = ... + (1 - b1) * b1^(steps after) * g
                    weight = (1 - beta1) * beta1 ** (len(steps) - 1 - n)
                    for p, g in zip(worker, grads):
                        if g is not None:
                            optimizers[w].state[p]["exp_avg"].sub_(g, alpha=weight)
                steps.clear()

    for r in range(rounds):
        for k in range(h):
            if pending is not None and k == variant.delay:
                land()
                pending = None
            step = r * h + k
            forget = pending is not None and variant.moments == Moments.forget
            for w, (model, optimizer) in enumerate(zip(models, optimizers)):
                grads = displaced[w] if forget else None
                lr = lr_at(manifest, step)
                inner_step(model, optimizer, setup.batches[w][step], lr, manifest.inner.grad_clip, grads)
        if pending is not None:
            land()
            pending = None
        pseudo_gradients, raw = [], []
        for w in range(setup.workers):
            delta = outer.pseudo_gradient(params[w])
            if variant.stand_in_source == Source.raw and variant.wire.error_feedback:
                raw.append([d.clone() for d in delta])
            if variant.wire.error_feedback:
                codecs.apply_error_feedback(delta, residuals[w], variant.wire)
            pseudo_gradients.append(delta)
        averaged = average(pseudo_gradients, variant.wire, variant.robust)
        wire_bytes.append(bytes_per_param(pseudo_gradients[0], averaged, variant.wire))
        if variant.mode == Mode.blocking:
            outer.step(averaged)
            for worker in params:
                outer.write_to(worker)
        else:
            stand_ins = None
            if variant.mode == Mode.eager:
                if variant.stand_in == Guess.fit:
                    features[:] = [(delta, last_average) for delta in (raw or pseudo_gradients)]
                    guesses = [fit.guess(own, last) for fit, (own, last) in zip(fits, features)]
                else:
                    guesses = [
                        stand_in_gradient(delta, last_average, setup.workers, variant.stand_in)
                        for delta in (raw or pseudo_gradients)
                    ]
                stand_ins = [_tentative_step(outer, guess) for guess in guesses]
            last_average = averaged
            for w, worker in enumerate(params):
                if variant.mode == Mode.merge:
                    continue  # each goes on from its own model until the average lands
                outer.write_to(worker)
                if stand_ins is not None:
                    with torch.no_grad():
                        for p, s in zip(worker, stand_ins[w]):
                            p.add_(s)
            pending = (averaged, stand_ins)  # delay >= H: lands after the next round's H steps, at its end
        done = (r + 1) * h
        if done % setup.eval_every == 0 or r + 1 == rounds:
            scored = build_model(manifest)
            outer.write_to(list(scored.parameters()))
            if pending is not None:  # the global model as it will be once the round in flight lands
                moved = _tentative_step(outer, pending[0])
                with torch.no_grad():
                    for p, m in zip(scored.parameters(), moved):
                        p.add_(m)
            curve.add(done * setup.tokens_per_ddp_step, evaluate(scored, setup.eval_set))
    curve.settings["bytes_per_param"] = sum(wire_bytes) / len(wire_bytes)
    return curve
