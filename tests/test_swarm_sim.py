"""benchmarks.swarm_sim: the client's own rules (views, groups, delegates' decisions) driven in simulated time."""

from __future__ import annotations

from test_benchmarks import load_result, run_smoke

from benchmarks.swarm_sim import Setup, manifest_of, simulate
from swarm.dht.records import BUCKET_SIZE


def test_a_small_swarm_without_churn_counts_every_round_and_ends_on_one_model():
    """Eight peers of a 4x spread of speeds, links of 10 to 1000 Mbit/s, one group's worth (tiny: G = 64): every
    peer's work of every round is in the swarm's average, and they all hold one model."""
    manifest, params = manifest_of("tiny", [])
    row = simulate(
        Setup(
            peers=8, hours=0.1, manifest=manifest, params=params, step_seconds=0.25, arrival_seconds=5.0,
            churn_per_hour=0.0, seed=1,
        )
    )  # fmt: skip
    assert row["live_at_end"] == 8 and row["peer_rounds"] >= 8 * 30, row
    assert row["contribution_share"] == 1.0, row["outcomes"]
    assert row["outcomes"] == {"merged": row["peer_rounds"]}, row["outcomes"]
    assert row["distinct_checksums_at_end"] == 1, row
    assert row["peers_apart_max"] == 0 and row["joins_downloading"] == 0, row  # the launch checkpoint agrees


def test_smoke_reads_stay_bounded_as_the_swarm_grows_from_10_to_100(tmp_path):
    record = load_result(tmp_path, "swarm_sim", run_smoke("swarm_sim", tmp_path, timeout=120))
    ten, hundred = record["figures"]
    assert (ten["peers"], hundred["peers"]) == (10, 100), record["figures"]
    for row in (ten, hundred):
        assert row["peer_rounds"] > row["peers"] and row["rounds_per_hour"] > 0, row
        assert 0.9 <= row["bucket_reads_per_second"] <= 2.0, row  # one bucket a second, plus blocking reads
        assert 0 < row["records_written_per_second"] <= 3 / 2 + 1, row  # three levels every 2 s, plus state changes
    # a bucket holds about BUCKET_SIZE records whatever N is: a peer's progress records read do not grow with N
    assert hundred["progress_records_read_per_second"] <= 1.5 * ten["progress_records_read_per_second"] + BUCKET_SIZE
    assert ten["contribution_share"] >= 0.95 and ten["distinct_checksums_at_end"] == 1, ten
    (small,) = record["small"]
    assert small["peers"] == 4 and small["target_group_size"] == 3 and small["peer_rounds"] > 4, small
