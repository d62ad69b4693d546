"""`swarm-client export`: the latest checkpoint's global model in Hugging Face format.

The checkpoint's parameters are checked (sha256, CRC32) and read straight into a freshly built model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from client import checkpoint
from client.model import build_model, parameter_shapes
from swarm import RunManifest, SwarmError
from swarm.state import file as state_file


def export_model(workdir: Path, out: Path, run_id: str | None = None) -> Path:
    runs = sorted(p.name for p in (workdir / "runs").glob("*") if (p / "manifest.json").exists())
    if run_id is None:
        if len(runs) != 1:
            listing = ", ".join(runs) or "none"
            raise SwarmError(f"{workdir} holds {len(runs)} runs ({listing}); pick one with --run.")
        run_id = runs[0]
    if run_id not in runs:
        raise SwarmError(f"No run {run_id} in {workdir}; runs there: {', '.join(runs) or 'none'}.")
    manifest = RunManifest.from_json((workdir / "runs" / run_id / "manifest.json").read_text())
    shapes = parameter_shapes(manifest)
    found = checkpoint.find(checkpoint.checkpoint_dir(workdir, run_id), run_id, shapes)
    if found is None:
        raise SwarmError(f"Run {run_id} in {workdir} has no readable checkpoint yet.")
    model = build_model(manifest)
    with torch.no_grad():
        state_file.load_into(found.path, found.header, [p.detach() for p in model.parameters()])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out
