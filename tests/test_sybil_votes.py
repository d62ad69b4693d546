"""The vote benchmark (``benchmarks/sybil_votes.py``) end to end, and what it holds the rules to."""

from __future__ import annotations

import json

from benchmarks.sybil_votes import honest_swarm, least_keys, main, moved


def test_a_minority_of_keys_cannot_move_the_global_epoch_even_while_honest_peers_straddle_two(tmp_path):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sybil_votes.json").read_text())["results"]
    by = {(r["swarm"], r["attack"]): r for r in rows}
    assert {r["honest"] for r in rows} == {10} and len(rows) == 6
    assert by[("agrees", "epoch")]["fraction"] == by[("split", "epoch")]["fraction"] == 0.5
    # while honest peers agree, their checksum and their state take half of all keys to outvote
    assert by[("agrees", "checksum")]["keys"] == by[("agrees", "donor")]["keys"] == 10
    # split four ways, the plurality is cheaper: more keys than the largest honest faction (the open row)
    assert by[("split", "checksum")]["keys"] == 3


def test_the_least_keys_are_least():
    honest = honest_swarm(12, split=3, straddle=True)
    for attack in ("epoch", "checksum", "donor"):
        k = least_keys(attack, honest)
        assert k > 0
        assert moved(attack, honest, k) and not moved(attack, honest, k - 1)
