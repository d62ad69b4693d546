"""Lies that are not in a pseudo-gradient: in the state a peer serves and in the records its keys publish.

Used by ``benchmarks.attacker`` (``baddonor``, ``undying``, ``sybil``, ``outvote``, ``fresh``); nothing here is part
of the product.

- ``baddonor``: honest in every value it averages and every vote, but every state file it serves joiners is
  poisoned: its parameters multiplied by ``factor`` (default -4), under a header with the epoch it voted for and a
  checksum recomputed over the poisoned bytes, so the file passes every check of its own;
- ``undying``: honest for ``factor`` rounds (default 2), then, as it is killed, it leaves one last record that
  votes two epochs ahead of the swarm with a made-up checksum and is set to live a year, and exits at once (no
  "left" record): a record that outlives its peer;
- ``sybil``: the liar's record and those of ``factor`` extra keys (default 1: with three honest peers, two keys
  of five) vote two epochs ahead of the swarm and a made-up checksum for the epochs it is at: each extra key is a
  process of its own (a DHT node, a fresh libp2p identity, a progress record refreshed like a peer's), as a
  stranger running many cheap keys would have. The liar itself trains and averages honestly;
- ``outvote``: the same keys (``factor`` extra, default 2: with two honest peers, three keys of five) vote the
  swarm's own epoch with a made-up checksum: the majority's checksum of every epoch, which nobody serves.

- ``fresh``: the liar trains, averages and votes honestly; ``factor`` extra keys (default 1) say "training" at its
  epoch and never come, each made anew (a new DHT node and identity) every time the epoch moves: no key of theirs is
  ever held as a no-show, since each is new.

A ghost whose ``ahead`` file says ``inflate`` votes nothing: its record follows the epoch file in the state
"training", so it is counted in the swarm's size and looks like an epoch-mate on its way to the round
(``tests/test_extra_keys_live.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BAD = "f" * 64
AHEAD = 2  # epochs ahead of the swarm that the lying records vote for
YEAR = 365 * 24 * 3600.0
INFLATE = "inflate"  # in the ``ahead`` file: a ghost that votes nothing, only counts and looks like an epoch-mate
FRESH = "fresh"  # the same, with a new key every epoch


def _say(text: str) -> None:  # to the log's file descriptor: the client routes a child's stderr to its debug log
    os.write(2, f"{text}\n".encode())


def _lie_in(fields: dict, epoch: int, ahead: int = AHEAD) -> dict:
    """A record's fields voting ``ahead`` epochs past ``epoch``, with the made-up checksum for every epoch between."""
    checksums = [dict(epoch=e, checksum=BAD) for e in range(max(0, epoch - 1), epoch + ahead + 1)]
    return {**fields, "epoch": epoch + ahead, "checksums": checksums}


def install_bad_donor(factor: float) -> None:
    from swarm.averager.transfer import FileTransfer
    from swarm.state import file as state_file
    from swarm.state.outer import checksum

    stream = FileTransfer._stream_file

    async def poisoned(self, path: Path, epoch: int):
        bad = path.with_name(path.name + ".poisoned")
        try:
            header = state_file.read_header(path)
            tensors = [torch.empty(s) for s in header.shapes] + [torch.empty(s) for s in header.shapes]
            state_file.load_into(path, header, tensors)
            params, momentum = tensors[: len(header.shapes)], tensors[len(header.shapes) :]
            for p in params:
                p.mul_(factor)
            state_file.write(bad, run_id=header.run_id, epoch=header.epoch, checksum=checksum(tensors),
                             params=params, momentum=momentum, durable=False)  # fmt: skip
            _say(f"baddonor: served a poisoned state of epoch {header.epoch}")
        except Exception as e:  # the file was pruned meanwhile: serve what there is
            _say(f"baddonor: could not poison {path.name} ({e!r})")
            bad = path
        try:
            async for message in stream(self, bad, epoch):
                yield message
        finally:
            if bad != path:
                bad.unlink(missing_ok=True)

    FileTransfer._stream_file = poisoned


def _capture_presence() -> list:
    from swarm.dht.presence import Presence

    captured: list = []
    init = Presence.__init__

    def capturing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        captured.append(self)

    Presence.__init__ = capturing
    return captured


def install_undying(rounds: int) -> None:
    from swarm.round.pipeline import OuterRound

    presences = _capture_presence()
    feedback = OuterRound._apply_error_feedback
    seen = [0]

    def dying(self) -> None:
        seen[0] += 1
        if seen[0] <= rounds or not presences:
            feedback(self)
            return
        presence = presences[0]
        presence._stop.set()  # no refresh after this one, and no "left" record: killed
        with presence._lock:
            presence._fields = _lie_in(presence._fields, self.ctx.outer.epoch)
        stored = presence._publish(ttl=YEAR)
        _say(f"undying: left a record voting epoch {self.ctx.outer.epoch + AHEAD}, set to live a year ({stored})")
        os._exit(0)

    OuterRound._apply_error_feedback = dying


