"""The lies of ``benchmarks.attacker`` told as a reducer in the all-reduce: in some parts only (``few``), a stream cut
short (``cut``), another average to all but its auditor (``split``), a groupmate's stream cut after one part
(``dropper``, ``dropaudit``), a liar with a second key that serves its auditor nothing (``collude``, ``mute``). Each
patches the stock client before it starts; nothing here is part of the product.
"""

from __future__ import annotations

import os

import torch

from benchmarks.attacker import ATTACKS


def install_few(every: int) -> None:
    import zlib

    import swarm.averager.allreduce

    encode = swarm.averager.allreduce.encode_average

    def lying(tensor, compression):
        # a part's average is encoded once for each groupmate's stream: the part lied in is picked by its values,
        # so that every groupmate gets the same wrong bytes (as from ``reducer``), not a different average each
        lie = zlib.crc32(tensor.detach().to(torch.float32).numpy().tobytes()) % every == 0
        if lie:  # to the log's file descriptor: the client routes a child's stderr to its debug log
            os.write(2, f"few: lied in an averaged part of {tensor.numel()} values\n".encode())
        return encode(tensor * -ATTACKS["reducer"] if lie else tensor, compression)

    swarm.averager.allreduce.encode_average = lying


def install_cut(share: float) -> None:
    from swarm.averager.allreduce import ExactAllReduceRunner

    stream = ExactAllReduceRunner._accumulate_parts_streaming

    async def cut(self, inputs, sender_index: int):
        total = self.tensor_part_reducer.num_parts
        keep, sent = int(total * share), 0
        async for message in stream(self, inputs, sender_index):  # every part is still read and reduced
            if sent < keep:
                sent += 1
                yield message
        # to the log's file descriptor: the client routes a child process's sys.stderr to its debug log
        os.write(2, f"cut: sent {sent} of {total} averaged parts to sender {sender_index}\n".encode())

    ExactAllReduceRunner._accumulate_parts_streaming = cut


def install_split(factor: float) -> None:
    import asyncio

    from swarm.averager.allreduce import ExactAllReduceRunner, encode_average
    from swarm.defence.audit import auditor_of

    returned = ExactAllReduceRunner._returned

    async def split(self, sender_index, part_index, averaged):
        members = [p.to_base58() for p in self.ordered_peer_ids]
        auditor = auditor_of(members, self.group_id, self.peer_id.to_base58())
        if sender_index == self.sender_peer_ids.index(self.peer_id) or (
            self.sender_peer_ids[sender_index].to_base58() == auditor
        ):  # its own copy (what its receipt names) and its auditor's: the true average
            return await returned(self, sender_index, part_index, averaged)
        if not getattr(self, "_split_said", False):
            self._split_said = True
            os.write(2, f"split: returned {-factor} times the average to all but its auditor {auditor[-8:]}\n".encode())
        codec = self.tensor_part_container.compression.compression_type
        return await asyncio.get_event_loop().run_in_executor(None, encode_average, averaged * -factor, codec)

    ExactAllReduceRunner._returned = split


def install_dropper(factor: float, auditor: bool) -> None:
    from swarm.averager.allreduce import ExactAllReduceRunner
    from swarm.defence.audit import auditor_of

    returned, stream = ExactAllReduceRunner._returned, ExactAllReduceRunner._accumulate_parts_streaming
    name = "dropaudit" if auditor else "dropper"

    async def lying(self, sender_index, part_index, averaged):  # to everyone, itself included (its receipt's)
        return await returned(self, sender_index, part_index, averaged * -factor)  # its audits of others stay honest

    async def dropping(self, inputs, sender_index: int):
        members = [p.to_base58() for p in self.ordered_peer_ids]
        me, sender = self.peer_id.to_base58(), self.sender_peer_ids[sender_index].to_base58()
        ours = auditor_of(members, self.group_id, me)
        others = [ours] if auditor else [m for m in members if m not in (me, ours)]
        sent = 0
        async for message in stream(self, inputs, sender_index):
            if others and sender == others[0] and sent == 1:  # after one averaged part: as if its link broke
                os.write(2, f"{name}: cut sender {sender[-8:]} after one averaged part\n".encode())
                raise ConnectionResetError("dropper: cut")
            sent += 1
            yield message

    ExactAllReduceRunner._accumulate_parts_streaming = dropping
    ExactAllReduceRunner._returned = lying


def install_spoil(factor: float) -> None:
    """``spoil``: as a sender, the first part it sends its own auditor declares one value too many (its auditor, as
    that part's reducer, refuses it, and drops this peer's slice unaudited); as a reducer, ``-factor`` times its
    slice's average to everyone, signed."""
    from swarm.averager.allreduce import ExactAllReduceRunner
    from swarm.defence.audit import auditor_of

    returned, record_sent = ExactAllReduceRunner._returned, ExactAllReduceRunner._record_sent

    async def lying(self, sender_index, part_index, averaged):
        return await returned(self, sender_index, part_index, averaged * -factor)

    async def spoiling(self, peer_index, stream):
        members = [p.to_base58() for p in self.ordered_peer_ids]
        to_auditor = members[peer_index] == auditor_of(members, self.group_id, self.peer_id.to_base58())
        first = True
        async for message in record_sent(self, peer_index, stream):
            if to_auditor and first:
                message.tensor_part.size[0] += 1  # out of bounds: refused before a byte is decoded
                os.write(2, f"spoil: sent its auditor {members[peer_index][-8:]} a malformed part\n".encode())
            first = False
            yield message

    ExactAllReduceRunner._returned = lying
    ExactAllReduceRunner._record_sent = spoiling


def install_collude(factor: float) -> None:
    """``collude``: as a reducer, ``-factor`` times its slice's average to everyone, signed, and it shows no auditor
    the parts it holds of a sender (``AuditRequest.held``). Its second key, ``mute`` (``byzantine.ACCOMPLICES``),
    serves no auditor the parts it sent: before, that left every audit of the liar's slice inconclusive."""
    from swarm.averager.allreduce import ExactAllReduceRunner
    from swarm.averager.audit_serving import AuditRound

    returned = ExactAllReduceRunner._returned

    async def lying(self, sender_index, part_index, averaged):
        return await returned(self, sender_index, part_index, averaged * -factor)

    def hiding(self, sender, indices):
        os.write(2, f"collude: showed no auditor the parts of {sender[-8:]} it holds\n".encode())
        return None

    ExactAllReduceRunner._returned = lying
    AuditRound.held_of = hiding


def install_mute() -> None:
    """``mute``: honest in everything but one: it serves no auditor the parts it sent another reducer, as a sender
    that is gone for good, or a liar's accomplice (``collude``). Those of its own slice it serves: a reducer that
    hides its own parts is struck as ``withheld`` (the first version of it was banned so in round 2, and with it
    gone, the liar was caught in round 3)."""
    from hivemind.utils.serializer import MSGPackSerializer

    from swarm.averager.audit_serving import AuditRequest, AuditServing

    serve = AuditServing._serve_audit

    async def mute(self, request, context):
        try:
            fields = MSGPackSerializer.loads(request.metadata)
            asked, reducer = fields.get("what"), fields.get("reducer")
        except Exception:
            asked = reducer = None
        if asked == AuditRequest.parts.value and reducer != self.peer_id.to_base58():
            os.write(2, f"mute: served {context.remote_id.to_base58()[-8:]} none of the parts it sent\n".encode())
            return
        async for message in serve(self, request, context):
            yield message

    AuditServing._serve_audit = mute
