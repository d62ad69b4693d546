"""The terminal dashboard: header, peers table, this peer, the idle line and recent events.

``render`` is a pure function of what the training loop and the swarm watcher
already hold, so it can be tested with a recording Console and drawn by rich's
own refresh thread: the training loop never waits for the screen. It stays as
long for a thousand peers as for twenty: past ``MAX_ROWS`` peers the table says
what they all come to in one line and shows the rows that matter (``pick_rows``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from client.idle import NAMED, OwnState, why_idle
from client.round_line import how_it_went
from client.swarm_watch import FADE_SECONDS, SwarmWatch, TrackedPeer
from client.telemetry import Telemetry
from swarm import PeerState, RunManifest, SwarmView
from swarm.defence.bans import accused
from swarm.observer import summary

REFRESH_PER_SECOND = 2
SPARK = "▁▂▃▄▅▆▇█"
EVENT_LINES = 8
MAX_ROWS = 20  # peer rows in the table; past that, a summary line, the rows that matter most and "... and N more"
# the kinds of rows that matter, in order, and how many rows each may take before the next has its turn
QUOTAS = (("banned", 4), ("waited for", 6), ("off the epoch", 3), ("mates", 3), ("gone", 3))
_ROUND = (PeerState.matchmaking.value, PeerState.averaging.value)
_ACTIVE = (PeerState.training.value, *_ROUND)


@dataclass
class DashboardSource:
    """Everything the dashboard reads. ``own`` is None for observers (status, demo), which train nothing."""

    manifest: RunManifest
    parameters: Callable[[], int]
    telemetry: Telemetry
    watch: SwarmWatch
    own: Callable[[], OwnState] | None = None
    gpu_memory: Callable[[], str] | None = None
    title: str = "swarm"


def render(source: DashboardSource, now: float | None = None) -> RenderableType:
    now = time.time() if now is None else now
    parts: list[RenderableType] = [_header(source, now), _peers_table(source, now)]
    if source.own is not None:
        parts.append(_this_peer(source, now))
    parts.append(_events(source))
    return Group(*parts)


# ---- header ----------------------------------------------------------------------------------------


def _header(source: DashboardSource, now: float) -> Panel:
    m, snap = source.manifest, source.watch.snapshot
    view = snap.view
    grid = Table.grid(padding=(0, 3))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_column(style="bold")
    grid.add_column()
    global_epoch = str(view.global_epoch) if view and view.global_epoch is not None else "-"
    alive = str(view.num_alive) if view else "-"
    sps = view.samples_per_second if view else 0.0
    eta = view.eta_next_round if view else None
    own = source.own() if source.own else None
    mine = f"epoch {own.epoch}, step {own.inner_step}/{m.inner_steps}" if own else f"H = {m.inner_steps} steps"
    grid.add_row("run", f"{m.run_id}  {m.name}", "model", f"{_count(source.parameters())} parameters")
    grid.add_row("global epoch", global_epoch, "this peer" if own else "inner steps", mine)
    grid.add_row("peers alive", alive, "swarm speed", f"{sps:,.1f} samples/s  {sps * m.seq_len:,.0f} tokens/s")
    grid.add_row(
        "tokens trained",
        _count(view.tokens_processed) if view else "-",
        "next round",
        f"in ~{_duration(eta)}" if eta is not None else "-",
    )
    body: list[RenderableType] = [grid]
    if own is not None:
        body.append(Text.assemble(("why am I idle? ", "bold yellow"), (why_idle(own, view, NAMED), "yellow")))
    elif view is not None:
        body.append(Text(_observer_line(view), style="yellow"))
    stale = f" · swarm view {now - snap.updated_at:.0f} s old" if snap.updated_at and now - snap.updated_at > 5 else ""
    return Panel(Group(*body), title=f"[bold]{source.title}[/bold]{stale}", title_align="left")


def _observer_line(view: SwarmView) -> str:
    if not view.peers:
        return "no live peers in this run"
    states: dict[str, int] = {}
    for p in view.peers:
        states[p.state] = states.get(p.state, 0) + 1
    return "peers: " + ", ".join(f"{n} {state}" for state, n in sorted(states.items()))


# ---- peers -----------------------------------------------------------------------------------------


def _peers_table(source: DashboardSource, now: float) -> Table:
    own = source.own() if source.own else None
    snap, m = source.watch.snapshot, source.manifest
    banned = accused(peer.record for peer in snap.peers if not peer.gone)
    rows, hidden = list(snap.peers), 0
    if len(rows) > MAX_ROWS:
        epoch = snap.view.global_epoch if snap.view is not None else None
        rows, hidden = pick_rows(rows, own, banned, epoch, m.inner_steps, m.samples_per_step)
    title = "peers" if not hidden else f"peers: {summary_line(snap.view, snap.peers, banned)}"
    table = Table(title=title, title_justify="left", expand=True, header_style="bold")
    for column, justify in (
        ("name", "left"),
        ("id", "left"),
        ("device", "left"),
        ("micro-batch", "right"),
        ("samples/s", "right"),
        ("epoch/step", "right"),
        ("state", "left"),
        ("link", "left"),
        ("last seen", "right"),
    ):
        table.add_column(column, justify=justify, overflow="ellipsis", no_wrap=column != "device")
    for peer in rows:
        row = peer_row(peer, own, now)
        why = banned.get(peer.record.peer_id)
        if why is not None and not peer.gone:  # who banned it, and why (docs/security.md, "Bans")
            said = ", proven" if why["proven"] else ", a quorum" if why["quorum"] else ""
            row[6] = f"banned: {why['reasons'][0]} ({len(why['by'])} of us{said})"
        style = "dim" if peer.gone else "red" if why is not None else None
        table.add_row(*(Text(cell) for cell in row), style=style)  # Text: a peer's name is not rich markup
    if hidden:
        table.add_row(f"… and {hidden} more", *[""] * 8, style="dim")
    if not snap.peers:
        table.add_row("(no peers seen yet)", *[""] * 8)
    return table


def pick_rows(
    peers: Sequence[TrackedPeer],
    own: OwnState | None,
    banned: Mapping[str, object],
    epoch: int | None,
    inner_steps: int,
    samples_per_step: int,
    limit: int = MAX_ROWS,
) -> tuple[list[TrackedPeer], int]:
    """The rows to show, and how many are left out. Up to ``limit`` peers: all of them, in the watcher's order.
    Past that, this peer's own row, then (``QUOTAS``) the banned; the peers at our epoch (an observer: the global
    one) still training towards the round, the slowest first; the live peers off that epoch or neither training nor
    in a round (downloading state, re-syncing, starting), the farthest off first; the others at that epoch, those
    in a round first; and those gone, the latest first. Each kind takes its quota, then the rows left go to the
    kinds in that order. Rows that left come last."""
    if len(peers) <= limit:
        return list(peers), 0
    own_id = own.peer_id if own is not None else None
    mine = [p for p in peers if p.record.peer_id == own_id][:1]
    at = own.epoch if own is not None else epoch
    live = [p for p in peers if not p.gone and p.record.peer_id != own_id]

    def left(p: TrackedPeer) -> float:
        r = p.record
        return (inner_steps - r.inner_step) * samples_per_step / r.samples_per_second if r.samples_per_second else 1e18

    def off(p: TrackedPeer) -> bool:
        return (at is not None and p.record.epoch != at) or p.record.state not in _ACTIVE

    def behind(p: TrackedPeer) -> bool:
        return not off(p) and p.record.state == PeerState.training and p.record.inner_step < inner_steps

    kinds = {
        "banned": [p for p in live if p.record.peer_id in banned],
        "waited for": sorted((p for p in live if behind(p)), key=lambda p: (-left(p), p.record.name)),
        "off the epoch": sorted(
            (p for p in live if off(p)), key=lambda p: (-abs(p.record.epoch - (at or 0)), p.record.name)
        ),
        "mates": sorted((p for p in live if not off(p)), key=lambda p: (p.record.state not in _ROUND, p.record.name)),
        "gone": sorted((p for p in peers if p.gone), key=lambda p: -(p.gone_since or 0)),
    }
    chosen: dict[str, list[TrackedPeer]] = {kind: [] for kind in kinds}
    taken = {p.record.peer_id for p in mine}
    room = limit - len(mine)
    for second_pass in (False, True):
        for kind, quota in QUOTAS:
            for p in kinds[kind]:
                if room == 0 or (not second_pass and len(chosen[kind]) >= quota):
                    break
                if p.record.peer_id not in taken:
                    chosen[kind].append(p)
                    taken.add(p.record.peer_id)
                    room -= 1
    rows = mine + [p for kind, _ in QUOTAS for p in chosen[kind]]
    return rows, len(peers) - len(rows)


def summary_line(view: SwarmView | None, peers: Sequence[TrackedPeer], banned: Mapping[str, object]) -> str:
    """What every peer comes to, in one line: "1000 alive (870 training, 130 matchmaking) · epochs 5: 900, 4: 100
    · 12,345.6 samples/s · 2 banned · 3 gone"."""
    counts = summary(view.peers if view is not None else [p.record for p in peers if not p.gone])
    states = ", ".join(f"{n} {state}" for state, n in counts.by_state.items())
    epochs = ", ".join(f"{e}: {n}" for e, n in counts.by_epoch.items())
    epochs += f", others: {counts.by_epoch_other}" if counts.by_epoch_other else ""
    gone = sum(p.gone for p in peers)
    parts = [f"{counts.peers} alive ({states})", f"epochs {epochs}", f"{counts.samples_per_second:,.1f} samples/s"]
    parts += [f"{len(banned)} banned"] if banned else []
    parts += [f"{gone} gone in the last {FADE_SECONDS:.0f} s"] if gone else []
    return " · ".join(parts)


