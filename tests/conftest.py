import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client_helpers import SPAWNED, kill_spawned  # noqa: E402
from swarm_harness import WorkerSwarm  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _no_peer_outlives_its_module():
    yield
    kill_spawned()


@pytest.fixture(autouse=True)
def _no_peer_outlives_its_test():
    # module-scoped fixtures (a shared swarm, a donor) are set up before this one: their peers stay
    before = len(SPAWNED)
    yield
    kill_spawned(keep=before)


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
