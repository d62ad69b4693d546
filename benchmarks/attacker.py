"""The stock ``swarm-client`` with one lie, for the byzantine benchmark and tests.

``python -m benchmarks.attacker ATTACK [--factor F] -- join ...`` runs the real client,
except that the pseudo-gradient it puts in its averaging buffers each round (after
its own checks and error feedback, so exactly what goes on the wire), or the weight
it claims, is replaced:

- ``scale``: multiplied by ``factor`` (default 1000: finite, well inside FP16);
- ``sign``: multiplied by ``-factor`` (default 4);
- ``random``: Gaussian noise with ``factor`` times the honest norm (default 10);
- ``stale``: the first round's pseudo-gradient, sent again every round;
- ``weight``: the honest pseudo-gradient sign-flipped, claiming ``factor`` times the
  samples it did (default 1000);
- ``ipm``: "a little is enough" style inner-product manipulation: ``-factor`` times
  its own honest pseudo-gradient scaled to a tenth (default 1), small enough to pass
  norm checks;
- ``zero``: a free rider: sends zeros and claims its honest sample count;
- ``tensor``: only its largest tensor multiplied by ``factor`` (default 1000), the rest
  honest: a targeted lie that a whole-vector norm check would dilute;
- ``drift``: one fixed random direction with ``factor`` times its honest norm (default 1),
  every round: a steady push that random noise, new each round, would not give;
- ``nonfinite``: its honest pseudo-gradient with every 1000th value set to infinity, and
  its fp16 codec's clamp to +-65504 removed, so that the infinities reach the wire; fp4
  cannot carry an infinity (its encoder refuses one), so in fp4 each block holding one goes
  out with the scale byte that wraps a naive decoder's exponent into infinities (-128, a
  zero block's, over nonzero codes);
- ``reducer``: an honest sender, but as a reducer it returns ``-factor`` times the true
  average of its slice to the whole group (default 4), and signs for what it sent;
- ``few``: the ``reducer`` lie (-4 times the average) in about one part of every ``factor``
  it reduces (default 16, picked by the part's values, so about one part of its slice each
  round), honest in the rest:
  what an audit of a sample of each slice's parts (``averaging.audit_parts``) can miss;
- ``hide``: the ``reducer`` lie, and it serves no auditor the parts of its own slice (it
  signs its receipt, so it is plainly alive), hoping the slice goes unchecked;
- ``oversized``: every fp4 part it sends (as a sender, and its averages as a reducer) declares ``factor`` times
  2**20 values (default 2047: just under 2**31) and carries about 1 MB of deflated zeros that inflate to
  exactly that: a decoder that trusts the declared size allocates gigabytes per part;
- ``cut``: no lie in any value, but as a reducer it ends its stream to every groupmate after
  ``factor`` of its slice's parts (default 0.5), as a link cut mid-way does; it still signs
  for the whole average and serves it when asked again. Prints ``cut: ...`` when it did.
- ``forge``: the ``sign`` lie as a sender (``-factor`` times its pseudo-gradient, default 4), and as a reducer it
  counts every other sender at a thousandth of its weight, and lists those weights in its receipt: its own lie
  then is its slice's average, and a recomputation from the receipt's weights agrees with it. Only the senders'
  signed statements of their weights (``swarm.defence.statements``) tell the receipt is forged;
- ``omit``: the ``reducer`` lie, and its receipt lists every other sender but its auditor (which it can compute from
  the group id) as dropped mid-way (no digest), hoping every audit of its slice is inconclusive;
- ``withhold``: no lie in any value, but as a reducer it streams no average back to anyone, and serves none when
  asked again; it signs its receipts, so it is plainly alive;
- ``partial``: the ``reducer`` lie, and its receipt lists itself as its slice's only sender (a recomputation from
  its own part alone would agree with an average of its choosing);
- ``accuse``: honest in every value it sends and returns, but as an auditor it accuses every reducer it audits of
  a wrong average (with the reducer's own receipt), hoping the honest reducer is dropped and banned;
- ``split``: honest as a sender, but as a reducer it returns ``-factor`` times its slice's average (default 4) to
  every groupmate but its auditor (which it can compute from the group id), signing the digest of what it returned
  each one, and its receipt names the true average its auditor received: its auditor's check passes, and the rest
  of the group would apply the lie;
- ``dropper``: honest as a sender, but as a reducer it cuts the stream of one groupmate other than its auditor after
  the first part of its average it returned that groupmate (so its receipt counts one or two of its parts, as after a
  link cut), and returns ``-factor``
  times its slice's average (default 4) to everyone, signing for it: an audit that cannot check a slice with a
  dropped sender would pass it (the groupmate it cut fetches the average again, as signed);
- ``dropaudit``: the same, but the groupmate whose stream it cuts is its auditor (whose copy of the average then
  comes in part, so that it would not audit it at all);
- ``spoil``: its first part to its own auditor declares a value too many (the auditor refuses it, and with it this
  peer's slice, unaudited), and as a reducer it returns ``-factor`` times its average to everyone (default 4);
- ``baddonor``, ``undying``, ``sybil``, ``outvote``, ``fresh``: lies in the state it serves and the records its keys
  publish (``benchmarks.liar_records``);
- ``fakemerge``: honest in its group, but every epoch it registers a made-up swarm's average of weight 2**40, its
  group's average times ``factor`` (default -4), and serves it (``benchmarks.fake_merge``).

It follows the protocol in everything else. Nothing here is part of the product.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ATTACKS = {
    "scale": 1000.0,
    "sign": 4.0,
    "random": 10.0,
    "stale": 1.0,
    "weight": 1000.0,
    "ipm": 1.0,
    "zero": 0.0,
    "tensor": 1000.0,
    "drift": 1.0,
    "nonfinite": 1.0,
    "reducer": 4.0,
    "few": 16.0,
    "hide": 4.0,
    "cut": 0.5,
    "oversized": 2047.0,
    "forge": 4.0,
    "omit": 4.0,
    "withhold": 0.0,
    "partial": 4.0,
    "accuse": 0.0,
    "split": 4.0,
    "dropper": 4.0,
    "dropaudit": 4.0,
    "spoil": 4.0,
    "collude": 4.0,
    "mute": 0.0,
    "baddonor": -4.0,
    "undying": 2.0,
    "sybil": 1.0,
    "outvote": 2.0,
    "fresh": 1.0,
    "fakemerge": -4.0,
}


def install(attack: str, factor: float, client_argv: list[str] | None = None) -> None:
    from benchmarks import fake_merge, liar_records, reducer_lies

    if attack == "fakemerge":
        fake_merge.install(factor)
        return
    if attack == "baddonor":
        liar_records.install_bad_donor(factor)
        return
    if attack == "undying":
        liar_records.install_undying(int(factor))
        return
    if attack == "fresh":
        liar_records.install_fresh(int(factor), client_argv or [])
        return
    if attack in ("sybil", "outvote"):
        ahead = 0 if attack == "outvote" else liar_records.AHEAD
        liar_records.install_sybil(int(factor), client_argv or [], ahead=ahead)
        return
    if attack == "cut":
        reducer_lies.install_cut(factor)
        return
    if attack == "few":
        reducer_lies.install_few(int(factor))
        return
    if attack == "oversized":
        _install_oversized(int(factor) << 20)
        return
    if attack == "withhold":
        reducer_lies.install_cut(0.0)
        _install_receipt_lie(withhold=True)
        return
    if attack == "accuse":
        _install_false_accusations()
        return
    if attack == "split":
        reducer_lies.install_split(factor)
        return
    if attack == "spoil":
        reducer_lies.install_spoil(factor)
        return
    if attack == "collude":
        reducer_lies.install_collude(factor)
        return
    if attack == "mute":
        reducer_lies.install_mute()
        return
    if attack in ("dropper", "dropaudit"):
        reducer_lies.install_dropper(factor, auditor=attack == "dropaudit")
        return
    if attack == "forge":
        _install_forged_weights()
    if attack in ("reducer", "hide", "omit", "partial"):
        import swarm.averager.allreduce

        encode = swarm.averager.allreduce.encode_average
        swarm.averager.allreduce.encode_average = lambda tensor, compression: encode(tensor * -factor, compression)
        if attack in ("omit", "partial"):
            _install_receipt_lie(omit=attack == "omit", partial=attack == "partial")
        if attack == "hide":
            from swarm.averager.audit_serving import AuditRound

            served = AuditRound.served_sent  # what it serves an auditor (its own audits read ``sent_to``)
            AuditRound.served_sent = lambda self, reducer, indices: (
                None if reducer == self.runner.peer_id.to_base58() else served(self, reducer, indices)
            )
        return
    if attack == "nonfinite":
        from hivemind.compression.floating import Float16Compression

        Float16Compression.FP16_MIN, Float16Compression.FP16_MAX = float("-inf"), float("inf")
        _install_nonfinite_fp4()
    from swarm.averager.process import PseudoGradientAverager
    from swarm.round.pipeline import OuterRound

    feedback = OuterRound._apply_error_feedback  # the last change to the buffers before they go on the wire
    first: list[torch.Tensor] = []
    generator = torch.Generator().manual_seed(666)
    direction: list[torch.Tensor] = []

    def lying_feedback(self) -> None:
        feedback(self)
        with self.ctx.averager.get_tensors() as buffers:
            if attack == "stale" and not first:
                first.extend(b.clone() for b in buffers)
            if attack == "drift" and not direction:
                direction.extend(torch.randn(b.shape, generator=generator) for b in buffers)
            largest = max(range(len(buffers)), key=lambda i: buffers[i].numel())
            for i, b in enumerate(buffers):
                if attack == "scale":
                    b.mul_(factor)
                elif attack in ("sign", "weight", "forge"):
                    b.mul_(-factor if attack in ("sign", "forge") else -1.0)
                elif attack == "random":
                    noise = torch.randn(b.shape, generator=generator)
                    b.copy_(noise * (factor * b.norm() / noise.norm().clamp_min(1e-12)))
                elif attack == "stale":
                    b.copy_(first[i])
                elif attack == "ipm":
                    b.mul_(-0.1 * factor)
                elif attack == "zero":
                    b.zero_()
                elif attack == "tensor" and i == largest:
                    b.mul_(factor)
                elif attack == "drift":
                    b.copy_(direction[i] * (factor * b.norm() / direction[i].norm().clamp_min(1e-12)))
                elif attack == "nonfinite":
                    b.view(-1)[::1000] = float("inf")

    OuterRound._apply_error_feedback = lying_feedback
    if attack == "weight":
        start = PseudoGradientAverager.start_averaging

        def inflated(self, *, weight: float, **kwargs):
            return start(self, weight=weight * factor, **kwargs)

        PseudoGradientAverager.start_averaging = inflated


def _install_nonfinite_fp4() -> None:
    """fp4 parts whose blocks with an infinity carry the zero block's scale byte over nonzero codes (raw, not
    deflated: a decoder takes a part of the raw size as it is); the other blocks are honest."""
    import swarm.averager.codecs as codecs
    from swarm.averager import fp4

    def encode(flat: torch.Tensor) -> bytes:
        blocks = fp4._rows(flat, fp4.FP4_BLOCK)
        infinite = torch.isinf(blocks)
        clean = torch.where(infinite, torch.zeros_like(blocks), blocks)
        t = fp4._block_exponents(clean)
        codes = fp4._fp4_codes(clean, t)
        codes[infinite.numpy()] = 7  # the top level, positive
        t = torch.where(infinite.any(dim=1), torch.full_like(t, fp4.ZERO_EXPONENT), t)
        return fp4.fp4_raw(t, codes, flat.numel())

    codecs.fp4_encode = encode


def _install_oversized(numel: int) -> None:
    import math
    import zlib

    from hivemind.proto import runtime_pb2

    import swarm.averager.codecs as codecs
    from swarm.averager.fp4 import FP4_BLOCK

    raw = math.ceil(numel / FP4_BLOCK) + math.ceil(numel / 2)  # what an fp4 part of ``numel`` inflates to
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    zeros = b"".join(deflate.compress(bytes(1 << 26)) for _ in range(raw >> 26))
    zeros += deflate.compress(bytes(raw - ((raw >> 26) << 26))) + deflate.flush()

    def compress(self, tensor, info, allow_inplace=False):
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=zeros, size=[numel], dtype="float32")

    codecs.Fp4Codec.compress = compress
    os.write(2, f"oversized: fp4 parts of {len(zeros)} bytes declaring {numel} values\n".encode())


def _install_forged_weights() -> None:
    from swarm.averager.allreduce import ExactAllReduceRunner

    init = ExactAllReduceRunner.__init__

    def forging(self, *args, **kwargs):
        init(self, *args, **kwargs)
        own = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else -1
        accumulate, received = self.tensor_part_reducer.accumulate_part, self._received_from
        light = lambda index, weight: weight if index == own else weight * 1e-3  # noqa: E731

        async def lighter(sender_index, part_index, values, weight):
            return await accumulate(sender_index, part_index, values, weight=light(sender_index, weight))

        self.tensor_part_reducer.accumulate_part = lighter
        self._received_from = lambda index, part, weight: received(index, part, light(index, weight))

    ExactAllReduceRunner.__init__ = forging


def _install_false_accusations() -> None:
    from swarm.averager.auditing import Auditing
    from swarm.defence.audit import Verdict

    audit = Auditing._audit_one

    async def accusing(self, record, reducer, deadline, also=()):
        verdict, blob, checked = await audit(self, record, reducer, deadline, also)
        if blob is not None and reducer in record.members and reducer != self.peer_id.to_base58():
            os.write(2, f"accuse: said {reducer[-8:]} returned a wrong average (it was {verdict})\n".encode())
            return Verdict.wrong_average, blob, checked
        return verdict, blob, checked

    Auditing._audit_one = accusing


def _install_receipt_lie(omit: bool = False, withhold: bool = False, partial: bool = False) -> None:
    import dataclasses

    from swarm.averager.auditing import Auditing
    from swarm.defence.audit import auditor_of
    from swarm.defence.receipts import open_receipt

    sign = Auditing._sign_receipt

    async def lying(self, runner, record):
        if omit:  # every other sender but its auditor "dropped before its last part"
            me = runner.peer_id.to_base58()
            auditor = auditor_of(record.members, runner.group_id, me)
            keep = {me, auditor}
            senders = [p.to_base58() for p in runner.sender_peer_ids]
            runner.input_digests = [d if p in keep else [] for p, d in zip(senders, runner.input_digests)]
            os.write(2, b"omit: listed every sender but itself and its auditor without a digest\n")
        await sign(self, runner, record)
        if withhold:  # nothing to serve when asked for the average again
            record.own_output = []
        if partial:  # itself as the only sender: its own part alone "explains" its average
            receipt, me = open_receipt(record.receipt), self.peer_id.to_base58()
            i = receipt.senders.index(me)
            only = dataclasses.replace(receipt, senders=(me,), weights=receipt.weights[i : i + 1],
                                       inputs=receipt.inputs[i : i + 1], vouched=(b"",))  # fmt: skip
            record.receipt, record.listed, record.statements = only.sign(), record.listed[i : i + 1], [b""]
            os.write(2, b"partial: signed a receipt naming only itself\n")

    Auditing._sign_receipt = lying


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.attacker", description=__doc__.split("\n")[0])
    p.add_argument("attack", choices=sorted(ATTACKS))
    p.add_argument("--factor", type=float, default=None)
    args = p.parse_args(argv[:split])
    install(args.attack, ATTACKS[args.attack] if args.factor is None else args.factor, argv[split + 1 :])
    from client.cli import main as client_main

    return client_main(argv[split + 1 :])


if __name__ == "__main__":
    raise SystemExit(main())
