"""State files and the background state store: the format, its checks, atomic writes, pruning, resuming."""

import json
import os
import threading
import time

import pytest
import torch
from safetensors import safe_open

from client import checkpoint
from swarm.manifest import OuterOptimizerSpec
from swarm.state import file as state_file
from swarm.state.file import StateFileError
from swarm.state.outer import OuterState
from swarm.state.store import SavedState, StateStore, find_latest, state_files

SHAPES = [(5, 3), (7,)]


def make_outer(seed: int = 0, epoch: int = 0) -> OuterState:
    torch.manual_seed(seed)
    outer = OuterState([torch.randn(*s) for s in SHAPES], OuterOptimizerSpec(), epoch=epoch)
    for m in outer.momentum:
        m.normal_()
    return outer


def write(path, outer: OuterState, run_id: str = "r") -> int:
    return state_file.write(
        path, run_id=run_id, epoch=outer.epoch, checksum=outer.checksum(), params=outer.params, momentum=outer.momentum
    )


def test_a_state_file_is_safetensors_and_loads_back_bit_for_bit(tmp_path):
    outer = make_outer(epoch=7)
    path = tmp_path / "s.safetensors"
    size = write(path, outer)
    assert size == path.stat().st_size
    with safe_open(str(path), framework="pt") as f:  # any safetensors tool can read it
        assert torch.equal(f.get_tensor("param.00000"), outer.params[0])
        assert torch.equal(f.get_tensor("momentum.00001"), outer.momentum[1])
        assert f.metadata()["epoch"] == "7" and f.metadata()["checksum"] == outer.checksum()
    header = state_file.check(path, run_id="r", shapes=SHAPES)
    other = make_outer(seed=1)
    other.load_file(path, header)
    assert other.epoch == 7 and other.checksum() == outer.checksum()
    assert all(torch.equal(a, b) for a, b in zip(other.tensors(), outer.tensors()))


@pytest.mark.parametrize("where", ["params", "momentum", "header"])
def test_one_flipped_byte_anywhere_is_refused(tmp_path, where):
    outer = make_outer()
    path = tmp_path / "s.safetensors"
    write(path, outer)
    header = state_file.read_header(path)
    data = bytearray(path.read_bytes())
    offset = {"params": header.data_start + 5, "momentum": header.total_bytes - 3, "header": 20}[where]
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(StateFileError):
        state_file.check(path, run_id="r", shapes=SHAPES)


def test_wrong_run_wrong_shapes_truncated_and_garbage_are_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    write(path, make_outer())
    with pytest.raises(StateFileError, match="belongs to run"):
        state_file.check(path, run_id="other")
    with pytest.raises(StateFileError, match="shapes"):
        state_file.check(path, run_id="r", shapes=[(5, 3), (8,)])
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(StateFileError, match="truncated"):
        state_file.check(path, run_id="r")
    for junk in (b"", b"\x00" * 100, b"\xff" * 8 + b"{}", (10).to_bytes(8, "little") + b"not json!!"):
        path.write_bytes(junk)
        with pytest.raises(StateFileError):
            state_file.check(path, run_id="r")


def test_store_writes_in_the_background_keeps_two_and_resumes_the_newest(tmp_path):
    saved = []
    store = StateStore(tmp_path, "r", on_saved=saved.append)
    outer = make_outer()
    for epoch in range(4):
        outer.step([torch.ones(*s) for s in SHAPES])
        store.save_async(outer, dict(data=dict(order_index=epoch, sequences=3)))
        assert store.wait_idle(30)
    assert [s.epoch for s in saved] == [1, 2, 3, 4] and all(s.bytes > 0 for s in saved)
    assert [p.name for p in state_files(tmp_path)] == ["state-000003.safetensors", "state-000002.safetensors"]
    assert not list(tmp_path.glob(".tmp-*"))
    found = find_latest(tmp_path, "r", SHAPES)
    assert found.header.epoch == 4 and found.header.checksum == outer.checksum()
    assert found.extra == dict(data=dict(order_index=3, sequences=3))
    assert store.close()


def test_a_change_waits_for_the_write_in_progress_and_never_tears_it(tmp_path):
    """The writer holds the state's lock: an outer step during a write lands after it, in the next file."""
    store = StateStore(tmp_path, "r")
    outer = make_outer()
    writing = threading.Event()
    real_write = state_file.write

    def slow_write(*args, **kwargs):
        writing.set()
        time.sleep(0.5)
        return real_write(*args, **kwargs)

    state_file.write = slow_write
    try:
        before = outer.checksum()
        store.save_async(outer)
        assert writing.wait(10)
        outer.step([torch.ones(*s) for s in SHAPES])  # blocks until the write is done
        assert store.wait_idle(30)
    finally:
        state_file.write = real_write
    header = state_file.check(state_files(tmp_path)[0], run_id="r", shapes=SHAPES)
    assert header.epoch == 0 and header.checksum == before != outer.checksum()


