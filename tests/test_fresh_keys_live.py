"""Keys made anew every round, live: two real `swarm-client` peers and one extra key (its own process: a
``benchmarks.liar_records`` ghost in its ``fresh`` mode) that says "training" at the first peer's epoch with a new
DHT node and identity every time that epoch moves. Each key is new, so none is ever held as a no-show
(``swarm.round.no_shows``): before, every round's delegate waited out its whole patience for it. Now a merge that
waited in vain for a key that never averaged with it waits for no stranger still training for 2, then 4, 8 ... rounds,
so at most about log2(rounds) merges of each peer wait for one."""

from __future__ import annotations

import re
import signal

from client_helpers import FAST, LOCAL, Ghosts, spawn, wait_for_line

from client.health import STATUS_FILE

JOIN = re.compile(r"swarm-client join --initial-peers (\S+) --run ([0-9a-f]{16})")
EPOCHS = 10
GAVE_UP = re.compile(r"epoch (\d+): \d+ key\(s\) never came to the merge")
HELD = "that never averaged with us: until our epoch"


def test_a_key_made_anew_every_round_holds_few_merges(tmp_path):
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    sets = ["averaging.merge_timeout=8"]  # a delegate waits 4 s for epoch-mates on their way
    a_args = [*(a for s in sets for a in ("--set", s)), "--workdir", str(tmp_path / "a")]
    a = spawn("start", "--preset", "tiny", *FAST, *LOCAL, *a_args, "--max-epochs", str(EPOCHS + 1), log=a_log)
    maddr, run_id = JOIN.search(wait_for_line(a_log, "swarm-client join", a)).groups()
    ghost = Ghosts(1, run_id, maddr, tmp_path / "a" / STATUS_FILE, tmp_path, ahead="fresh")
    try:
        b = spawn("join", "--initial-peers", maddr, "--workdir", str(tmp_path / "b"), *LOCAL,
                  "--max-epochs", str(EPOCHS), log=b_log)  # fmt: skip
        assert b.wait(timeout=400) == 0, b_log.read_text()[-3000:]
        a.send_signal(signal.SIGTERM)  # its last round would wait out matchmaking alone
        assert a.wait(timeout=60) == 0, a_log.read_text()[-3000:]
        assert all(g.poll() is None for g in ghost.processes)  # the extra key was there all along
    finally:
        ghost.close()
    assert "Traceback" not in a_log.read_text() + b_log.read_text()
    rounds = [line for line in b_log.read_text().splitlines() if "round -> epoch" in line]
    assert len(rounds) >= EPOCHS and sum("averaged with 2 peers" in line for line in rounds) >= EPOCHS - 1
    texts = [(tmp_path / peer / "logs" / "swarm-client.log").read_text() for peer in ("a", "b")]  # info and debug
    gave_up = [int(m.group(1)) for text in texts for m in GAVE_UP.finditer(text)]
    assert gave_up, texts  # the extra key was waited for at first: a merge gave up on it
    # each peer waits in vain once, then after 2 rounds, then after 4 more: at most 3 merges of each in 10 (before,
    # every round's delegate did); and never while its hold lasts
    assert len(gave_up) <= 6, gave_up
    for text in texts:
        epochs = [int(m.group(1)) for m in GAVE_UP.finditer(text)]
        assert all(later - earlier >= 2 << i for i, (earlier, later) in enumerate(zip(epochs, epochs[1:]))), epochs
        assert HELD in text or not epochs  # and said that it held them all
