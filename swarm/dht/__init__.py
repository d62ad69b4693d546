"""The DHT side of a peer: joining (network, identity, a closed run's keys), the records peers write and their
validators, the run's manifest in the DHT, this peer's own record (presence), everyone's records (peers) and the
swarm view the rules read (view, pure functions). Imports ``hivemind_fixes`` and the ground modules (errors,
manifest, inputs) only. Importing ``swarm.dht.access`` or ``swarm.dht.config`` does not import hivemind."""