def peer_row(peer: TrackedPeer, own: OwnState | None, now: float) -> list[str]:
    """One row of the peers table. This peer's own row says what it does as its status file does (``own``): an
    overlapped peer trains while its record says matchmaking or averaging for the others' matchmaking."""
    r = peer.record
    mine = own is not None and r.peer_id == own.peer_id
    name = f"{r.name} (you)" if mine else r.name
    if peer.gone:
        state = f"{peer.gone_reason} {now - (peer.gone_since or now):.0f} s ago"
    elif r.state in (PeerState.downloading_state, PeerState.resyncing):
        state = f"{r.state} {100 * r.download_progress:.0f}%"
    elif mine and own.round_in_background is not None:
        state = f"{own.state} (round {own.round_in_background})"
    elif mine:
        state = own.state
    else:
        state = r.state
    link = "client mode" if r.client_mode else "relayed" if r.relayed else "direct"
    return [
        name,
        r.peer_id[-8:],
        r.device,
        str(r.micro_batch or "-"),
        f"{r.samples_per_second:,.1f}",
        f"{r.epoch}/{r.inner_step}",
        state,
        link,
        f"{max(0.0, now - r.time):.0f} s ago",
    ]


# ---- this peer -------------------------------------------------------------------------------------


def _this_peer(source: DashboardSource, now: float) -> Panel:
    tel = source.telemetry
    grid = Table.grid(padding=(0, 3))
    for style in ("bold", None, "bold", None):
        grid.add_column(style=style)
    losses = list(tel.losses)
    loss = f"{losses[-1]:.4f}" if losses else "-"
    util = tel.utilization(now)
    held_out = f"  held-out {tel.eval_loss[1]:.4f} at epoch {tel.eval_loss[0]}" if tel.eval_loss else ""
    grid.add_row("loss", f"{loss}  {sparkline(losses[-60:])}{held_out}", "lr", f"{tel.lr:.2e}")
    grid.add_row(
        "tokens/s",
        f"{tel.tokens_per_second:,.0f}",
        "compute utilization",
        f"{100 * util:.1f}% of wall time in inner steps" if util is not None else "-",
    )
    grid.add_row("last round", _round_line(tel), "traffic", _traffic_line(tel))
    grid.add_row(
        "rounds",
        f"{tel.rounds} ({tel.averaged_rounds} averaged)",
        "skipped scaler steps",
        f"{tel.skipped_scaler_steps}  (non-finite losses {tel.nan_steps})",
    )
    grid.add_row("GPU memory", source.gpu_memory() if source.gpu_memory else "-", "micro-batch", str(tel.micro_batch))
    return Panel(grid, title="this peer", title_align="left")


