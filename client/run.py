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
from swarm import NetworkConfig, RunSecret

FIND_RUN_WAIT = 30.0  # seconds a joiner reads the DHT again while it shows no run at all (swarm.choose_run)


def _network(args: argparse.Namespace, workdir: Path) -> NetworkConfig:
    from swarm import NetworkConfig

    return NetworkConfig(
        initial_peers=args.initial_peers,
        host_ip=args.host_ip,
        host_port=args.host_port,
        announce_ip=args.announce_ip,
        identity_path=args.identity or workdir / "identity.key",
        client_mode=args.client_mode,
        secret=read_secret(args.secret_file),
    )


def read_secret(path: Path | None) -> RunSecret | None:
    """A closed run's keys from ``--secret-file`` (None: an open run)."""
    return None if path is None else RunSecret.from_file(path)


def join_command_line(maddrs: Sequence[str], run_id: str) -> str:
    return f"swarm-client join --initial-peers {' '.join(maddrs)} --run {run_id}"


def use_dashboard(args: argparse.Namespace) -> bool:
    return sys.stdout.isatty() and not getattr(args, "no_dashboard", False)


def run_peer(args: argparse.Namespace, inputs: PeerInputs) -> int:
    """`start` (``inputs.manifest``: the run to create) or `join`, on a command line that
    ``client.preflight.check_peer_command`` has checked."""
    from client.dashboard import DashboardSource, LiveDashboard
    from client.hardware import detect
    from client.monitoring import TrainingTick, gpu_memory, own_state
    from client.swarm_watch import SwarmWatch
    from client.telemetry import Telemetry
    from client.trainer import Trainer, TrainerSettings
    from swarm import choose_run, claim_port, start_dht, visible_maddrs
    from swarm.dht.network import DEFAULT_PORT
    from swarm.dht.peers import read_peers

    workdir, manifest, creating = inputs.workdir, inputs.manifest, inputs.manifest is not None
    setup_logging(workdir / "logs" / "swarm-client.log", args.verbose)
    hardware = detect(args.device)  # before the DHT: a --device this machine lacks should not cost a network join
    network = _network(args, workdir)
    if manifest is not None and network.secret is not None:  # a closed run: its id is another run's
        manifest = manifest.model_copy(update=dict(access=network.secret.tag))
    dashboard = use_dashboard(args)
    say = (lambda line: None) if dashboard else (lambda line: print(line, flush=True))
    claim = claim_port(network.host_ip, network.host_port)
    if claim.moved:
        print(
            f"Port {DEFAULT_PORT} is in use on this machine (another peer?); listening on {claim.port} instead. "
            "Forward that port for others to reach you, or choose one with --host-port.",
            flush=True,
        )
    dht = start_dht(network, claim)
    telemetry = Telemetry(args.log_json, echo=None if dashboard else say)
    watch = tick = None
    try:
        if manifest is None:
            manifest = choose_run(dht, args.run, wait=FIND_RUN_WAIT)
            print(f"Joining run {manifest.run_id} ({manifest.name}).", flush=True)
        maddrs = [a for a in visible_maddrs(dht)]
        if creating:
            print(f"Run {manifest.run_id} ({manifest.name}) created.", flush=True)
        join_line = join_command_line(maddrs[:1] or maddrs, manifest.run_id)

        def ready() -> None:
            # only once this peer has its state and has published it: a peer that joined sooner found no state
            # here, started the run afresh, and this one downloaded from it
            print(f"Others join with:\n{join_line}", flush=True)

        settings = TrainerSettings(
            workdir=workdir,
            name=args.name,
            micro_batch=args.micro_batch,
            max_epochs=args.max_epochs,
            eval_sequences=held_out_sequences(args),
            eval_every=args.eval_every,
            nice=args.nice,
        )
        run_id = manifest.run_id
        # the watcher reads the DHT from its own thread: it starts once the peer has forked its averager
        trainer = Trainer(
            manifest,
            dht,
            hardware,
            settings,
            log=say,
            telemetry=telemetry,
            on_connected=lambda: watch.start(),
            on_ready=ready,
        )
        tick = TrainingTick(trainer, workdir, bool(args.initial_peers), None if dashboard else say)
        watch = SwarmWatch(
            lambda: read_peers(dht, run_id), manifest, telemetry, self_id=dht.peer_id.to_base58(), on_tick=tick
        )
        if dashboard:
            source = DashboardSource(
                manifest=manifest,
                parameters=lambda: trainer.parameters,
                telemetry=telemetry,
                watch=watch,
                own=lambda: own_state(trainer, bool(args.initial_peers)),
                gpu_memory=gpu_memory(hardware),
                title=f"swarm-client {args.command}",
            )
            with LiveDashboard(source):
                result = trainer.run()
        else:
            result = trainer.run()
    finally:
        with STOP.shielded():
            if watch is not None:
                watch.stop()
                tick.write_status()  # the final state ("left" after a clean exit): the health check says so
            telemetry.close()
            dht.shutdown()
    if dashboard:
        print(f"Left after {result.rounds} rounds at epoch {result.epoch}; checkpoint: {result.checkpoint}", flush=True)
    if args.result_file:
        args.result_file.write_text(
            json.dumps(
                dict(
                    run_id=manifest.run_id,
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
    return 0
