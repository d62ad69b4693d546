"""What a joiner to a lone donor fetches before its first averaged round: state downloads against replays.

A lone peer makes local rounds (no group). A joiner downloads its state; if the donor finishes a round
before the joiner's first one ends, the joiner is a round behind. Until local rounds were kept for replay
(``swarm/round/local_update.py``) it then downloaded the whole state again (8 bytes per parameter); now it replays
that round's step (2 with fp16, 0.44 with fp4).

Two real ``swarm-client`` peers on 127.0.0.1, a model of over 100M parameters (the 150m preset's shape with 3
layers, the byte tokenizer and the built-in corpus), the run's defaults otherwise (overlapped fp4 since
2026-11-28; ``benchmarks/results/catchup`` was measured with blocking fp16, the defaults then). Three cases, in
one run:

- ``late``: the joiner comes once the donor is past ``replay_rounds`` epochs, so its first catch-up must be a
  download; whatever it needs after that (the donor's next local round) it replays;
- ``late, replay off`` (``averaging.replay_rounds=0``): the same, as before local rounds were kept: every
  catch-up is a download. The baseline;
- ``early``: the joiner comes at once, within ``replay_rounds`` of the seed, and replays from the start.

Reported per case: the joiner's state downloads and replays (its log lines), what they fetched (the state's
and the updates' sizes), and seconds from its launch to its first averaged round; ratios against the baseline.

Run: ``python -m benchmarks.catchup`` (about 10 minutes here); ``--smoke``: the tiny preset.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchmarks.common import add_common_args, finish, print_table, scratch_dir
from benchmarks.memory import Peer  # a `swarm-client` process on 127.0.0.1 with its log, records and waits

NAME = "catchup"
REPO = Path(__file__).resolve().parent.parent
_JOIN = re.compile(r"swarm-client join --initial-peers (?P<maddrs>.+) --run (?P<run>[0-9a-f]{16})")
_LOADED = re.compile(r"state of epoch \d+ (?:\(checksum \w+\) )?loaded from")
_REPLAYED = re.compile(r"caught up to epoch \d+ by replaying (\d+) rounds")
REPLAY_ROUNDS = 4  # the manifest's default


def manifest_sets(args: argparse.Namespace, replay: bool) -> list[str]:
    sets = [] if args.smoke else ["tokenizer.kind=bytes", "dataset.source=builtin", "dataset.num_shards=32"]
    if not args.smoke:
        sets += ["model.num_hidden_layers=3", "seq_len=64", "samples_per_step=2", "inner_steps=4"]
    sets += ["inner.warmup_steps=10", "averaging.matchmaking_time=1.0", "averaging.matchmaking_timeout=5.0"]
    sets += [f"averaging.replay_rounds={REPLAY_ROUNDS if replay else 0}"]
    return [a for s in sets for a in ("--set", s)]


def epoch(peer: Peer) -> int:
    return max((r["epoch"] for r in peer.records("round")), default=0)


def newest_bytes(folder: Path, pattern: str) -> int:
    files = sorted(folder.rglob(pattern), key=lambda p: p.stat().st_mtime)
    return files[-1].stat().st_size if files else 0


def run_case(args: argparse.Namespace, root: Path, name: str, replay: bool, late: bool) -> dict:
    workdir = root / name.replace(" ", "-").replace(",", "")
    workdir.mkdir()
    preset = ["--preset", "tiny" if args.smoke else "150m"]
    donor = Peer(REPO, workdir, "donor", ["start", *preset, *manifest_sets(args, replay)])
    joiner = None
    try:
        line = donor.wait_for(lambda: _JOIN.search(donor.text()), 300, "the join line")
        donor.wait_for(lambda: donor.records("round"), 300, "the donor's first round")
        if late:  # past what a fresh joiner could replay: its first catch-up is a download
            donor.wait_for(lambda: epoch(donor) > REPLAY_ROUNDS, 600, f"epoch {REPLAY_ROUNDS + 1}")
        joined_at_epoch = epoch(donor)
        join = ["join", "--initial-peers", line.group("maddrs").strip(), "--run", line.group("run")]
        joiner = Peer(REPO, workdir, "joiner", join)
        first = joiner.wait_for(
            lambda: [r for r in joiner.records("round") if r["averaged"]],
            args.timeout,
            "the joiner's first averaged round",
        )[0]
        text = joiner.text()
        downloads, replays = len(_LOADED.findall(text)), [int(n) for n in _REPLAYED.findall(text)]
        state_bytes = newest_bytes(workdir / "donor", "state-*.safetensors")
        update_bytes = newest_bytes(workdir / "donor", "update-*.bin")
        return dict(
            case=name,
            replay_rounds=REPLAY_ROUNDS if replay else 0,
            donor_epoch_at_join=joined_at_epoch,
            state_downloads=downloads,
            replays=len(replays),
            rounds_replayed=sum(replays),
            state_bytes=state_bytes,
            update_bytes=update_bytes,
            fetched_bytes=downloads * state_bytes + sum(replays) * update_bytes,
            seconds_to_first_averaged_round=first["time"] - joiner.started,
        )
    finally:
        for peer in (joiner, donor):
            if peer is not None:
                peer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the joiner's first average")
    parser.add_argument("--workdir", type=Path, help="keep the peers' files here (default: a removed temporary)")
    args = parser.parse_args()
    cases = [("late, replay off", False, True), ("late", True, True), ("early", True, False)]
    results = []
    with scratch_dir(args.workdir, "swarm-catchup-") as root:
        for name, replay, late in cases:
            print(f"case: {name}", flush=True)
            results.append(run_case(args, root, name, replay, late))
    base = results[0]
    for r in results:
        r["fetched_ratio_vs_replay_off"] = r["fetched_bytes"] / base["fetched_bytes"] if base["fetched_bytes"] else None
        r["time_ratio_vs_replay_off"] = r["seconds_to_first_averaged_round"] / base["seconds_to_first_averaged_round"]
    columns = ["case", "donor epoch", "downloads", "replayed rounds", "fetched MB", "to 1st average s", "fetched/base"]
    rows = [
        [
            r["case"],
            r["donor_epoch_at_join"],
            r["state_downloads"],
            r["rounds_replayed"],
            r["fetched_bytes"] / 1e6,
            r["seconds_to_first_averaged_round"],
            r["fetched_ratio_vs_replay_off"] if r["fetched_ratio_vs_replay_off"] is not None else "-",
        ]
        for r in results
    ]
    print_table("A joiner to a lone donor", columns, rows)
    finish(NAME, args.out, dict(cases=results), head=("command", "machine"), plots=False)


if __name__ == "__main__":
    main()
