"""`swarm-client start` and `join`: claim a workdir and a port, join the DHT, train until told to stop.

What the volunteer sees comes from here: the join line, the port the peer took, the
live dashboard or the log lines, and the exit's summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from client.logs import setup_logging
from client.options import held_out_sequences
from client.preflight import PeerInputs
from client.signals import STOP
from client.sources import data_source

WATCH_STOP = 15.0  # seconds the swarm watcher's thread may take to end its read, unhurried
WATCH_STOP_HURRIED = 1.0  # after a stop signal: its thread is a daemon, the process ends without it
FIND_RUN_WAIT = 30.0  # seconds a joiner reads the DHT again while it shows no run at all (swarm.choose_run)


def join_command_line(maddrs: Sequence[str], run_id: str) -> str:
    return f"swarm-client join --initial-peers {' '.join(maddrs)} --run {run_id}"


def use_dashboard(args: argparse.Namespace) -> bool:
    return sys.stdout.isatty() and not getattr(args, "no_dashboard", False)


def run_peer(args: argparse.Namespace, inputs: PeerInputs) -> int:
    """`start` (``inputs.manifest``: the run to create) or `join`, on a command line that
    ``client.preflight.check_peer_command`` has checked: the phases below, in order."""
    from client.hardware import detect
    from client.telemetry import Telemetry

    setup_logging(inputs.workdir / "logs" / "swarm-client.log", args.verbose)
    hardware = detect(inputs.device)  # before the DHT: a --device this machine lacks should not cost a network join
    dashboard = use_dashboard(args)
    say = (lambda line: None) if dashboard else (lambda line: print(line, flush=True))
    dht = _join_dht(inputs.network)
    telemetry = Telemetry(args.log_json, echo=None if dashboard else say)
    watch = tick = None
    try:
        manifest = _the_run(dht, getattr(args, "run", None), inputs.manifest)  # `start` has no --run
        data = inputs.data or data_source(manifest.dataset, args.data_path)  # `join`: its run is known now
        if data.files:
            print(f"Training on your own {len(data.files)} files of --data-path {data.data_path}.", flush=True)
        trainer = _trainer(args, inputs.workdir, manifest, data, dht, hardware, telemetry, say, lambda: watch.start())
        watch, tick = _watch(trainer, dht, manifest, telemetry, args, dashboard, say)
        result = _train(trainer, watch, args, dashboard, hardware)
        if args.result_file:  # before the teardown, which a stop's watchdog may cut short (it writes no result)
            with STOP.shielded():
                _write_result(args.result_file, manifest.run_id, result)
    finally:
        with STOP.shielded():
            if watch is not None:
                watch.stop(timeout=WATCH_STOP_HURRIED if STOP.requested else WATCH_STOP)
                tick.write_status()  # the final state ("left" after a clean exit): the health check says so
            telemetry.close()
            dht.shutdown()
    if dashboard:
        print(f"Left after {result.rounds} rounds at epoch {result.epoch}; checkpoint: {result.checkpoint}", flush=True)
    return 0


def _join_dht(network):
    """Claim the port (the next free one after the default, saying so, when another peer has it) and join."""
    from swarm import claim_port, start_dht
    from swarm.dht.config import DEFAULT_PORT

    claim = claim_port(network.host_ip, network.host_port)
    if claim.moved:
        print(
            f"Port {DEFAULT_PORT} is in use on this machine (another peer?); listening on {claim.port} instead. "
            "Forward that port for others to reach you, or choose one with --host-port.",
            flush=True,
        )
    return start_dht(network, claim)


def _the_run(dht, run_id: str | None, creating):
    """The run this peer trains: the one it creates, or the one the swarm hosts (``--run`` when several)."""
    from swarm import choose_run

    if creating is None:
        manifest = choose_run(dht, run_id, wait=FIND_RUN_WAIT)
        print(f"Joining run {manifest.run_id} ({manifest.name}).", flush=True)
        return manifest
    print(f"Run {creating.run_id} ({creating.name}) created.", flush=True)
    return creating


def _trainer(args, workdir: Path, manifest, data, dht, hardware, telemetry, say, on_connected):
    """The training loop, which prints the join line once this peer has its state and has published it: a peer
    that joined sooner found no state here, started the run afresh, and this one downloaded from it."""
    from client.trainer import Trainer, TrainerSettings
    from swarm import visible_maddrs

    maddrs = visible_maddrs(dht)
    join_line = join_command_line(maddrs[:1], manifest.run_id)
    settings = TrainerSettings(
        workdir=workdir,
        data=data,
        name=args.name,
        micro_batch=args.micro_batch,
        max_epochs=args.max_epochs,
        eval_sequences=held_out_sequences(args),
        eval_every=args.eval_every,
        nice=args.nice,
    )
    ready = lambda: print(f"Others join with:\n{join_line}", flush=True)  # noqa: E731
    return Trainer(manifest, dht, hardware, settings, log=say, telemetry=telemetry, on_connected=on_connected,
                   on_ready=ready)  # fmt: skip


def _watch(trainer, dht, manifest, telemetry, args, dashboard: bool, say):
    """The swarm watcher, whose tick writes the status file and the plain log lines; it reads the DHT from its
    own thread, started once the peer has forked its averager (``on_connected``)."""
    from client.monitoring import TrainingTick
    from client.swarm_watch import SwarmWatch
    from swarm.dht.peers import read_peers

    tick = TrainingTick(trainer, trainer.settings.workdir, bool(args.initial_peers), None if dashboard else say)
    run_id = manifest.run_id
    watch = SwarmWatch(
        lambda: read_peers(dht, run_id), manifest, telemetry, self_id=dht.peer_id.to_base58(), on_tick=tick
    )
    return watch, tick


def _train(trainer, watch, args, dashboard: bool, hardware):
    """Run the loop, under the live dashboard on a terminal."""
    if not dashboard:
        return trainer.run()
    from client.dashboard import DashboardSource, LiveDashboard
    from client.monitoring import gpu_memory, own_state

    source = DashboardSource(
        manifest=trainer.manifest,
        parameters=lambda: trainer.parameters,
        telemetry=trainer.telemetry,
        watch=watch,
        own=lambda: own_state(trainer, bool(args.initial_peers)),
        gpu_memory=gpu_memory(hardware),
        title=f"swarm-client {args.command}",
    )
    with LiveDashboard(source):
        return trainer.run()


def _write_result(path: Path, run_id: str, result) -> None:
    """The run's outcome as JSON, for tests and scripts (``--result-file``)."""
    path.write_text(
        json.dumps(
            dict(
                run_id=run_id,
                rounds=result.rounds,
                epoch=result.epoch,
                checksum=result.checksum,
                eval_loss_start=result.eval_loss_start,
                eval_loss_end=result.eval_loss_end,
                eval_losses=result.eval_losses,
                averaged_rounds=sum(r.averaged for r in result.reports),
                first_moment_corrections=result.first_moment_corrections,
                checkpoint=str(result.checkpoint) if result.checkpoint else None,
            )
        )
    )
