import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client_helpers import kill_spawned  # noqa: E402
from swarm_harness import WorkerSwarm  # noqa: E402


@pytest.fixture(autouse=True)
def _no_peer_outlives_its_test():
    yield
    kill_spawned()


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
