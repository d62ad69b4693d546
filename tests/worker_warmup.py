"""Imported once by the engine workers' fork server (``worker_fork``), never by a test: everything a worker
imports, and one model build, which imports the rest of transformers. The server stays single-threaded, so
forking it is safe."""

import os

os.environ["OMP_NUM_THREADS"] = "1"  # as the harness gave each worker before
os.environ["PYTHONUNBUFFERED"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)

import engine_worker  # noqa: E402, F401  (torch, transformers, hivemind and swarm)
from diloco_helpers import make_model, tiny_manifest  # noqa: E402

make_model(tiny_manifest())
