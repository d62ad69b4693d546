"""The fixes an averager process runs with, installed together as it starts (``PseudoGradientAverager._run_internal``):
hivemind's search for a leader paced (``pace``), stream messages bounded (``messages``), group ids that bind
their layout (``group_ids``) and each stream's address kept for its handler (``remote_addrs``).
``swarm.dht.network.start_dht`` installs the last three before it forks anything; here
they also hold for an averager whose DHT was started otherwise (an embedder's plain ``hivemind.DHT``)."""

from __future__ import annotations

from swarm.hivemind_fixes.group_ids import bind_group_ids
from swarm.hivemind_fixes.messages import bound_messages
from swarm.hivemind_fixes.pace import pace_matchmaking
from swarm.hivemind_fixes.remote_addrs import keep_remote_addrs


def fix_averager_process() -> None:
    pace_matchmaking()
    bound_messages()
    bind_group_ids()
    keep_remote_addrs()
