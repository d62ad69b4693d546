"""The vote benchmark (``benchmarks/sybil_votes.py``) end to end, and what it holds the rules to."""

from __future__ import annotations

import json

from benchmarks.sybil_votes import honest_swarm, least_keys, main, moved


def test_a_minority_of_keys_cannot_move_the_global_epoch_nor_a_joiners_state(tmp_path):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sybil_votes.json").read_text())["results"]
    by = {(r["swarm"], r["attack"], r["rule"]): r for r in rows}
    assert {r["honest"] for r in rows} == {10} and len(rows) == 12
    assert by[("agrees", "epoch", "median")]["fraction"] == by[("split", "epoch", "median")]["fraction"] == 0.5
    # while honest peers agree, their checksum and their state take half of all keys to outvote
    assert by[("agrees", "checksum", "plurality")]["keys"] == by[("agrees", "donor", "trusted")]["keys"] == 10
    # split four ways, the plurality is cheaper: more keys than the largest honest faction; a joiner's state still
    # takes half, and so does a running peer's unless one of the attacker's keys averaged with it lately
    assert by[("split", "checksum", "plurality")]["keys"] == by[("split", "donor", "plurality")]["keys"] == 3
    assert by[("split", "donor", "trusted")]["keys"] == by[("split", "checksum", "vouched")]["keys"] == 10
    assert by[("split", "checksum", "vouched, one met")]["keys"] == 3
    assert by[("agrees", "checksum", "vouched")]["keys"] == by[("agrees", "checksum", "vouched, one met")]["keys"] == 10


def test_the_least_keys_are_least():
    honest = honest_swarm(12, split=3, straddle=True)
    cases = (
        ("epoch", "median"),
        ("checksum", "plurality"),
        ("checksum", "vouched"),
        ("checksum", "vouched, one met"),
        ("donor", "plurality"),
        ("donor", "trusted"),
    )
    for attack, rule in cases:
        k = least_keys(attack, rule, honest)
        assert k > 0
        assert moved(attack, rule, honest, k) and not moved(attack, rule, honest, k - 1)
