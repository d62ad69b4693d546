import torch

from client import checkpoint


def test_round_trip_keeps_the_last_two(tmp_path):
    for epoch in range(4):
        checkpoint.save(tmp_path, epoch, 0, dict(run_id="r", epoch=epoch, weights=torch.full((3,), float(epoch))))
    files = sorted(p.name for p in tmp_path.glob("checkpoint-*.pt"))
    assert files == ["checkpoint-0000002-000000.pt", "checkpoint-0000003-000000.pt"]
    assert not list(tmp_path.glob(".tmp-*"))
    loaded = checkpoint.load_latest(tmp_path, "r")
    assert loaded.state["epoch"] == 3 and torch.equal(loaded.state["weights"], torch.full((3,), 3.0))


def test_corrupt_newest_falls_back_to_the_previous_one_with_a_message(tmp_path):
    for epoch in (1, 2):
        checkpoint.save(tmp_path, epoch, 0, dict(run_id="r", epoch=epoch))
    newest = sorted(tmp_path.glob("checkpoint-*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[:40])  # truncated, as by a full disk
    messages = []
    loaded = checkpoint.load_latest(tmp_path, "r", warn=messages.append)
    assert loaded.state["epoch"] == 1
    assert len(messages) == 1 and newest.name in messages[0] and "skipped" in messages[0]


def test_all_corrupt_or_foreign_gives_none(tmp_path):
    checkpoint.save(tmp_path, 1, 0, dict(run_id="other-run", epoch=1))
    (tmp_path / "checkpoint-0000009-000000.pt").write_bytes(b"garbage")
    messages = []
    assert checkpoint.load_latest(tmp_path, "r", warn=messages.append) is None
    assert len(messages) == 2
