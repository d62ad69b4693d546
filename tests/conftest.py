import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from swarm_harness import WorkerSwarm  # noqa: E402


@pytest.fixture
def make_swarm(tmp_path):
    swarms: list[WorkerSwarm] = []

    def factory(manifest) -> WorkerSwarm:
        swarm = WorkerSwarm(tmp_path / f"swarm{len(swarms)}", manifest)
        swarms.append(swarm)
        return swarm

    yield factory
    for swarm in swarms:
        swarm.close()
