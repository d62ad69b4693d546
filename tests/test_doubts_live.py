"""Half of the keys claim an epoch nobody serves, live: two real `swarm-client` peers and two extra keys (each its
own process with a DHT node and a fresh libp2p identity, ``benchmarks.liar_records``' ghosts) whose records vote
two epochs ahead of the first peer with a made-up checksum. The global epoch is the upper median of the keys'
epochs, so the honest peers read themselves behind. Before ``swarm.state.doubts`` the first peer threw every
round's work away on re-syncs that could not succeed, and a joiner gave up; now both train to the end."""

from __future__ import annotations

import re
from pathlib import Path

from client_helpers import FAST, LOCAL, Ghosts, spawn, wait_for_line

from client.health import STATUS_FILE

JOIN = re.compile(r"swarm-client join --initial-peers (\S+) --run ([0-9a-f]{16})")
ROUND = re.compile(r"round -> epoch (\d+): .*checksum (\w+)")
EPOCHS = 4
ROOT = Path(__file__).resolve().parents[1]


def test_keys_that_claim_an_epoch_nobody_serves_stop_no_round_and_no_joiner(tmp_path):
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a_args = ["--max-epochs", str(2 * EPOCHS), "--workdir", str(tmp_path / "a")]
    a = spawn("start", "--preset", "tiny", *FAST, *LOCAL, *a_args, log=a_log)
    maddr, run_id = JOIN.search(wait_for_line(a_log, "swarm-client join", a)).groups()
    ghosts = Ghosts(2, run_id, maddr, tmp_path / "a" / STATUS_FILE, tmp_path, ahead="2")
    try:
        # the joiner comes while the ghosts' claim is new: it must not give up, nor believe them
        b_args = ["--initial-peers", maddr, "--max-epochs", str(EPOCHS), "--workdir", str(tmp_path / "b")]
        b = spawn("join", *b_args, *LOCAL, log=b_log)
        assert b.wait(timeout=300) == 0, b_log.read_text()[-3000:]
        assert a.wait(timeout=300) == 0, a_log.read_text()[-3000:]
    finally:
        ghosts.close()
    a_text, b_text = a_log.read_text(), b_log.read_text()
    assert "Traceback" not in a_text + b_text
    # each peer tried the ghosts' claim, found nobody serving it, and stopped believing it
    assert "that none of them served" in a_text, a_text[-3000:]
    assert "that none of them served" in b_text, b_text[-3000:]
    # the joiner loaded the first peer's state (or found it held it: the seed, while the run was at its first epoch)
    # instead of giving up
    got = r"state of epoch \d+ \(checksum \w+\) loaded from|caught up to epoch|starting at epoch 0: the swarm holds"
    assert re.search(got, b_text), b_text[-3000:]
    for text, epochs in ((a_text, 2 * EPOCHS), (b_text, EPOCHS)):
        rounds = ROUND.findall(text)
        assert len(rounds) >= epochs, text[-3000:]
        # before, every round was thrown away by a re-sync that no donor served; one may still be a group's own
        # (two rounds that each found no group end on two states, and the tie goes to the lower peer id)
        assert text.count("re-synced") <= 1, text[-3000:]
    assert "averaged with 2 peers" in a_text + b_text, (a_text[-2000:], b_text[-2000:])  # with each other
