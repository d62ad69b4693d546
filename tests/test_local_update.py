"""A local round's step, kept for replay: what is written decodes to the very step taken, with every codec."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from swarm.averager.codecs import apply_error_feedback
from swarm.averager.held import check_parts, decode_into
from swarm.averager.transfer import FileTransfer, read_update, update_path
from swarm.manifest import Compression
from swarm.round import local_update
from swarm.round.local_update import encode_update, keep_local_update, round_to_codec

RUN = "run-local"


def pseudo_gradient(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # one tensor over a part (PART values), one not a whole codec block, one tiny: every edge of the split
    return [
        torch.randn(local_update.PART + 12345, generator=g) * 1e-3,
        torch.randn(3, 1001, generator=g),
        torch.randn(7, generator=g),
    ]


def decoded(held, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for t in like]
    for tensor, parts in zip(out, held):
        check_parts(tensor, parts, parts[0].compression)  # admitted as a replayer admits them
        decode_into(tensor, parts)
    return out


@pytest.mark.parametrize("compression", list(Compression))
def test_what_is_kept_decodes_to_the_step_taken(compression):
    """The peer steps with the buffers after ``round_to_codec``; a replayer decodes the kept parts. They must
    be bitwise equal, or the replay's checksum differs and it downloads the whole state after all."""
    buffers = pseudo_gradient(0)
    if compression.error_feedback:  # as a round leaves them: error feedback puts them on the grid
        apply_error_feedback(buffers, [torch.zeros_like(t) for t in buffers], compression)
    raw = [t.clone() for t in buffers]
    held = round_to_codec(buffers, compression)
    if held is None:  # on the grid: encoded later, in the keeping thread, as here
        kind = local_update.compression_type(compression)
        held = [encode_update(t, kind) for t in buffers]
    assert all(torch.equal(a, b) for a, b in zip(decoded(held, buffers), buffers))
    if compression.on_grid:  # nothing to round: the step is the pseudo-gradient as it was
        assert all(torch.equal(a, b) for a, b in zip(buffers, raw))
    else:  # fp16's rounding did change some values, and only by rounding
        assert not all(torch.equal(a, b) for a, b in zip(buffers, raw))
        assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-6) for a, b in zip(buffers, raw))


class Averager(FileTransfer):
    """The two things ``keep_local_update`` uses of the averager: its buffers behind their lock, and its files."""

    def __init__(self, buffers: list[torch.Tensor], update_dir, keep: int):
        self.lock = threading.Lock()
        self.buffers = buffers
        self._init_transfer(update_dir, keep, RUN, None)

    @contextlib.contextmanager
    def get_tensors(self):
        with self.lock:
            yield self.buffers


def test_the_update_is_written_for_replay_and_the_buffers_stay_locked_until_encoded(tmp_path):
    buffers = pseudo_gradient(1)
    apply_error_feedback(buffers, [torch.zeros_like(t) for t in buffers], "fp4")
    expected = [t.clone() for t in buffers]
    averager = Averager(buffers, tmp_path, keep=2)
    assert keep_local_update(averager, 5, "fp4", None)
    with averager.get_tensors() as tensors:  # the next round's pseudo-gradient: only once the encoding is done
        for t in tensors:
            t.fill_(float("nan"))
    deadline = time.monotonic() + 30
    while averager._keeping_epoch.value == 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    held = read_update(update_path(tmp_path, 5), RUN, 5, len(expected))
    assert all(torch.equal(a, b) for a, b in zip(decoded(held, expected), expected))
    assert averager._keeping_epoch.value == -1  # a replayer asking now is answered at once


def test_old_updates_are_pruned_whoever_wrote_them(tmp_path):
    averager = Averager(pseudo_gradient(2), tmp_path, keep=2)
    for epoch in range(5):
        assert keep_local_update(averager, epoch, "none", None)
        deadline = time.monotonic() + 30
        while not update_path(tmp_path, epoch).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    time.sleep(0.2)
    assert sorted(p.name for p in tmp_path.glob("update-*.bin")) == [update_path(tmp_path, e).name for e in (3, 4)]
    assert not list(tmp_path.glob(".tmp-*"))


def test_buffers_that_stay_locked_are_not_kept_late(tmp_path, monkeypatch):
    """If the keeping thread cannot take the lock in time the round goes on without it; when the lock frees, the
    buffers may already hold the next round's values, so nothing is written then either."""
    monkeypatch.setattr(local_update, "LOCK_WAIT", 0.2)
    averager = Averager(pseudo_gradient(3), tmp_path, keep=2)
    with averager.lock:
        assert not keep_local_update(averager, 7, "fp4", None)
    time.sleep(0.5)
    assert not update_path(tmp_path, 7).exists()
    assert averager._keeping_epoch.value == -1


def test_an_off_grid_codec_keeps_the_bytes_it_rounded_with_without_waiting_for_the_lock(tmp_path):
    buffers = pseudo_gradient(4)
    held = round_to_codec(buffers, "scaled-fp16")
    expected = [t.clone() for t in buffers]
    averager = Averager(buffers, tmp_path, keep=2)
    with averager.lock:  # the buffers are not read again: the bytes are already encoded
        assert keep_local_update(averager, 9, "scaled-fp16", held)
        deadline = time.monotonic() + 30
        while not update_path(tmp_path, 9).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    update = read_update(update_path(tmp_path, 9), RUN, 9, len(expected))
    assert all(torch.equal(a, b) for a, b in zip(decoded(update, expected), expected))


def test_a_keeping_thread_that_fails_does_not_hold_the_round(tmp_path):
    class Broken(Averager):
        @contextlib.contextmanager
        def get_tensors(self):
            raise RuntimeError("the averager is gone")
            yield  # pragma: no cover

    averager = Broken(pseudo_gradient(5), tmp_path, keep=2)
    started = time.monotonic()
    keep_local_update(averager, 3, "fp4", None)
    assert time.monotonic() - started < local_update.LOCK_WAIT / 2  # not the whole wait for a lock never taken
    assert not update_path(tmp_path, 3).exists() and averager._keeping_epoch.value == -1