def _round_line(tel: Telemetry) -> str:
    r = tel.last_round
    if r is None:
        return "none yet"
    s = r.seconds
    how = how_it_went(r, group="group of {}")
    return (
        f"{how}: matchmaking {s.get('matchmaking', 0):.1f} s, all-reduce {s.get('allreduce', 0):.1f} s"
        + (f" (audits {s['audit']:.1f} s)" if s.get("audit", 0) > 0 else "")
        + f", outer {s.get('outer', 0):.2f} s"
    )


def _traffic_line(tel: Telemetry) -> str:
    r = tel.last_round
    if r is None:
        return "-"
    return f"sent {_bytes(r.bytes_sent)}, received {_bytes(r.bytes_received)}"


# ---- events ----------------------------------------------------------------------------------------


def _events(source: DashboardSource) -> Panel:
    styles = {"left": "red", "joined": "green", "fallback": "yellow", "resync": "magenta", "round": "cyan"}
    lines = Text()
    for event in source.telemetry.recent_events(EVENT_LINES):
        stamp = datetime.fromtimestamp(event.time).strftime("%H:%M:%S")
        if lines:
            lines.append("\n")
        lines.append(f"{stamp} ", style="dim")
        lines.append(event.message, style=styles.get(event.kind))
    return Panel(lines or Text("nothing yet", style="dim"), title="events", title_align="left")


# ---- formatting ------------------------------------------------------------------------------------


def sparkline(values: Sequence[float]) -> str:
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in values)


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


class LiveDashboard:
    """rich's Live, redrawn by its own thread about twice a second."""

    def __init__(self, source: DashboardSource, console: Console | None = None):
        self.source = source
        self.live = Live(
            console=console or Console(),
            get_renderable=lambda: render(source),
            refresh_per_second=REFRESH_PER_SECOND,
            redirect_stdout=True,
            redirect_stderr=False,
        )

    def __enter__(self) -> LiveDashboard:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)
