"""Score forced-download bad-donor invocations from their kept files (the benchmark was stopped before it wrote its
JSON): per invocation, the honest peers' end loss per scenario, ratios, joiners, bans and re-syncs.

Run from the repository root: ``python benchmarks/results/byzantine-donor-states/score.py WORKDIR...``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.byzantine_logs import _joiner, _lines, _peer_id, _rounds  # noqa: E402

SCENARIOS = (  # (folder, honest peers, the liar's index)
    ("honest-mean", [0, 1, 2], None),
    ("honest-centered-clip-late", [0, 1, 2], None),
    ("baddonor-centered-clip", [0, 1], 2),
)
JOINERS = (3, 4, 5)


def score(wd: Path, honest: list[int], liar_index: int | None) -> dict | None:
    files = [wd / f"peer{i}.result.json" for i in honest]
    if not all(f.exists() for f in files):
        return None
    results = [json.loads(f.read_text()) for f in files]
    liar = _peer_id(wd / f"peer{liar_index}.log") if liar_index is not None else None
    joiners = [_joiner(i, wd, None, liar, len(honest)) for i in JOINERS if (wd / f"peer{i}.jsonl").exists()]
    logs = [line for i in [*honest, *JOINERS] for line in _lines(wd / f"peer{i}.log")]
    liar_log = _lines(wd / f"peer{liar_index}.log") if liar_index is not None else []
    return dict(
        loss=sum(r["eval_loss_end"] for r in results) / len(results),
        resyncs=sum(1 for i in honest for r in _rounds(wd / f"peer{i}.jsonl") if r.get("resynced")),
        # per joiner: states downloaded, replays, honest_state, first_round_held, from the liar, liar's refused
        joiners=[
            (
                len(j["loaded"]),
                j["replayed"],
                j["honest_state"],
                j["first_round_held"],
                j["from_liar"],
                j["refused_liar"],
            )
            for j in joiners
        ],
        banned=[line for line in logs if line.startswith("banned peer")],
        refused_bad_states=sum(1 for line in logs if "served a bad state" in line),
        liar_served=sum(1 for line in liar_log if line.startswith("baddonor: served")) if liar_index else None,
    )


def main() -> None:
    out = []
    for root in map(Path, sys.argv[1:]):
        found = {name: score(root / name, honest, liar) for name, honest, liar in SCENARIOS if (root / name).exists()}
        found = {name: v for name, v in found.items() if v is not None}
        base = found.get("honest-mean", {}).get("loss")
        late = found.get("honest-centered-clip-late", {}).get("loss")
        for v in found.values():
            v["to_honest_mean"] = round(v["loss"] / base, 4) if base else None
            v["to_late"] = round(v["loss"] / late, 4) if late else None
        out.append(dict(workdir=str(root), scenarios=found))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