def install_sybil(ghosts: int, client_argv: list[str], ahead: int = AHEAD) -> None:
    """The liar's record lies once it holds the swarm's state; ``ghosts`` extra keys start then, all voting ``ahead``
    epochs past the liar's (and the made-up checksum)."""
    from swarm.dht.presence import Presence
    from swarm.dht.records import PeerState

    folder = Path(tempfile.mkdtemp(prefix="swarm-sybil-"))
    epoch_file = folder / "epoch"
    (folder / "ahead").write_text(str(ahead))
    snapshot = Presence.snapshot
    started: list[subprocess.Popen] = []

    def lying(self):
        record = snapshot(self)
        if record.state in (PeerState.starting.value, PeerState.downloading_state.value):
            return record  # its own view reads its own record: lying before it holds the state, it could not join
        epoch_file.write_text(str(record.epoch))
        if not started and ghosts:
            started.extend(_spawn_ghosts(ghosts, self.run_id, _initial_peers(client_argv), epoch_file))
        return type(record)(**_lie_in(record.dict(), record.epoch, ahead))

    Presence.snapshot = lying
    _keep_own_view_honest()
    _say(f"{_name(ahead)}: its record and {ghosts} extra key(s) vote epoch +{ahead} and a made-up checksum")


def install_fresh(ghosts: int, client_argv: list[str]) -> None:
    """The liar is honest; once it holds the swarm's state, ``ghosts`` extra keys start, each saying "training" at
    its epoch with a key made anew every epoch."""
    from swarm.dht.presence import Presence
    from swarm.dht.records import PeerState

    folder = Path(tempfile.mkdtemp(prefix="swarm-fresh-"))
    epoch_file = folder / "epoch"
    (folder / "ahead").write_text(FRESH)
    snapshot = Presence.snapshot
    started: list[subprocess.Popen] = []

    def telling(self):
        record = snapshot(self)
        if record.state not in (PeerState.starting.value, PeerState.downloading_state.value):
            epoch_file.write_text(str(record.epoch))
            if not started and ghosts:
                started.extend(_spawn_ghosts(ghosts, self.run_id, _initial_peers(client_argv), epoch_file))
        return record

    Presence.snapshot = telling
    _say(f"fresh: {ghosts} extra key(s) say they train at our epoch, each made anew every epoch")


def _keep_own_view_honest() -> None:
    """The liar's view leaves out its own (lying) record, as a stranger would patch it: reading itself ahead of the
    swarm, it would re-sync every round instead of training with the honest peers."""
    from swarm.dht.peers import SwarmReader

    build = SwarmReader._build

    def without_itself(self, entries):
        me = self.dht.peer_id.to_base58()
        return build(self, [e for e in entries if e.record.peer_id != me])

    SwarmReader._build = without_itself


def _name(ahead: int) -> str:
    return "outvote" if ahead == 0 else "sybil"


def _initial_peers(argv: list[str]) -> list[str]:
    if "--initial-peers" not in argv:
        return []
    out = []
    for arg in argv[argv.index("--initial-peers") + 1 :]:
        if arg.startswith("--"):
            break
        out.append(arg)
    return out


def _spawn_ghosts(n: int, run_id: str, maddrs: list[str], epoch_file: Path) -> list[subprocess.Popen]:
    from benchmarks.common import tied_to_us

    command = [sys.executable, "-m", "benchmarks.liar_records", run_id, str(epoch_file), *maddrs]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return [subprocess.Popen(command, env=env, **tied_to_us()) for _ in range(n)]


def ghost(run_id: str, epoch_file: Path, maddrs: list[str]) -> None:
    """One extra key: a DHT node with a fresh identity whose progress record votes ``AHEAD`` epochs past the liar's
    epoch (or what the file ``ahead`` beside ``epoch_file`` says), refreshed like a peer's, until the liar is gone."""
    from swarm.dht.config import NetworkConfig
    from swarm.dht.network import start_dht
    from swarm.dht.presence import Presence
    from swarm.dht.records import PeerState

    parent = os.getppid()
    try:
        said = epoch_file.with_name("ahead").read_text().strip()
    except OSError:
        said = str(AHEAD)
    fresh = said == FRESH
    inflate = said in (INFLATE, FRESH)
    ahead = int(said) if said.isdigit() else AHEAD

    def new_key(epoch: int):
        dht = start_dht(NetworkConfig(initial_peers=maddrs, host_ip="127.0.0.1", host_port=0))
        peer_id = dht.peer_id.to_base58()
        fields = dict(peer_id=peer_id, name=f"sybil-{peer_id[-4:]}", device="cpu", epoch=epoch, inner_step=0,
                      samples_per_second=1.0, tokens_processed=0, state=PeerState.training.value, last_loss=None,
                      client_mode=False, relayed=False, checksums=[], accusations=[])  # fmt: skip
        presence = Presence(dht, run_id, fields)
        presence.start()
        _say(f"{FRESH if fresh else _name(ahead)}: extra key {peer_id} publishing at epoch {epoch}")
        return dht, fields, presence

    def read_epoch() -> int:
        try:
            return int(epoch_file.read_text())
        except (OSError, ValueError):
            return 0

    keyed_at = read_epoch()
    dht, fields, presence = new_key(keyed_at)
    while os.getppid() == parent:
        epoch = read_epoch()
        if fresh and epoch != keyed_at:  # a new key for every epoch: the old one is never seen again
            presence.stop()
            dht.shutdown()
            keyed_at = epoch
            dht, fields, presence = new_key(epoch)
        if inflate:  # no vote: an epoch-mate still training, as far as its record says
            presence.update(epoch=epoch, publish_now=True)
        else:
            lie = _lie_in(fields, epoch, ahead)
            presence.update(epoch=lie["epoch"], checksums=lie["checksums"], publish_now=True)
        time.sleep(1.0)
    presence.stop()
    dht.shutdown()


if __name__ == "__main__":
    ghost(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