def test_the_lock_is_free_while_the_disk_takes_the_bytes_and_the_file_is_the_state_it_copied(tmp_path):
    """The fsync runs after the writer let go of the lock: an overlapped round's begin (which needs the lock) and
    an outer step need not wait for the disk; the file still holds the state as copied, and appears only once
    durable."""
    store = StateStore(tmp_path, "r")
    outer = make_outer()
    syncing, release = threading.Event(), threading.Event()
    real_durable = state_file.make_durable
    in_place_while_syncing = []

    def slow_durable(path):
        in_place_while_syncing.append(bool(state_files(tmp_path)))
        syncing.set()
        assert release.wait(10)
        real_durable(path)

    state_file.make_durable = slow_durable
    try:
        before = outer.checksum()
        store.save_async(outer)
        assert syncing.wait(10)
        assert outer.lock.acquire(timeout=2.0)  # free while the disk is busy
        outer.lock.release()
        outer.step([torch.ones(*s) for s in SHAPES])  # a change now does not tear the file being synced
        release.set()
        assert store.wait_idle(30)
    finally:
        state_file.make_durable = real_durable
    assert in_place_while_syncing == [False]  # renamed into place only after its fsync
    header = state_file.check(state_files(tmp_path)[0], run_id="r", shapes=SHAPES)
    assert header.epoch == 0 and header.checksum == before != outer.checksum()
    copy = make_outer(seed=1)
    copy.load_file(state_files(tmp_path)[0], header)
    assert copy.checksum() == before


def test_a_damaged_newest_file_falls_back_to_the_one_before_with_a_message(tmp_path):
    store = StateStore(tmp_path, "r")
    outer = make_outer()
    for _ in range(2):
        outer.step([torch.ones(*s) for s in SHAPES])
        store.save_async(outer)
        assert store.wait_idle(30)
    newest = state_files(tmp_path)[0]
    newest.write_bytes(b"\x00" * 100)  # a disk that lost it
    messages = []
    found = checkpoint.find(tmp_path, "r", SHAPES, warn=messages.append)
    assert found is not None and found.header.epoch == 1
    assert len(messages) == 1 and newest.name in messages[0] and "older checkpoint" in messages[0]


