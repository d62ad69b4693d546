"""benchmarks.crowd end to end (--smoke): real peers of one run, the CPU of each kind of process they run."""

from __future__ import annotations

from test_benchmarks import left_behind, load_result, run_smoke


def test_crowd_smoke(tmp_path):
    """Two peers: every kind of process is found and used some CPU, and the trainers trained. (A short name, as
    test_scale_smoke's: torch_shm_manager's socket lives under tmp_path.)"""
    record = load_result(tmp_path, "crowd", run_smoke("crowd", tmp_path, timeout=300))
    (run,) = record["runs"]
    assert run["label"] == "current" and run["peers"] == 2 and run["peers_alive_at_end"] == 2, run
    assert all(run["cores_by_role"].get(role, 0) > 0 for role in ("trainer", "dht", "averager", "p2pd")), run
    assert 0 < run["cores"] <= record["machine"]["cpu_count_logical"] * 1.1, run
    assert run["tokens_per_second"] > 0 and run["rounds_finished"] >= 0, run
    assert record["current_over_baseline"] is None  # the smoke runs no baseline
    assert left_behind(tmp_path) == []
