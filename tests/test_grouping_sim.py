"""benchmarks.grouping: the comparison of ways to combine averaging groups runs end to end, and its pieces say
what the design says (merge counts every worker's work; today's consensus does not once several groups form;
a merge's worst peer receives a number of pseudo-gradients that grows with log_G N, a gather's with N)."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.grouping import merge_levels, partition, peer_units

REPO = Path(__file__).resolve().parent.parent


def test_partition_is_matchmaking_like():
    rng = random.Random(0)
    for _ in range(200):
        groups = partition(8, 3, rng)
        assert sorted(w for g in groups for w in g) == list(range(8))  # every worker in exactly one group
        assert all(1 <= len(g) <= 3 for g in groups)


def test_bytes_per_peer():
    for target in (16, 64):
        for n in (10, 100, 1000, 10_000, 100_000):
            merge, gather = peer_units("merge", n, target), peer_units("gather", n, target)
            levels = merge_levels(n, target)
            assert levels <= math.ceil(math.log(n, target) - 1e-9)
            # each level costs the top delegate one all-reduce (< 2 |A|); everyone else one download more (1 |A|)
            assert max(merge) <= 2 * levels and statistics.fmean(merge) < 3.1
            assert max(gather) == n - 1
            consensus, mixing = peer_units("consensus", n, target), peer_units("mixing", n, target)
            assert max(mixing) < 2 and max(consensus) < 3
    # one group (N <= G): merge is one all-reduce, like today
    assert peer_units("merge", 10, 16) == peer_units("mixing", 10, 16)
    # from 10 to 100,000 peers the worst merge peer goes up by the levels only; a gatherer's by 10,000 times
    assert max(peer_units("merge", 100_000, 16)) / max(peer_units("merge", 10, 16)) < 5


@pytest.mark.timeout(180)
def test_grouping_smoke(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.grouping", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    record = json.loads((tmp_path / "grouping.json").read_text())
    assert record["benchmark"] == "grouping" and record["smoke"] is True
    assert "--smoke" in record["command"]
    runs = record["runs"]
    assert {r["method"] for r in runs} == {"consensus", "merge", "mixing", "gather"}
    assert len({r["seed"] for r in runs}) == 2
    for r in runs:
        assert all(isinstance(v, float) and math.isfinite(v) for v in r["eval_loss"]), r["method"]
        assert r["eval_loss"][-1] < r["eval_loss"][0], f"{r['method']} did not learn"
        assert r["tokens"][-1] == record["sizes"]["tokens_per_run"]
        assert 0.3 < r["bytes_per_param"] < 0.5  # fp4 on the wire
        # smoke: 4 workers in groups of at most 2, so every round has at least two groups
        assert all(len(sizes) >= 2 and sum(sizes) == 4 for sizes in r["group_sizes"])
        if r["method"] in ("merge", "gather", "mixing"):
            assert r["share_counted"] == 1.0
        else:  # consensus: only the winning group's work reaches the adopted state (at most 2 of 4 workers)
            assert r["share_counted"] <= 0.5
        if r["method"] == "mixing":  # diverged models, measured every round, and coming together without training
            assert len(r["spread_max"]) == record["sizes"]["rounds"]
            assert all(0 < m and mean <= m for m, mean in zip(r["spread_max"], r["spread_mean"]))
            assert r["gossip_spread"] and r["gossip_spread"][-1] < r["spread_max"][-1]
        else:
            assert r["spread_max"] == []
    summary = record["summary"]
    assert summary["merge"]["loss_ratio_to_merge"]["median"] == 1.0
    for method in ("consensus", "mixing", "gather"):
        assert math.isfinite(summary[method]["loss_ratio_to_merge"]["median"])
    rows = record["bytes_per_peer"]["rows"]
    merge = {(r["peers"], r["target_group_size"]): r["worst_units"] for r in rows if r["method"] == "merge"}
    assert merge[(1000, 16)] < 3 * merge[(10, 16)]  # logarithmic, not linear
    assert (tmp_path / "grouping.png").exists()
