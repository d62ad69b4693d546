"""A malicious peer cannot overwrite others' records, store malformed ones, or serve a forged manifest."""

import json
import threading
import time

import hivemind
import pytest
from diloco_helpers import tiny_manifest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm import (
    ManifestError,
    NetworkConfig,
    choose_run,
    fetch_manifest,
    list_runs,
    publish_manifest,
    start_dht,
)
from swarm.dht.identity import peer_id_of_owner
from swarm.dht.peers import read_peers
from swarm.dht.presence import Presence
from swarm.dht.records import GLOBAL_PREFIX, RUNS_KEY, GlobalSchema, progress_key, run_subkey, run_validator


@pytest.fixture
def honest_and_attacker():
    honest = start_dht(NetworkConfig(host_ip="127.0.0.1", host_port=0))
    attacker_key = RSASignatureValidator(RSAPrivateKey())
    attacker = hivemind.DHT(
        initial_peers=[str(a) for a in honest.get_visible_maddrs()],
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[attacker_key, SchemaValidator(GlobalSchema, prefix=GLOBAL_PREFIX)],
    )
    yield honest, attacker, attacker_key.local_public_key
    attacker.shutdown()
    honest.shutdown()


def progress_value(peer_id: str, **override) -> dict:
    value = dict(
        peer_id=peer_id,
        name="n",
        device="cpu",
        epoch=3,
        inner_step=1,
        samples_per_second=1.5,
        tokens_processed=10,
        state="training",
        last_loss=2.5,
        client_mode=False,
        relayed=False,
        micro_batch=4,
        download_progress=0.0,  # hivemind's schema check wants every field present, defaults included
        checksums=[],
        accusations=[],
        time=time.time(),
    )
    value.update(override)
    return value


def test_forged_and_malformed_progress_records_are_refused(honest_and_attacker):
    honest, attacker, attacker_public = honest_and_attacker
    run_id = tiny_manifest().run_id
    for dht in (honest, attacker):
        dht.add_validators([run_validator(run_id)])
    honest_id, attacker_id = honest.peer_id.to_base58(), peer_id_of_owner(attacker_public)
    reporter = Presence(honest, run_id, progress_value(honest_id))
    reporter.start()
    honest_public = RSASignatureValidator().local_public_key
    assert peer_id_of_owner(honest_public) == honest_id  # records are signed with the libp2p identity key
    key, expiry = progress_key(run_id), get_dht_time() + 10  # readers refuse one set to outlive RECORD_TTL

    # the attacker can write under its own key: the refusals below are about forgery, not access
    assert attacker.store(key, subkey=attacker_public, value=progress_value(attacker_id), expiration_time=expiry)
    # ... but not under the honest peer's key (it cannot sign for it)
    assert not attacker.store(
        key, subkey=honest_public, value=progress_value(honest_id, epoch=999), expiration_time=expiry + 1
    )
    # ... nor a record of the wrong shape under its own key
    assert not attacker.store(
        key, subkey=attacker_public, value=progress_value(attacker_id, epoch="999"), expiration_time=expiry + 2
    )
    assert not attacker.store(
        key, subkey=attacker_public, value=progress_value(attacker_id, state="king"), expiration_time=expiry + 3
    )
    records = {e.record.peer_id: e.record for e in read_peers(honest, run_id)}
    assert set(records) == {honest_id, attacker_id}
    assert records[honest_id].epoch == 3

    # under its own key it can store a record claiming another peer's id, or a made-up one: the DHT keeps it
    # (the signature is its own), but readers drop it, since the id is not the one its key gives
    for i, posing_as in enumerate((honest_id, "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")):
        assert attacker.store(
            key, subkey=attacker_public, value=progress_value(posing_as, epoch=999), expiration_time=expiry + 5 + i
        )
        records = {e.record.peer_id: e.record for e in read_peers(honest, run_id)}
        assert set(records) == {honest_id} and records[honest_id].epoch == 3, records
    reporter.stop()


def test_forged_manifest_records_are_refused(honest_and_attacker):
    honest, attacker, attacker_public = honest_and_attacker
    manifest = tiny_manifest(name="honest-run")
    assert publish_manifest(honest, manifest)
    honest_public = RSASignatureValidator().local_public_key
    tampered = json.loads(manifest.canonical_json())
    tampered["outer"]["lr"] = 50.0
    record = dict(manifest_json=json.dumps(tampered), name="honest-run", created_at=time.time())
    expiry = get_dht_time() + 60

    # impersonating the creator is refused by the signature check
    assert not attacker.store(
        RUNS_KEY, subkey=run_subkey(manifest.run_id, honest_public), value=record, expiration_time=expiry
    )
    # under its own key the store succeeds, but the hash check refuses the content
    assert attacker.store(
        RUNS_KEY, subkey=run_subkey(manifest.run_id, attacker_public), value=record, expiration_time=expiry
    )
    assert fetch_manifest(honest, manifest.run_id) == manifest

    # a run announced only by the attacker, whose manifest does not hash to the announced id
    fake_id = "0123456789abcdef"
    assert attacker.store(RUNS_KEY, subkey=run_subkey(fake_id, attacker_public), value=record, expiration_time=expiry)
    with pytest.raises(ManifestError, match="tampered"):
        fetch_manifest(honest, fake_id)
    assert [r.run_id for r in list_runs(honest)] == [manifest.run_id]
    with pytest.raises(ManifestError, match="No peer announces run fedcba9876543210"):
        fetch_manifest(honest, "fedcba9876543210")


def test_a_joiner_that_sees_no_run_yet_reads_again_until_one_is_announced(honest_and_attacker):
    """choose_run(wait=...): a DHT showing no run at all is read again, so a run announced a moment later is found
    (a container joining a host peer once read "none" on a loaded CI machine and gave up)."""
    creator, joiner, _ = honest_and_attacker  # two DHTs with keys of their own; the second one only reads here
    manifest = tiny_manifest(name="late")
    with pytest.raises(ManifestError, match="No peer announces run"):
        choose_run(joiner, manifest.run_id)  # no wait: the empty answer is final
    announce = threading.Timer(3.0, publish_manifest, args=(creator, manifest))
    announce.start()
    try:
        assert choose_run(joiner, manifest.run_id, wait=60.0) == manifest
    finally:
        announce.join()


def test_a_joiner_without_run_id_is_told_why_the_only_announced_manifest_is_refused(monkeypatch):
    """Not "no run is announced": the run is there, and its manifest names a path on the joiner's machine."""
    from swarm.dht import registry
    from swarm.dht.records import ManifestRecord

    text = json.loads(tiny_manifest().canonical_json())
    text["dataset"] = dict(text["dataset"], source="local", path="/etc/passwd")
    record = ManifestRecord(manifest_json=json.dumps(text), name="x", created_at=1.0)
    monkeypatch.setattr(registry, "_manifest_records", lambda dht: [("0123456789abcdef", record)])
    with pytest.raises(ManifestError) as refused:
        registry.choose_run(None, None)
    assert "never names a path" in str(refused.value) and "no run is announced" not in str(refused.value)
