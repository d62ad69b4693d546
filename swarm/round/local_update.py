"""A local round's step, kept for replay like a group's average.

A peer with no group (alone, or its matchmaking failed) steps with its own
pseudo-gradient. A peer that took its state at that epoch, most often a joiner that
has just downloaded it from this very peer, is then one round behind. Before this
module it could replay only averaged rounds, so it downloaded the whole state again
(8 bytes per parameter) for one round's step (0.44 with fp4, 2 with fp16).

So a local round's step is kept too, exactly as a group of one would have received
it: the buffers encoded with the run's codec, in parts of ``PART`` values, written
as ``update-EPOCH.bin`` beside the averaged rounds' ones and served the same way.
The step must be the very values a replayer decodes, or its checksum differs:

- fp4 and sparse leave the buffers on their codec's grid already (error feedback
  rounds them to what is sent), and encoding such values gives them back exactly;
  ``none`` is exact. Their encoding (5.6 s for 100M parameters with fp4 on one CPU
  core) runs in a thread that holds the averaging buffers' lock until it has encoded
  them, while training goes on; the next round's pseudo-gradient waits for that lock.
- fp16 and scaled fp16 are not (scaled fp16 is not even once encoded: its scales
  are taken again from the rounded values), so the buffers are encoded before the
  step and replaced by what decoding gives (``round_to_codec``), as an average would
  be; those very bytes are written, in the thread (2 bytes per parameter held until
  then).

A replayer asking while the thread writes is answered once the file is there
(``FileTransfer.rpc_download_update``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from hivemind.proto import runtime_pb2

from swarm.averager.allreduce import encode_average
from swarm.averager.codecs import SLICE, codec
from swarm.averager.held import decode_into
from swarm.manifest import Compression

if TYPE_CHECKING:
    from swarm.averager.process import PseudoGradientAverager

logger = logging.getLogger(__name__)

PART = 4 * SLICE  # values per encoded part: whole codec slices, and a bounded temporary per part
LOCK_WAIT = 10.0  # seconds the round waits for the keeping thread to hold the buffers


def compression_type(compression: Compression) -> int:
    return codec(compression).compression_type


def encode_update(tensor: torch.Tensor, kind: int) -> list[runtime_pb2.Tensor]:
    """One tensor as a group of one would receive it: its values in parts of ``PART``, each encoded as a
    reducer encodes its average."""
    flat = tensor.detach().reshape(-1)
    return [encode_average(part, kind) for part in flat.split(PART)]


def round_to_codec(buffers: Sequence[torch.Tensor], compression: Compression) -> list[list[runtime_pb2.Tensor]] | None:
    """Off the codec's grid (fp16): encode the buffers, make them what decoding that gives, and return the
    encoding, which is what must be kept. None on the grid, where encoding can wait (nothing changes)."""
    if Compression(compression).on_grid:
        return None
    kind, held = compression_type(compression), []
    for tensor in buffers:
        parts = encode_update(tensor, kind)
        for values, part in zip(tensor.view(-1).split(PART), parts):
            decode_into(values, [part])
        held.append(parts)
    return held


def keep_local_update(
    averager: PseudoGradientAverager, epoch: int, compression: Compression, held: list[list[runtime_pb2.Tensor]] | None
) -> bool:
    """Keep our local round's step from ``epoch`` for replay, in a thread: ``held`` (``round_to_codec``'s), or
    the buffers, encoded. In that case returns once the thread holds the buffers' lock, so nothing can
    overwrite them before they are encoded, or has failed (logged); False (nothing kept) if it could not take
    the lock in ``LOCK_WAIT``."""
    locked, given_up = threading.Event(), threading.Event()
    averager.begin_keeping(epoch)

    def keep() -> None:
        update = held
        try:
            if update is None:
                with averager.get_tensors() as buffers:
                    if given_up.is_set():
                        return
                    locked.set()
                    kind = compression_type(compression)
                    update = [encode_update(tensor, kind) for tensor in buffers]
            averager.keep_update(epoch, update)
        except Exception:
            logger.debug("could not keep the local round's update of epoch %d", epoch, exc_info=True)
        finally:
            averager.done_keeping(epoch)
            locked.set()  # a thread that failed before taking the lock does not hold the round for LOCK_WAIT

    threading.Thread(target=keep, name=f"keep-update-{epoch}", daemon=True).start()
    if held is not None or locked.wait(LOCK_WAIT):
        return True
    given_up.set()
    logger.debug("the local round's update of epoch %d was not kept: the buffers stayed locked", epoch)
    return False
