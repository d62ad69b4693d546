"""Smoke run of the dashboard-cost benchmark: it must produce a well-formed record (figures are not judged)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_dashboard_benchmark_smoke(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.dashboard", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads((tmp_path / "dashboard.json").read_text())
    assert [p["phase"] for p in record["phases"]] == ["bare", "plain", "dashboard"]
    assert all(p["end"] > p["start"] and p["steps"] >= 0 for p in record["phases"])
    summary = record["summary"]
    assert sum(summary[phase]["steps"] for phase in ("bare", "plain", "dashboard")) > 0  # the loop trained
    for key in ("ratio_dashboard_to_plain", "ratio_dashboard_to_bare"):  # None only for a phase with no step
        assert summary[key] is None or summary[key] >= 0
    assert record["sizes"]["parameters"] > 1_000_000 and record["sizes"]["micro_batch"] >= 1
    assert (tmp_path / "dashboard.png").stat().st_size > 1000
    assert "dashboard / plain:" in done.stdout
