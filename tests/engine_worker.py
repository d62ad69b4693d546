"""One swarm peer in its own process, driven by the engine tests.

Writes its addresses, events, per-round reports and final global parameters to
--out, and touches a marker file on each state change so a test can kill it at
a chosen moment.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diloco_helpers import BATCH, inner_step, make_batch, make_model, make_optimizer  # noqa: E402

from swarm import NetworkConfig, Peer, RunManifest, SwarmError, seeded_init, visible_maddrs  # noqa: E402
from swarm.events import PeerEvent, RoundOutcome, RoundReport, StateChanged  # noqa: E402
from swarm.state.store import find_latest  # noqa: E402


def as_json(report) -> dict:
    reason, source = report.resync_reason, report.merge_source
    return dict(
        report.__dict__,
        outcome=report.outcome.value,
        resync_reason=reason and reason.name,
        merge_source=source and source.value,
    )


MATCHMAKING_LOGGERS = (
    *("hivemind.averaging.matchmaking", "hivemind.averaging.averager", "swarm.round"),
    *("hivemind.averaging.allreduce", "swarm.averager.allreduce"),  # a reducer or sender that stalls an all-reduce
    "swarm.hivemind_fixes.neighbours",  # a DHT node that lost its neighbours and pinged them again
)


def write_whole(path: Path, text: str) -> None:
    """``path`` appears with all of ``text`` or not at all: a test starts the next peer once this peer's addresses
    file exists and reads it at once. Written in place, it was once read empty, and that peer started with no
    initial peers, a swarm of one beside the others (test_peer_killed_during_allreduce: the view held 1 of 3 peers
    after 180 s, every round "could not find a group", two checksums at the end)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def keep_matchmaking_story(path: Path, quiet: bool) -> None:
    """hivemind's matchmaking and our round's debug lines in a file of their own (the averager's process inherits it
    by fork): a round that found no group says why only there (a leader that refused, one that did not answer), and
    the harness shows its tail when a test fails (``swarm_harness.matchmaking_tail``). ``quiet``: the worker's own
    log (hivemind's stderr handler) keeps INFO and up, as before."""
    handler = logging.FileHandler(path)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
    if quiet:
        for stderr in logging.getLogger("hivemind").handlers:
            stderr.setLevel(max(stderr.level, logging.INFO))
    for name in MATCHMAKING_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--max-epochs", type=int, required=True)
    parser.add_argument("--extra-params", type=int, default=0)
    parser.add_argument("--poison-epoch", type=int, default=-1, help="turn the weights to NaN in this epoch")
    parser.add_argument(
        "--settle-at-step", type=int, default=-1, help="overlapped: apply a round in flight after this many steps"
    )
    parser.add_argument(
        "--start-with", type=int, default=1, help="wait (at most 180 s) for this many peers in the view before training"
    )
    parser.add_argument(
        "--hold-at-epoch", type=int, default=-1, help="before this epoch's steps, wait (at most 180 s) for --hold-for"
    )
    parser.add_argument("--hold-for", type=Path, help="a file another peer writes once it has joined")
    parser.add_argument("--resume", action="store_true", help="start from the newest state file in --out/state")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds added to each inner step: a slow peer")
    args = parser.parse_args()
    if os.environ.get("SWARM_TEST_DEBUG"):  # a flaky run's story: every swarm logger at debug level
        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    keep_matchmaking_story(args.out / "matchmaking.log", quiet=not os.environ.get("SWARM_TEST_DEBUG"))
    events = (args.out / "events.jsonl").open("a", buffering=1)
    manifest = RunManifest.from_json(args.manifest.read_text())

    def listener(event: PeerEvent) -> None:
        if isinstance(event, StateChanged):
            (args.out / f"state-{event.state.value.replace(' ', '_')}-{peer.epoch}").touch()
        data = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
        payload = {k: v.value if isinstance(v, enum.Enum) else as_json(v) if isinstance(v, RoundReport)
                   else v.__dict__ if hasattr(v, "__dict__") else v for k, v in data.items()}  # fmt: skip
        events.write(json.dumps(dict(kind=event.kind, time=time.time(), **payload), default=str) + "\n")

    with seeded_init(manifest):
        model = make_model(manifest, args.extra_params)
    optimizer = make_optimizer(model, manifest)
    network = NetworkConfig(initial_peers=args.initial_peers, host_ip="127.0.0.1", host_port=0)
    peer = Peer(
        manifest,
        network,
        state_dir=args.out / "state",
        name=f"rank{args.rank}",
        listener=listener,
        progress_interval=0.5,
    )
    resume = None
    if args.resume:
        found = find_latest(args.out / "state", manifest.run_id)
        resume = found.path if found is not None else None
    try:
        peer.start(model, resume=resume)
    except SwarmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    (args.out / "peer_id.txt").write_text(peer.peer_id)  # before the addresses, whose file says "started"
    write_whole(args.out / "maddrs.txt", "\n".join(visible_maddrs(peer.dht)))
    deadline = time.monotonic() + 180  # a test whose every round needs the whole group: on a loaded machine a
    while len(peer.view().peers) < args.start_with and time.monotonic() < deadline:  # peer can take longer to
        time.sleep(0.2)  # start than a round takes, and the first round would go alone
    if len(peer.view().peers) < args.start_with:  # what a stalled test needs to know first
        seen = sorted(f"{p.peer_id[-6:]}@{p.epoch}" for p in peer.view().peers)
        print(f"start-with: after 180 s the view holds {len(seen)} of {args.start_with} peers: {seen}", file=sys.stderr)
    reports = []
    while peer.epoch < args.max_epochs:
        if 0 <= args.hold_at_epoch <= peer.epoch:
            args.hold_at_epoch = -1  # once: a test whose joiner must take part in a round waits for it here, as a
            hold_until = time.monotonic() + 180  # loaded machine can start it slower than the rest of the run takes
            while not args.hold_for.exists() and time.monotonic() < hold_until:
                time.sleep(0.2)
        t0 = time.monotonic()
        if peer.epoch == args.poison_epoch:
            args.poison_epoch = -1  # once: a diverged step, as after an fp16 overflow
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        if peer.inner_step == args.settle_at_step:
            peer.settle()  # the outer step lands at a known step, so the run can be compared with a reference
        loss = inner_step(model, optimizer, make_batch(args.rank, peer.epoch, peer.inner_step))
        time.sleep(args.step_sleep)
        report = peer.report_step(BATCH, loss, compute_seconds=time.monotonic() - t0)
        if report is not None:
            if report.outcome == RoundOutcome.non_finite:
                optimizer.state.clear()  # as the client does: the moments hold the NaNs
            reports.append(as_json(report))
            (args.out / "reports.json").write_text(json.dumps(reports))
    last = peer.check_last_round()  # the last round (overlapped, or without a group) against the swarm, as the client
    if last is not None and last.resynced:
        reports[-1] = as_json(last)
        (args.out / "reports.json").write_text(json.dumps(reports))
    torch.save(
        dict(
            epoch=peer.epoch,
            params=[p.clone() for p in peer.outer.params],
            checksum=peer.outer.checksum(),
            stats=peer.stats.__dict__,
        ),
        args.out / "final.pt",
    )
    peer.leave()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: hivemind's threads can abort it after a clean leave
