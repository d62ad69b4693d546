"""Publishing and finding run manifests in the DHT.

Each peer of a run re-publishes the manifest under its own signed subkey, so the
manifest outlives its creator, and a forged copy can only sit under the forger's
own key, where the hash check refuses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from swarm.dht import calls as dht_calls
from swarm.dht.records import (
    MANIFEST_TTL,
    RUNS_KEY,
    ManifestRecord,
    live_items,
    parse_record,
    run_id_of_subkey,
    run_subkey,
)
from swarm.errors import ManifestError
from swarm.manifest import RunManifest

RETRY_INTERVAL = 2.0  # seconds between reads of the runs key while it shows no run


@dataclass(frozen=True)
class RunListing:
    run_id: str
    name: str
    publishers: int


def publish_manifest(dht: hivemind.DHT, manifest: RunManifest, ttl: float = MANIFEST_TTL) -> bool:
    if not 0 < ttl <= MANIFEST_TTL:  # readers refuse a record set to live longer (``records.fresh``)
        raise ValueError(f"a manifest record lives at most {MANIFEST_TTL} s, not {ttl}")
    record = ManifestRecord(manifest_json=manifest.canonical_json(), name=manifest.name, created_at=time.time())
    subkey = run_subkey(manifest.run_id, RSASignatureValidator().local_public_key)
    return dht_calls.store(dht, RUNS_KEY, subkey, record.dict(), get_dht_time() + ttl)


def _manifest_records(dht: hivemind.DHT) -> list[tuple[str, ManifestRecord]]:
    return parse_manifests(dht_calls.get(dht, RUNS_KEY))


def parse_manifests(found: Any) -> list[tuple[str, ManifestRecord]]:
    """(run id, record) of every well-formed, unexpired manifest record in a read of the runs key; none set to
    outlive ``MANIFEST_TTL`` (``records.fresh``). A misbehaving peer's malformed ones are dropped."""
    records = []
    for subkey, value, _ in live_items(found, get_dht_time(), MANIFEST_TTL):
        run_id = run_id_of_subkey(subkey) if isinstance(subkey, bytes) else None
        record = parse_record(ManifestRecord, value) if run_id is not None else None
        if record is not None:
            records.append((run_id, record))
    return records


def list_runs(dht: hivemind.DHT) -> list[RunListing]:
    """Runs announced on this DHT whose manifest hashes to their id."""
    return _listings(_manifest_records(dht))


def _listings(records: list[tuple[str, ManifestRecord]]) -> list[RunListing]:
    by_run: dict[str, list[ManifestRecord]] = {}
    for run_id, record in records:
        try:
            RunManifest.from_record(run_id, record.manifest_json)
        except ManifestError:
            continue
        by_run.setdefault(run_id, []).append(record)
    return sorted(
        (RunListing(run_id, recs[0].name, len(recs)) for run_id, recs in by_run.items()),
        key=lambda r: (-r.publishers, r.run_id),
    )


def fetch_manifest(dht: hivemind.DHT, run_id: str) -> RunManifest:
    """The manifest of ``run_id``, verified against its hash; refuses tampered copies."""
    return _fetch(_manifest_records(dht), run_id)


def _fetch(records: list[tuple[str, ManifestRecord]], run_id: str) -> RunManifest:
    candidates = [record for rid, record in records if rid == run_id]
    if not candidates:
        known = ", ".join(f"{r.run_id} ({r.name})" for r in _listings(records)) or "none"
        raise ManifestError(
            f"No peer announces run {run_id}. Runs on this swarm: {known}. Check the run id you were given, "
            "or that the run still has live peers."
        )
    last_error: ManifestError | None = None
    for record in candidates:
        try:
            return RunManifest.from_record(run_id, record.manifest_json)
        except ManifestError as e:
            last_error = e
    assert last_error is not None
    raise last_error


def choose_run(dht: hivemind.DHT, run_id: str | None, wait: float = 0.0) -> RunManifest:
    """The run to join: ``run_id`` if given, else the only run on the DHT.

    While the DHT shows no run at all, it is read again every ``RETRY_INTERVAL`` s for up to ``wait`` s: a DHT
    that has just joined may not reach the records yet, and on a loaded host a read can time out (seen in CI:
    a container joining a host peer read "none"). Once any run is visible the answer is final, so a wrong run
    id still fails at once."""
    deadline = time.monotonic() + wait
    records = _manifest_records(dht)
    while not records and time.monotonic() + RETRY_INTERVAL <= deadline:
        time.sleep(RETRY_INTERVAL)
        records = _manifest_records(dht)
    if run_id is not None:
        return _fetch(records, run_id)
    runs = _listings(records)
    if not runs and records:  # announced, but no manifest passes: say why (a path it names, a bad hash)
        return _fetch(records, records[0][0])
    if not runs:
        raise ManifestError(
            "The initial peers answered, but no run is announced on this swarm yet. Start one with "
            "'swarm-client start', or check that you were given the right address."
        )
    if len(runs) > 1:
        listing = "; ".join(f"--run {r.run_id} ({r.name}, {r.publishers} peers)" for r in runs)
        raise ManifestError(f"This swarm hosts {len(runs)} runs; pick one with --run: {listing}.")
    return _fetch(records, runs[0].run_id)
