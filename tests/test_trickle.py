"""A donor that trickles is given up after a window below the rate floor, not after the download's whole bound
(``swarm.averager.trickle``): the rule on a clock, then a real donor averager serving a state file slowly."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from swarm import NetworkConfig, start_dht
from swarm.averager import transfer
from swarm.averager.process import PseudoGradientAverager
from swarm.averager.trickle import RateFloor, TooSlow
from swarm.manifest import AveragingSpec

MB = 1_000_000


def test_a_whole_window_below_the_floor_is_too_slow_and_a_file_within_the_window_is_never_judged():
    RateFloor(min_rate=1 * MB, started=0.0, window=60.0).note(1 * MB, 59.0)  # done within the window: not judged
    floor = RateFloor(min_rate=1 * MB, started=0.0, window=60.0)
    for t in range(1, 120):
        floor.note(t * 2 * MB, float(t))  # 2 MB/s: above the floor
    with pytest.raises(TooSlow):  # fast, then a trickle: judged by the last window only
        for t in range(120, 200, 10):
            floor.note(238 * MB + (t - 119) * 1000, float(t))


def test_a_donor_slow_for_less_than_a_window_is_not_given_up_on():
    floor = RateFloor(min_rate=1 * MB, started=0.0, window=60.0)
    received = 0
    for t in range(1, 300):
        received += 0 if 100 <= t < 130 else 2 * MB  # a 30 s stall, then back to speed
        floor.note(received, float(t))


def test_the_floor_is_a_quarter_of_the_slowest_link_and_off_when_zero():
    assert AveragingSpec().min_rate == pytest.approx(1.0 * 125_000)
    floor = RateFloor(min_rate=0.0, started=0.0, window=1.0)
    floor.note(0, 1e6)  # a caller that asks for no floor gets none


async def _trickle(self, path, epoch):
    """A donor that sends a kilobyte a fifth of a second (5 KB/s), each chunk well inside any chunk timeout."""
    size = path.stat().st_size
    metadata = self.serializer.dumps(dict(epoch=epoch, nbytes=size))
    with open(path, "rb") as handle:
        while chunk := handle.read(1024):
            yield transfer.averaging_pb2.DownloadData(
                tensor_part=transfer.runtime_pb2.Tensor(buffer=chunk), metadata=metadata
            )
            metadata = b""
            await asyncio.sleep(0.2)


def test_a_real_donor_that_trickles_is_given_up_after_the_window_and_an_honest_one_is_not(tmp_path, monkeypatch):
    served = tmp_path / "state.bin"
    served.write_bytes(bytes(range(256)) * 1024)  # 256 KB: about 50 s at the trickle
    first = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0))
    maddrs = [str(a) for a in first.get_visible_maddrs()]
    config = NetworkConfig(host_ip="127.0.0.1", host_port=0, initial_peers=maddrs)
    dhts = [first, *(start_dht(config) for _ in range(2))]
    averagers = []
    try:
        kwargs = dict(run_id="0" * 16, prefix="trickle", start=True)
        honest = PseudoGradientAverager([torch.zeros(4)], dhts[0], **kwargs)
        averagers.append(honest)
        monkeypatch.setattr(transfer.FileTransfer, "_stream_file", _trickle)  # the next averager forks with it
        trickler = PseudoGradientAverager([torch.zeros(4)], dhts[1], **kwargs)
        averagers.append(trickler)
        monkeypatch.undo()
        receiver = PseudoGradientAverager([torch.zeros(4)], dhts[2], **kwargs)
        averagers.append(receiver)
        for donor in (honest, trickler):
            donor.serve_state_file(served, 3)
            donor.note_epoch(3)
        limits = dict(max_bytes=1 << 20, chunk_timeout=5.0, timeout=60.0, min_rate=50_000.0, rate_window=3.0)
        got = tmp_path / "got.bin"
        receiver.download_state(str(honest.peer_id), got, **limits)
        assert got.read_bytes() == served.read_bytes()
        started = time.monotonic()
        with pytest.raises(TooSlow, match="below the floor"):
            receiver.download_state(str(trickler.peer_id), tmp_path / "slow.bin", **limits)
        assert time.monotonic() - started < 30  # a window and a chunk, not the download's 60 s bound
        assert not (tmp_path / "slow.bin").exists()
        without = dict(limits, min_rate=0.0, timeout=4.0)  # the same trickle without a floor: only the bound ends it
        with pytest.raises(TimeoutError):
            receiver.download_state(str(trickler.peer_id), tmp_path / "slow.bin", **without)
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
