"""Extra keys that only inflate the swarm's size, live: two real `swarm-client` peers and three extra keys (each its
own process, DHT node and libp2p identity: ``benchmarks.liar_records``' ghosts in their ``inflate`` mode) whose
records vote nothing and say "training" at the first peer's epoch. They count in the estimate of the swarm's size,
so with groups of two the first stage matchmakes in two to four keys (``matchmaking_bucket``), and they look like
epoch-mates on their way to the round (``mates_coming``), so a peer that found no group retries. The two peers'
identities are picked so that their keys differ at every split: before a retry used a coarser key they never met,
retry after retry, until ``averaging.wait_for_peers``; now the second attempt or the third finds the other."""

from __future__ import annotations

import re
from pathlib import Path

from client_helpers import FAST, LOCAL, Ghosts, spawn, wait_for_line
from hivemind.p2p import P2P, PeerID

from client.health import STATUS_FILE
from swarm.averager.process import matchmaking_bucket

JOIN = re.compile(r"swarm-client join --initial-peers (\S+) --run ([0-9a-f]{16})")
EPOCHS = 3
GHOSTS = 3
TOGETHER = "averaged with 2 peers"


def identities_apart(folder: Path) -> tuple[Path, Path]:
    """Two identity files whose peers fall in different matchmaking keys at every split (their first bit differs)."""
    paths, bits = [], set()
    for i in range(64):
        path = folder / f"identity-{i}.key"
        P2P.generate_identity(str(path))
        bit = matchmaking_bucket(PeerID.from_identity(path.read_bytes()).to_base58(), peers=1e4, group_size=1)[0]
        if bit not in bits:
            bits.add(bit)
            paths.append(path)
        if len(paths) == 2:
            return paths[0], paths[1]
    raise AssertionError("64 identities all fell in one half")


def test_keys_that_only_count_do_not_keep_two_peers_apart(tmp_path):
    a_key, b_key = identities_apart(tmp_path)
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    sets = ["averaging.target_group_size=2", "averaging.wait_for_peers=60", "averaging.merge_timeout=8"]
    a_args = [*(a for s in sets for a in ("--set", s)), "--identity", str(a_key), "--workdir", str(tmp_path / "a")]
    a = spawn("start", "--preset", "tiny", *FAST, *LOCAL, *a_args, "--max-epochs", str(EPOCHS + 1), log=a_log)
    maddr, run_id = JOIN.search(wait_for_line(a_log, "swarm-client join", a)).groups()
    ghosts = Ghosts(GHOSTS, run_id, maddr, tmp_path / "a" / STATUS_FILE, tmp_path, ahead="inflate")
    try:
        b_args = ["--initial-peers", maddr, "--identity", str(b_key), "--workdir", str(tmp_path / "b")]
        b = spawn("join", *b_args, *LOCAL, "--max-epochs", str(EPOCHS), log=b_log)
        assert b.wait(timeout=400) == 0, b_log.read_text()[-3000:]
        assert a.wait(timeout=200) == 0, a_log.read_text()[-3000:]
        assert all(g.poll() is None for g in ghosts.processes)  # the extra keys were there all along
    finally:
        ghosts.close()
    a_text, b_text = a_log.read_text(), b_log.read_text()
    assert "Traceback" not in a_text + b_text
    # every round of the joiner was averaged with the first peer (one at most may have come too late)
    rounds = [line for line in b_text.splitlines() if "round -> epoch" in line]
    assert len(rounds) >= EPOCHS, b_text[-3000:]
    assert sum(TOGETHER in line for line in rounds) >= EPOCHS - 1, b_text[-3000:]
