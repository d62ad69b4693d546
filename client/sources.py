"""Where a peer's training text comes from, checked before torch and datasets are imported (``client.preflight``).

A manifest names hub datasets and tokenizers, never a path on a peer's machine (``swarm.manifest``): a run's creator
could otherwise make every joiner train on, and leak through its updates, any file the joiner can read. A run whose
dataset is ``local`` trains each peer on the files it names itself, with ``--data-path``.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import SwarmError
from swarm.manifest import DatasetSource, DatasetSpec

NEEDS_DATA_PATH = (
    "This run's dataset is local: each peer trains on its own files, which the manifest never names. Give yours "
    "with --data-path (a file, a directory or a glob of .txt or .jsonl files; or SWARM_DATA_PATH)."
)


@dataclass(frozen=True)
class DataSource:
    """A run's dataset as this peer reads it: the manifest's spec and, for a local dataset, this peer's own files."""

    spec: DatasetSpec
    data_path: str | None = None  # local: the --data-path this peer gave
    files: tuple[str, ...] = ()  # local: the files it matches, in a fixed order

    def __str__(self) -> str:
        if self.spec.source is DatasetSource.local:
            return f"local dataset {self.data_path}"
        if self.spec.source is DatasetSource.hub:
            return f"hub dataset {self.spec.path}"
        return f"{self.spec.source} dataset"


def data_source(spec: DatasetSpec, data_path: str | None = None) -> DataSource:
    """The run's dataset with this peer's ``--data-path``, or a SwarmError saying what to give (or leave out)."""
    if spec.source is DatasetSource.local:
        if not data_path:
            raise SwarmError(NEEDS_DATA_PATH)
        return DataSource(spec, data_path, local_files(data_path))
    if data_path:
        raise SwarmError(
            f"--data-path is for runs whose dataset is local; this run reads its {DataSource(spec)}. Leave out "
            "--data-path (and SWARM_DATA_PATH) to join it."
        )
    return DataSource(spec)


def local_files(data_path: str) -> tuple[str, ...]:
    """The regular files ``data_path`` names: itself, every file under it (a directory) or those a glob matches
    (``**`` included), sorted; a SwarmError when there are none."""
    path = os.path.expanduser(data_path)
    if os.path.isdir(path):
        found = (str(f) for f in Path(path).rglob("*"))
    elif any(c in path for c in "*?["):
        found = glob.iglob(path, recursive=True)
    else:
        found = iter([path])
    files = tuple(sorted(f for f in found if os.path.isfile(f)))  # not devices or pipes: /dev/zero never ends
    if not files:
        raise SwarmError(f"--data-path {data_path} matches no files.")
    return files


def hub_name(name: str, field: str) -> str:
    """``name``, a hub name (the manifest checked its form), unless a file or directory of that name is where this
    peer runs: transformers and datasets would read that instead of the hub's."""
    if os.path.lexists(name):
        raise SwarmError(
            f"The run's {field} {name!r} is a hub name, but {os.path.join(os.getcwd(), name)} exists on this machine "
            "and would be read instead of the hub's. Start swarm-client from another directory."
        )
    return name