def test_a_failed_write_keeps_the_previous_file_and_reports(tmp_path):
    failures = []
    store = StateStore(tmp_path, "r", on_failed=failures.append)
    outer = make_outer()
    store.save_async(outer)
    assert store.wait_idle(30)
    real_write = state_file.write
    state_file.write = lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    try:
        outer.step([torch.ones(*s) for s in SHAPES])
        store.save_async(outer)
        assert store.wait_idle(30)
    finally:
        state_file.write = real_write
    assert failures and "No space left" in failures[0]
    assert [p.name for p in state_files(tmp_path)] == ["state-000000.safetensors"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_an_adopted_download_becomes_the_newest_even_if_an_older_write_finishes_later(tmp_path):
    saved = []
    store = StateStore(tmp_path, "r", on_saved=saved.append)
    with store._cond:
        older = store._claim_name()  # the writer thread claimed its name, then the download was adopted
    downloaded = tmp_path / "incoming.safetensors"
    write(downloaded, make_outer(seed=3, epoch=9))
    header = state_file.check(downloaded, run_id="r", shapes=SHAPES)
    adopted = store.adopt(downloaded, header, dict(data=dict(order_index=1, sequences=2)))
    assert adopted.epoch == 9 and store.latest == adopted and not downloaded.exists()
    write(older, make_outer(epoch=4))  # ... and only now does that older write finish
    store._finish(SavedState(older, 4, "x", 1, 0.1))
    assert store.latest == adopted and saved == [adopted]
    assert find_latest(tmp_path, "r", SHAPES).header.epoch == 9
    assert json.loads(adopted.path.with_suffix(".json").read_text())["data"]["order_index"] == 1


def test_inner_state_is_used_only_with_the_outer_state_it_was_saved_with(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    checkpoint.save_inner(tmp_path, "abc", optimizer.state_dict(), {}, dict(order_index=2, sequences=5))
    inner = checkpoint.load_inner(tmp_path, "abc")
    assert inner is not None and inner.data == dict(order_index=2, sequences=5)
    assert torch.equal(inner.optimizer["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert checkpoint.load_inner(tmp_path, "another state") is None
    (tmp_path / checkpoint.INNER_FILE).write_bytes(b"junk")
    messages = []
    assert checkpoint.load_inner(tmp_path, "abc", warn=messages.append) is None and "unreadable" in messages[0]


def test_inner_state_is_saved_only_when_the_disk_can_write_it_in_time_and_a_failure_is_one_line(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = checkpoint.InnerState(optimizer.state_dict(), {}, dict(order_index=1, sequences=2))
    # after a stop signal, a write expected to take more than half the time left is not started
    line = checkpoint.save_inner_in_time(tmp_path, "abc", state, seconds_expected=6.0, seconds_left=10.0)
    assert line is not None and "~6 s to write, 10 s left" in line and "afresh" in line
    assert not (tmp_path / checkpoint.INNER_FILE).exists()
    assert checkpoint.save_inner_in_time(tmp_path, "abc", state, seconds_expected=4.0, seconds_left=10.0) is None
    assert checkpoint.load_inner(tmp_path, "abc").data == state.data
    # unhurried (no stop signal), however slow the disk
    (tmp_path / checkpoint.INNER_FILE).unlink()
    assert checkpoint.save_inner_in_time(tmp_path, "abc", state, seconds_expected=1e6, seconds_left=None) is None
    assert (tmp_path / checkpoint.INNER_FILE).exists()
    # a directory that cannot be written (here: a file in its place): one line, no traceback, no temp file left
    blocked = tmp_path / "not-a-directory"
    blocked.write_bytes(b"")
    line = checkpoint.save_inner_in_time(blocked, "abc", state, seconds_expected=0.1, seconds_left=None)
    assert line is not None and "\n" not in line
    assert line.startswith("Inner optimizer state not saved (NotADirectoryError")
    assert {p.name for p in tmp_path.iterdir()} == {checkpoint.INNER_FILE, "not-a-directory"}


def test_a_rounds_update_file_gives_back_the_parts_as_they_came_off_the_wire(tmp_path):
    from hivemind.compression import serialize_torch_tensor

    from swarm.averager.codecs import CODECS
    from swarm.averager.fp4 import fp4_quantize
    from swarm.averager.held import Dropped, check_parts, decode_into
    from swarm.averager.transfer import read_update, update_path, write_update

    values = [fp4_quantize(torch.randn(3000)), fp4_quantize(torch.randn(1000))]
    codec = CODECS["fp4"]
    held = [
        [serialize_torch_tensor(values[0][:2000], codec.compression_type), Dropped(1000)],
        [serialize_torch_tensor(values[1], codec.compression_type)],
    ]
    path = update_path(tmp_path, 12)
    write_update(path, "r", 12, held)
    back = read_update(path, "r", 12, num_tensors=2)
    out = [torch.full((3000,), 7.0), torch.zeros(1000)]
    for tensor, parts in zip(out, back):
        check_parts(tensor, parts, codec.compression_type)
        decode_into(tensor, parts)
    assert torch.equal(out[0][:2000], values[0][:2000]) and torch.equal(out[0][2000:], torch.zeros(1000))
    assert torch.equal(out[1], values[1])
    for wrong in (dict(run_id="other", epoch=12, num_tensors=2), dict(run_id="r", epoch=13, num_tensors=2)):
        with pytest.raises(ValueError):
            read_update(path, wrong["run_id"], wrong["epoch"], wrong["num_tensors"])
    with pytest.raises(ValueError):
        read_update(path, "r", 12, num_tensors=3)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError):
        read_update(path, "r", 12, num_tensors=2)


def test_the_error_feedback_residual_is_saved_beside_its_state_and_used_only_with_it(tmp_path):
    from swarm.state.store import residual_path

    store = StateStore(tmp_path, "r")
    outer = make_outer()
    outer.keep_residual()
    for r in outer.residual:
        r.normal_()
    store.save_async(outer)
    assert store.wait_idle(30)
    path = state_files(tmp_path)[0]
    assert residual_path(path).exists()
    other = make_outer(seed=1)
    other.keep_residual()
    assert state_file.load_residual(residual_path(path), run_id="r", checksum=outer.checksum(), residual=other.residual)
    assert all(torch.equal(a, b) for a, b in zip(other.residual, outer.residual))
    assert not state_file.load_residual(residual_path(path), run_id="r", checksum="0" * 64, residual=other.residual)
    with outer.lock:  # the residual changes (a new round began) before the writer gets to the state
        store.save_async(outer)
        outer.residual_version += 1
    assert store.wait_idle(30)
    newest = state_files(tmp_path)[0]
    assert newest != path and not residual_path(newest).exists()  # no residual is better than another state's


def test_a_leaving_peer_removes_its_unfinished_downloads_and_nothing_else(tmp_path):
    """The averager process may write a download's file after the trainer gave the download up and removed it:
    the leaving peer removes its own unfinished downloads and replays, not a state file being written, nor
    another process's."""
    store = StateStore(tmp_path, "run")
    pid = os.getpid()
    ours = [store.temporary_path("download-abcdefgh"), store.temporary_path("update-7-abcdefgh")]
    kept = [
        tmp_path / f".tmp-state-000003-{pid}.safetensors",
        tmp_path / f".tmp-download-abcdefgh-{pid + 1}.safetensors",
    ]
    for path in [*ours, *kept]:
        path.write_bytes(b"partial")
    store.discard_downloads()
    assert [p.exists() for p in ours] == [False, False] and [p.exists() for p in kept] == [True, True]
    store.close()
