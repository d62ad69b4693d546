import hashlib
import json

import pytest
from diloco_helpers import tiny_manifest
from pydantic import ValidationError

from swarm import DatasetSpec, ManifestError, RunManifest, TokenizerSpec
from swarm.manifest import RUN_ID_LENGTH, SLOWEST_LINK_MBIT, AveragingSpec, DatasetSource, TokenizerKind


def test_run_id_is_a_stable_hash_of_the_canonical_manifest():
    a, b = tiny_manifest(), tiny_manifest()
    assert a.run_id == b.run_id and len(a.run_id) == 16
    reordered = json.dumps(json.loads(a.canonical_json()), indent=2, sort_keys=False)
    assert RunManifest.from_json(reordered).run_id == a.run_id


@pytest.mark.parametrize("change", [dict(inner_steps=5), dict(seq_len=32), dict(init_seed=7), dict(name="other")])
def test_any_change_gives_another_run_id(change):
    base = tiny_manifest()
    changed = base.model_copy(update=change)
    assert RunManifest.from_json(changed.canonical_json()).run_id != base.run_id


def test_nested_hyperparameters_change_the_run_id():
    base = tiny_manifest()
    changed = base.model_copy(update=dict(averaging=AveragingSpec(compression="none")))
    assert changed.run_id != base.run_id


def test_manifest_fetched_with_a_wrong_run_id_is_refused():
    manifest = tiny_manifest()
    assert RunManifest.from_record(manifest.run_id, manifest.canonical_json()) == manifest
    tampered = json.loads(manifest.canonical_json())
    tampered["outer"]["lr"] = 10.0
    with pytest.raises(ManifestError, match="tampered"):
        RunManifest.from_record(manifest.run_id, json.dumps(tampered))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(seq_len=-1), "seq_len"),
        (lambda d: d.update(model={"hidden_size": 8}), "model_type"),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d["averaging"].update(compression="int3"), "compression"),
        (lambda d: d["averaging"].update(matchmaking_time=100.0), "matchmaking_time"),
    ],
)
def test_invalid_manifest_gives_a_clear_error(mutate, message):
    data = json.loads(tiny_manifest().canonical_json())
    mutate(data)
    with pytest.raises(ManifestError, match=message):
        RunManifest.from_json(json.dumps(data))


def test_an_averaging_attempt_is_bounded_by_its_timeouts_and_the_audits_double_the_all_reduce():
    spec = AveragingSpec(matchmaking_timeout=15.0, allreduce_timeout=20.0)
    assert spec.checked_reducers and spec.attempt_limit(1000) == 15.0 + 2 * 20.0 + spec.ending_seconds(1000)
    unchecked = AveragingSpec(matchmaking_timeout=15.0, allreduce_timeout=20.0, checked_reducers=False)
    assert unchecked.attempt_limit(1000) == 15.0 + 20.0 + unchecked.ending_seconds(1000)
    # the averager's ending past the all-reduce's limit (a write into the buffers begun by then is never cut): 10 s,
    # and per value its decoding and its bytes on a slow disk
    assert spec.ending_seconds(0) == 10 and spec.ending_seconds(10**9) > spec.ending_seconds(10**8) > 10


def test_bounds_on_transfers_leave_time_for_their_payload_at_the_slowest_link():
    """120 s never let a ``1b`` group on a home link finish its all-reduce (about 880 s of fp4 payload each way at
    10 Mbit/s), nor a joiner on less than 115 Mbit/s download a ``150m`` state."""
    from client.model import manifest_parameters
    from client.presets import build_manifest

    sizes = {name: manifest_parameters(build_manifest(name)) for name in ("tiny", "150m", "1b")}
    avg = {name: build_manifest(name).averaging for name in sizes}
    link = SLOWEST_LINK_MBIT * 125_000  # bytes a second
    # tiny: the manifest's timeouts bound everything, as before
    assert avg["tiny"].allreduce_seconds(sizes["tiny"]) == avg["tiny"].allreduce_timeout == 30.0
    assert avg["tiny"].attempt_limit(sizes["tiny"]) == 30.0 + 2 * 30.0 + avg["tiny"].ending_seconds(sizes["tiny"])
    assert avg["tiny"].transfer_timeout(8 * sizes["tiny"]) == 30.0
    for name in ("150m", "1b"):
        spec, numel = avg[name], sizes[name]
        payload = 2 * numel * spec.compression.wire_bytes / link  # each way, at most, in a butterfly all-reduce
        assert spec.allreduce_seconds(numel) == payload > spec.allreduce_timeout, name
        ending = spec.ending_seconds(numel)  # 16 s for 150m's fp4 average, 43 s for 1b's
        assert spec.allreduce_limit(numel) == 2 * payload and spec.attempt_limit(numel) == 60 + 2 * payload + ending
        assert 10 < ending < 60
        assert spec.merge_limit(numel) == 2 * payload + spec.merge_timeout + payload
        assert spec.transfer_timeout(8 * numel) == 8 * numel / link  # the state a joiner downloads
        assert spec.update_timeout(numel) == max(spec.allreduce_timeout, numel * spec.compression.wire_bytes / link)
    assert 800 < avg["1b"].allreduce_seconds(sizes["1b"]) < 1000 and 150 < avg["150m"].allreduce_seconds(sizes["150m"])
    assert avg["1b"].update_timeout(sizes["1b"]) > 400  # 550 MB at 10 Mbit/s
    # the averager gets the same bounds as the host
    from swarm.averager.process import averager_options

    options = averager_options(avg["1b"], sizes["1b"])
    assert options["allreduce_timeout"] == avg["1b"].allreduce_limit(sizes["1b"])
    assert options["audit_timeout"] == avg["1b"].allreduce_seconds(sizes["1b"]) / 2


