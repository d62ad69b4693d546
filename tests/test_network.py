import tempfile
import time

import pytest

from swarm import BootstrapError, NetworkConfig, NetworkConfigError, parse_initial_peer, start_dht
from swarm.dht.network import DEFAULT_PORT, dht_kwargs

A_PEER_ID = "12D3KooWMgLAsHqV95yhKK1Chk3q2GRsUsfnukFcEN4U5RqpfDt5"


def test_default_listens_on_all_interfaces_on_a_fixed_port():
    kwargs = dht_kwargs(NetworkConfig())
    assert kwargs["host_maddrs"] == [f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}"]
    assert "announce_maddrs" not in kwargs
    announced = dht_kwargs(NetworkConfig(announce_ip="203.0.113.7", host_port=4000))
    assert announced["announce_maddrs"] == ["/ip4/203.0.113.7/tcp/4000"]
    assert dht_kwargs(NetworkConfig(host_ip="::"))["host_maddrs"] == [f"/ip6/::/tcp/{DEFAULT_PORT}"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("garbage", "not a valid multiaddr"),
        ("/ip4/1.2.3/tcp/5/p2p/" + A_PEER_ID, "not a valid multiaddr"),
        ("/ip4/127.0.0.1/tcp/31337", "no /p2p/"),
    ],
)
def test_malformed_initial_peer_is_explained(bad, message):
    with pytest.raises(NetworkConfigError, match=message):
        parse_initial_peer(bad)
    with pytest.raises(NetworkConfigError):
        dht_kwargs(NetworkConfig(initial_peers=[bad]))


def test_bad_host_values_are_explained():
    with pytest.raises(NetworkConfigError, match="--host-ip"):
        dht_kwargs(NetworkConfig(host_ip="localhost:80"))
    with pytest.raises(NetworkConfigError, match="fixed --host-port"):
        dht_kwargs(NetworkConfig(announce_ip="203.0.113.7", host_port=0))


def test_unreachable_bootstrap_peer_gives_a_bootstrap_error():
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{A_PEER_ID}"
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="None of the initial peers answered"):
        start_dht(NetworkConfig(initial_peers=[dead], host_ip="127.0.0.1", host_port=0, startup_timeout=20))
    assert time.monotonic() - t0 < 120  # bounded: it gave up by itself


def test_identity_file_keeps_the_peer_id_across_restarts(tmp_path):
    config = NetworkConfig(host_ip="127.0.0.1", host_port=0, identity_path=tmp_path / "sub" / "identity.key")
    ids = []
    for _ in range(2):
        dht = start_dht(config)
        ids.append(dht.peer_id.to_base58())
        dht.shutdown()
    assert ids[0] == ids[1]
    assert (tmp_path / "sub" / "identity.key").exists()


def test_a_peer_without_an_identity_file_leaves_no_temporary_key_behind(tmp_path, monkeypatch):
    """A new key is made in a temporary folder for p2pd to read at its start; the folder goes once it is up
    (a CI run of peers that exit with os._exit once left hundreds of them in /tmp)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dht = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0))
    try:
        assert dht.peer_id.to_base58().startswith("Qm")  # an RSA key: the one made here, not an Ed25519 default
        assert not list(tmp_path.glob("swarm-identity-*"))
    finally:
        dht.shutdown()
