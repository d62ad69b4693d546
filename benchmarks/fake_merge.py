"""``fakemerge``: a made-up swarm's average, registered where a round's second stage reads it (``swarm.round.merge``).

The liar trains and averages honestly in its group. As soon as its group's first stage is done (or it joins the
second stage as a group of one), it makes a poisoned update, its group's average (the averaging buffers) times
``factor`` (default -4), encoded as a group of one would receive it; keeps it as its update of that epoch
(``update-EPOCH.bin``, what ``download_update`` fetches from it: ``FileTransfer.keep_update``, as a local round's
update is kept); and registers, with its own key, a group record of that epoch whose ``merged`` digest is that
file's and whose ``included`` groups claim a weight of 2**40:

- not its group's delegate: the record of a made-up group of one (its own tag), ``included`` = that tag;
- its group's delegate (or alone): its key's record is its group's, so that record says its group and a made-up
  second one (a tag nobody registers) made the swarm's average, the poisoned one; it steps with it too, as its
  groupmates will. (Measured first, at 26492dd: "its group alone", which members now refuse, ``vouched.lone_lie``.)

A delegate takes the heaviest registered swarm's average (``groups.result_of``) as soon as its own group is
registered, fetched from its holders and checked only against the digest. Nothing here is part of the product.
"""

from __future__ import annotations

import os
import time

WEIGHT = 2.0**40  # samples the made-up swarm's average claims


def _say(text: str) -> None:  # the peer's log (its stderr), as the other attacks print what they did
    os.write(2, f"{text}\n".encode())


def install(factor: float) -> None:
    from swarm.round.merge import Merger

    after_group, alone = Merger.after_group, Merger.alone

    def lying_after_group(self, epoch, outcome, samples):
        state = after_group(self, epoch, outcome, samples)
        _lie(self, state, factor)
        return state

    def lying_alone(self, epoch, samples):
        state = alone(self, epoch, samples)
        _lie(self, state, factor)
        return state

    Merger.after_group, Merger.alone = lying_after_group, lying_alone
    _say(f"fakemerge: every epoch, registers a swarm's average of weight 2**40: our group's average x {factor}")


def _lie(merger, state, factor: float) -> None:
    from swarm.averager.held import decode_into, held_digest
    from swarm.dht import groups
    from swarm.round.local_update import compression_type, encode_update

    ctx, started = merger.ctx, time.monotonic()
    try:
        kind = compression_type(ctx.manifest.averaging.compression)
        with ctx.averager.get_tensors() as buffers:
            poisoned = [encode_update(b * factor, kind) for b in buffers]
        ctx.averager.keep_update(state.epoch, poisoned)  # update-EPOCH.bin: what rpc_download_update serves
        digest = held_digest(poisoned)
        if state.delegate == ctx.me:  # our record is our group's: "our group alone made the swarm's average"
            with ctx.averager.get_tensors() as buffers:  # we step with it too, as our groupmates will: no re-sync
                for tensor, parts in zip(buffers, poisoned):
                    decode_into(tensor, parts)
            state.weight, state.decided = WEIGHT, True  # (decided: never the honest "alone" path after this)
            made_up = groups.group_tag(f"fakemerge/{ctx.me}/{state.epoch}".encode())
            merger._register(state, merged=digest, included=[state.tag, made_up], peers=state.size + 1)
            stored, what = state.unregistered is None, f"our group {state.tag}'s record (we are its delegate)"
        else:
            tag = groups.group_tag(f"fakemerge/{ctx.me}/{state.epoch}".encode())
            record = groups.group_record(state.epoch, tag, ctx.me, 1, WEIGHT, digest, False,
                                         merged=digest, included=[tag], peers=1)  # fmt: skip
            stored = groups.register(ctx.reader.dht, ctx.manifest.run_id, record)
            what = f"a made-up group {tag}'s record (group {state.tag}'s delegate is {state.delegate[-8:]})"
        _say(f"fakemerge: epoch {state.epoch}: registered {what}, merged {digest[:8]} (our group's average x "
             f"{factor}, weight 2**40), {time.monotonic() - started:.2f} s after our first stage"
             f"{'' if stored else '; the DHT did not take it'}")  # fmt: skip
    except Exception as e:
        _say(f"fakemerge: epoch {state.epoch}: no lie ({e!r})")
