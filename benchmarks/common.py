"""What every benchmark shares: machine facts, the JSON record, optional plots and a table.

Results carry the exact command line and the machine so a figure can always be
traced back to the run that produced it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HEAD = ("benchmark", "smoke", "command", "machine")  # what a record starts with, in this order
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def tied_to_us() -> dict[str, Any]:
    """``subprocess.Popen`` arguments under which a peer gets SIGTERM (and leaves as a volunteer's does) when
    this benchmark dies, however it dies: peers of a killed benchmark ran on and held the machine's cores. Popen
    must be called from the main thread: the signal comes when the thread that started the peer ends."""
    if _LIBC is None:
        return {}
    parent = os.getpid()

    def die_with_parent() -> None:  # in the child, between fork and exec
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the benchmark died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return dict(preexec_fn=die_with_parent)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the benchmark runs end to end")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where to write the JSON and PNG results")


@contextlib.contextmanager
def scratch_dir(given: Path | None, prefix: str) -> Iterator[Path]:
    """Where a benchmark's peers keep their files: ``given`` (``--workdir``) is kept; otherwise a temporary
    folder, removed at the end whatever happens. A memory run writes gigabytes of checkpoints, and leftovers
    of a few runs once filled this machine's disk until peers failed to write theirs."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def command_line() -> str:
    """The command as typed, so docs/benchmarks.md can quote it verbatim."""
    module = Path(sys.argv[0]).stem
    return shlex.join(["python", "-m", f"benchmarks.{module}", *sys.argv[1:]])


def machine_info() -> dict[str, Any]:
    return dict(
        hostname=platform.node(),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        cpu_count_logical=psutil.cpu_count(logical=True),
        cpu_count_physical=psutil.cpu_count(logical=False),
        memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
        load_average_at_start=list(os.getloadavg()),
        torch_threads=torch.get_num_threads(),
    )


def finite(value: float | None) -> float | None:
    """JSON has no NaN: a non-finite figure is recorded as null."""
    return value if value is not None and math.isfinite(value) else None


def write_json(out_dir: Path, name: str, record: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=False, allow_nan=False) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a note) when the `bench` extra is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install -e '.[bench]'); JSON written, plots skipped.")
        return None
    return plt


def rate_label(rate_mbit: float | None, unit: str = "") -> str:
    """A link's rate for a table: "unlimited", or the number (with ``unit`` after it)."""
    return "unlimited" if rate_mbit is None else f"{rate_mbit:g}{unit}"


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(str(column))
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))
    Console(width=160).print(table)


class Stopwatch:
    """Wall time since construction, for the record's ``wall_seconds``."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    @property
    def seconds(self) -> float:
        return round(time.monotonic() - self.start, 2)


def save_figure(fig: Any, out: Path, name: str) -> Path:
    """Write the figure as out/NAME.png and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def finish(
    name: str,
    out: Path,
    fields: dict[str, Any],
    *,
    smoke: bool | None = None,
    clock: Stopwatch | None = None,
    plot: Callable[[Path], Path | None] | None = None,
    head: Sequence[str] = HEAD,
    plots: bool = True,
) -> dict[str, Any]:
    """A benchmark's ending, after its tables: its record, the plot drawn, out/NAME.json written.

    The record is ``head`` (of ``benchmark``, ``smoke``, ``command``, ``machine``, in the order given), then
    ``fields``, then ``wall_seconds`` (with a ``clock``) and ``plots`` (unless ``plots`` is false): the figures'
    file names, ``plot(out)``'s PNG if it drew one. A key of ``fields`` that the ending also writes keeps its place.
    Returns the record as written."""
    about = dict(benchmark=name, smoke=smoke, command=command_line(), machine=machine_info())
    record = {key: about[key] for key in head} | fields
    if clock is not None:
        record["wall_seconds"] = clock.seconds
    out.mkdir(parents=True, exist_ok=True)
    png = plot(out) if plot is not None else None
    if plots:
        record["plots"] = [png.name] if png else []
    write_json(out, name, record)
    return record


def worker_json(code: Path, repo: Path, module: str, args: Sequence[str], label: str, timeout: float = 1800) -> Any:
    """Run ``python -m module --worker args`` in a fresh process on one thread, importing swarm from ``code`` (a
    baseline tree, or the repository itself), and return the JSON its last line of output holds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code), str(repo)]), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", module, "--worker", *args], env=env, cwd=code, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{label}: the worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
