"""Deterministic model initialization from the manifest's seed.

Peers that start a new run at the same moment each initialize the model on their
own; building it under the manifest's seed makes them start from identical
weights, so their first checksums agree and nobody needs to download anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from swarm.manifest import RunManifest


@contextlib.contextmanager
def seeded_init(manifest: RunManifest) -> Iterator[None]:
    """Build the model inside this block; the caller's RNG state is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(manifest.init_seed)
        yield