def test_the_averagers_options_follow_the_manifest():
    from swarm.averager.codecs import CODECS
    from swarm.averager.process import averager_options

    checked = averager_options(AveragingSpec(allreduce_timeout=40.0, matchmaking_time=10.0, compression="fp4"), 1000)
    # the audits get half the all-reduce's time, and re-checking accusations the other half: on top of it
    assert checked["allreduce_timeout"] == 80.0 and checked["audit_timeout"] == 20.0 and checked["audit"] is True
    # the same bound the host's attempt_limit adds up, so the host never gives up before the averager does
    assert checked["allreduce_timeout"] == AveragingSpec(allreduce_timeout=40.0).allreduce_limit(1000)
    assert checked["request_timeout"] == 3.0  # a join request never waits longer, however long the window
    assert checked["compression"] is CODECS["fp4"]
    assert checked["allow_state_sharing"] is False  # nothing to offer before the first state is announced
    unchecked = averager_options(
        AveragingSpec(allreduce_timeout=40.0, matchmaking_time=2.0, checked_reducers=False), 1000
    )
    assert unchecked["allreduce_timeout"] == 40.0 and unchecked["audit"] is False
    assert unchecked["request_timeout"] == 1.0


PATHS = ["/etc/passwd", "../x", "~/.ssh", "./data", "/dev/zero", "data/../../etc", "a/b/c", "C:\\corpus", ".env"]
PATHS += ["corpus/", "-rf", "name\n", "x" * 97]
HUB_NAMES = ["allenai/c4", "TinyLlama/TinyLlama_v1.1", "gpt2", "wikitext", "HuggingFaceFW/fineweb-edu", "a.b-c_d/e"]


def as_received(data: dict) -> tuple[str, str]:
    """A manifest's JSON and the run id it hashes to, as a joiner gets them from the DHT: validated only there."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:RUN_ID_LENGTH], text


def test_a_local_dataset_names_no_path_built_here_or_received_from_the_swarm():
    with pytest.raises(ValidationError, match="never names a path on a peer's machine.*--data-path"):
        DatasetSpec(source="local", path="corpus/*.txt")
    local = DatasetSpec(source="local")
    assert local.source is DatasetSource.local and local.path is None
    manifest = tiny_manifest().model_copy(update=dict(dataset=local))
    assert RunManifest.from_json(manifest.canonical_json()).dataset == local  # the path-free one travels
    for path in ("/etc/passwd", "/home/ada/.ssh/id_ed25519", "corpus"):
        data = json.loads(manifest.canonical_json())
        data["dataset"]["path"] = path
        run_id, text = as_received(data)
        with pytest.raises(ManifestError, match="never names a path"):
            RunManifest.from_record(run_id, text)


@pytest.mark.parametrize("name", PATHS)
def test_a_path_is_refused_as_a_hub_dataset_or_tokenizer_name(name):
    with pytest.raises(ValidationError, match="is not a hub name"):
        DatasetSpec(source="hub", path=name)
    with pytest.raises(ValidationError, match="is not a hub name"):
        DatasetSpec(source="builtin", path=name)  # ignored there, but a manifest carries no path at all
    with pytest.raises(ValidationError, match="is not a hub name"):
        TokenizerSpec(kind="bytes", name=name)
    base = json.loads(tiny_manifest().canonical_json())
    for field, value in (("dataset", dict(source="hub", path=name)), ("tokenizer", dict(kind="auto", name=name))):
        run_id, text = as_received({**base, field: {**base[field], **value}})
        with pytest.raises(ManifestError, match="is not a hub name"):
            RunManifest.from_record(run_id, text)


@pytest.mark.parametrize("name", HUB_NAMES)
def test_hub_names_are_taken(name):
    assert DatasetSpec(source="hub", path=name).path == name
    spec = TokenizerSpec(kind="auto", name=name)
    assert spec.kind is TokenizerKind.auto and spec.name == name


def test_the_sources_are_enums_whose_manifest_words_are_unchanged():
    data = json.loads(
        tiny_manifest().model_copy(update=dict(dataset=DatasetSpec(source="hub", path="a/b"))).canonical_json()
    )
    assert data["dataset"]["source"] == "hub" and data["tokenizer"]["kind"] == "bytes"
    with pytest.raises(ValidationError, match="needs dataset.path"):
        DatasetSpec(source="hub")
    with pytest.raises(ValidationError, match="needs tokenizer.name"):
        TokenizerSpec(kind="auto")
