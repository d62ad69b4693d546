import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import image_build  # noqa: E402
from client_helpers import SPAWNED, kill_spawned  # noqa: E402
from swarm_harness import WorkerSwarm  # noqa: E402

from swarm.hivemind_fixes import locks as hivemind_locks  # noqa: E402

IMAGE_BUILD = pytest.StashKey[object]()  # the image's background build (tests/image_build.py), or None


def pytest_configure(config: pytest.Config) -> None:
    config.stash[IMAGE_BUILD] = image_build.start(config)  # before xdist starts its workers: they inherit where


def pytest_unconfigure(config: pytest.Config) -> None:
    image_build.stop(config.stash.get(IMAGE_BUILD, None))


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


@pytest.fixture(autouse=True)
def _hiveminds_locks_are_free():
    """Tests that start hivemind's helpers in this process (some without ``start_dht``) fork them from here: locks
    an earlier test's helper left taken hung the next two such tests of a CI worker for 120 s each. Reclaimed, and
    said, so that a run shows how often it happens."""
    stuck = hivemind_locks.free_stuck_locks()
    if stuck:
        warnings.warn(f"hivemind locks left taken by a dead helper, reclaimed: {', '.join(stuck)}", stacklevel=1)
    yield


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
