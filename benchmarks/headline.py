"""The headline figures, gathered from the benchmarks' results into ``benchmarks/results/headline.json``.

Each figure names the result file and the entry it came from, so it can be traced to
the run (and the command) that measured it. Run after the benchmarks:
``python -m benchmarks.headline``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.common import RESULTS_DIR, print_table

OVERLAP_MODE = "eager"  # the overlapped variant the client runs (see docs/benchmarks.md)


# where each benchmark's run for the headline writes: apart from the benchmarks' default runs (which
# docs/benchmarks.md describes too), with --out <results>/<name>-overlap
SOURCES = {
    # under the tiny preset's outer settings (plain averaging); with the robust mean too (the manifest's default
    # aggregation), and the paper's outer settings as one more variant
    "convergence": "convergence-plain/convergence.json",
    # the client's stand-in (averaging.stand_in=share, from the raw pseudo-gradient) landing 1 and 5 steps late, and
    # blocking fp4, under the same settings
    "stand_in": "convergence-rawstandin/convergence.json",
    # the client's overlap landing 1 step late, with the inner optimizer's moments kept and forgotten (what the
    # client does now), over five seeds: benchmarks.seeds over one convergence run per seed and variant
    "seeds": "convergence-moments-seeds/seeds.json",
    # the same five seeds on this project's own machine and corpus (the first were a lent machine's, Python 3.12's
    # standard library), one torch thread each, with the fitted stand-in (standin=fit) beside the client's
    "seeds_here": "convergence-fit-seeds/seeds.json",
    # the client's overlap (share, forget) landing 2, 5 and 10 steps late (10: at the next round's end), and the fitted
    # stand-in at 5, over the same five seeds here; the blocking FP32 runs are seeds_here's, copied in
    "delays": "convergence-delay-seeds/seeds.json",
    # benchmarks.walltime over that folder and the wan run: held-out loss at equal wall time on each link
    "walltime": "convergence-delay-seeds/walltime.json",
    "wan": "wan-overlap/wan.json",
    # the client's default since --nice (training at nice 10), with --nice 0 beside it in the same run, and
    # benchmarks.walltime over convergence-delay-seeds with that run's utilizations
    "nice": "wan-nice/wan.json",
    "nice_walltime": "wan-nice/walltime.json",
    "churn": "churn-overlap/churn.json",
    # each mode with the reducers' audits on (the default) and off, side by side in one run: what checking costs
    "audit_cost": "wan-audit-cost/wan.json",
    # audits of every part, of a sample of each slice's parts (averaging.audit_parts) and none, in one run
    "audit_sampled": "wan-audit-sampled/wan.json",
    # blocking fp4 against blocking FP32 over seeds, under tiny's plain averaging and the 150m/1b presets' Nesterov
    "fp4_seeds": "convergence-fp4-blocking-seeds/seeds.json",
    # the steps taken from the stand-in damped by half when the average lands (averaging.in_flight_steps_kept=0.5)
    # at lags of 1, 2 and 5 steps, and Streaming DiLoCo's merge at 5, over the seeds that ran; blocking FP32 and
    # the client's share+forget copied in from convergence-fit-seeds and convergence-delay-seeds
    "damped": "convergence-merge/seeds.json",
    # the client's defaults since (overlapped fp4, in-flight steps damped from 2 steps late) landing 2 steps late,
    # on fresh seeds under a rule fixed before the runs (convergence-merge/plan.txt): the key
    "fresh": "convergence-fresh-seeds/seeds.json",
    # the same default under the 150m/1b presets' Nesterov outer step, fresh seeds 5-7 (convergence-nesterov-seeds/
    # plan.txt: reported only, no default rode on it)
    "fresh_nesterov": "convergence-nesterov-damped/seeds.json",
}
DEFAULT_OVERLAP = f"diloco-h10-fp4-{OVERLAP_MODE}2-share-forget-keep0.5"  # the client's default, 2 steps late


DELAYS = (1, 2, 5, 10)  # the lags convergence-delay-seeds simulated, in inner steps of H = 10
LINKS = {None: "unlimited", 100.0: "100mbit", 10.0: "10mbit"}


def put_lag(put, wan: dict | None, walltime: dict | None) -> None:
    """How late the overlapped averages landed in the wan run with the training reniced (and at --nice 0 beside it),
    and the loss at equal wall time there, read at the simulated lag nearest at or above the measured mean."""
    if wan is None:
        return
    for mode, suffix in (("fp4-overlap", ""), ("fp4-overlap-nice0", "_nice0")):
        for phase in wan["figures"].get(mode, []):
            label = LINKS.get(phase["rate_mbit"])
            if label is not None and phase.get("steps_late") is not None:
                put(f"overlap_steps_late_{label}{suffix}", phase["steps_late"], f"{SOURCES['nice']} figures[{mode}]")
    for phase in wan["figures"].get("fp4-overlap", []) if walltime is not None else []:
        label, lag = LINKS.get(phase["rate_mbit"]), phase.get("steps_late")
        if label is None or lag is None:
            continue
        variant = f"diloco-h10-fp4-{OVERLAP_MODE}{next((d for d in DELAYS if d >= lag), DELAYS[-1])}-share-forget"
        link = next((x for x in walltime["runs"].get(variant, []) if x["rate_mbit"] == phase["rate_mbit"]), None)
        if link is not None:
            seeds = len(link["per_seed"])
            source = f"{SOURCES['nice_walltime']} runs[{variant}] @ {label}, lag {lag:.2f}, {seeds} seeds"
            put(f"loss_ratio_overlap_4bit_vs_blocking_equal_time_{label}_measured_lag", link["mean_ratio"], source)


def _audit_cells(wan: dict, other: str):
    """Per link and mode (blocking FP16, overlapped fp4): (rate, label, key, mode, that mode's phase, its
    ``-other``'s)."""
    for rate, label in LINKS.items():
        for mode, key in (("fp16", "blocking_fp16"), ("fp4-overlap", "overlap")):
            yield rate, label, key, mode, _phase(wan, mode, rate), _phase(wan, f"{mode}-{other}", rate)


def put_audit_cost(put, wan: dict | None) -> None:
    """What the checked reducers' audits cost on each link: utilization with them over without them (both modes),
    and for blocking FP16 their share of the all-reduce's seconds and the bytes on the wire with them over without."""
    if wan is None:
        return
    source = SOURCES["audit_cost"]
    for _, label, key, mode, checked, unchecked in _audit_cells(wan, "unchecked"):
        if checked is None or unchecked is None:
            continue
        where = f"{source} figures[{mode}] / figures[{mode}-unchecked] @ {label}"
        put(
            f"utilization_ratio_checked_vs_unchecked_{label}_{key}",
            checked["utilization"] / unchecked["utilization"],
            where,
        )
        if mode == "fp16":
            share = checked["audit_seconds"] / checked["seconds"]["allreduce"]
            put(f"audit_share_of_allreduce_{label}_{key}", share, f"{source} figures[{mode}] @ {label}")
            wire = checked["wire_tx_bytes"] / unchecked["wire_tx_bytes"]
            put(f"wire_tx_ratio_checked_vs_unchecked_{label}_{key}", wire, where)


def put_sampled_audits(put, wan: dict | None) -> None:
    """What auditing a sample of each slice's parts saves: its audit downloads over those of audits of every part,
    and each mode's utilization over the same mode's without audits, per link."""
    if wan is None:
        return
    source = SOURCES["audit_sampled"]
    for rate, label, key, mode, whole, sampled in _audit_cells(wan, "sampled"):
        unchecked = _phase(wan, f"{mode}-unchecked", rate)
        if whole is None or sampled is None:
            continue
        where = f"{source} figures[{mode}-sampled] / figures[{mode}] @ {label}"
        if whole.get("audit_bytes"):
            put(f"audit_bytes_ratio_sampled_vs_all_{label}_{key}", sampled["audit_bytes"] / whole["audit_bytes"], where)
        if unchecked is not None:
            where = f"{source} figures[{mode}-sampled] / figures[{mode}-unchecked] @ {label}"
            put(
                f"utilization_ratio_sampled_vs_unchecked_{label}_{key}",
                sampled["utilization"] / unchecked["utilization"],
                where,
            )


def _load(out: Path, name: str) -> dict | None:
    path = out / SOURCES.get(name, f"{name}.json")
    return json.loads(path.read_text()) if path.exists() else None


def _phase(wan: dict, mode: str, rate: float | None) -> dict | None:
    return next((ph for ph in wan["figures"].get(mode, []) if ph["rate_mbit"] == rate), None)


def gather(out: Path) -> dict:
    figures: dict[str, dict] = {}

    def put(key: str, value, source: str) -> None:
        figures[key] = dict(value=value, source=source)

    wan = _load(out, "wan")
    if wan is not None:
        for rate, label in ((10.0, "10mbit"), (100.0, "100mbit")):
            for mode, key in (("fp4-overlap", "overlap"), ("fp16", "blocking_fp16")):
                phase = _phase(wan, mode, rate)
                if phase is not None:
                    put(
                        f"utilization_{label}_{key}",
                        phase["utilization"],
                        f"{SOURCES['wan']} figures[{mode}] @ {rate} Mbit/s",
                    )
        for mode, key in (("fp4-overlap", "4bit"), ("sparse-overlap", "sparse")):
            values = [ph["bytes_per_param"] for ph in wan["figures"].get(mode, []) if ph.get("bytes_per_param")]
            if values:
                put(
                    f"bytes_per_param_per_round_{key}",
                    statistics.fmean(values),
                    f"{SOURCES['wan']} figures[{mode}], all phases",
                )
    convergence = _load(out, "convergence")
    if convergence is not None:
        ratios = convergence["ratios"]
        for variant, key in (
            (f"diloco-h10-fp4-{OVERLAP_MODE}5", "loss_ratio_overlap_4bit_own_5_steps_late_vs_blocking_fp32"),
            (f"diloco-h10-sparse-{OVERLAP_MODE}5", "loss_ratio_overlap_sparse_vs_blocking_fp32"),
            (f"diloco-h10-fp32-{OVERLAP_MODE}5", "loss_ratio_overlap_fp32_vs_blocking_fp32"),
            (f"diloco-h10-fp4-{OVERLAP_MODE}5-robust", "loss_ratio_overlap_4bit_robust_vs_blocking_fp32"),
            (f"diloco-h10-sparse-{OVERLAP_MODE}5-robust", "loss_ratio_overlap_sparse_robust_vs_blocking_fp32"),
            ("diloco-h10-fp32-outer0.7m0.9", "loss_ratio_paper_outer_vs_preset_outer"),
        ):
            entry = ratios.get(f"{variant}/diloco-h10-fp32")
            if entry is not None:
                put(key, entry["eval_loss_ratio"], f"{SOURCES['convergence']} ratios[{variant}/diloco-h10-fp32]")
    stand_in = _load(out, "stand_in")
    if stand_in is not None:
        for variant, key in (
            (f"diloco-h10-fp4-{OVERLAP_MODE}5-share", "loss_ratio_overlap_4bit_share_vs_blocking_fp32"),
            (f"diloco-h10-fp4-{OVERLAP_MODE}1-share", "loss_ratio_overlap_4bit_share_1_step_late_vs_blocking_fp32"),
            ("diloco-h10-fp4", "loss_ratio_blocking_4bit_vs_blocking_fp32"),
        ):
            entry = stand_in["ratios"].get(f"{variant}/diloco-h10-fp32")
            if entry is not None:
                put(key, entry["eval_loss_ratio"], f"{SOURCES['stand_in']} ratios[{variant}/diloco-h10-fp32]")

    def put_means(name: str, record: dict | None, pairs: list[tuple[str, str]]) -> None:
        """Each (variant, key): the variant's mean end ratio over the seeds of a ``benchmarks.seeds`` record."""
        for variant, key in pairs:
            entry = record["variants"].get(variant) if record is not None else None
            if entry is not None:
                put(key, entry["mean_end"], f"{SOURCES[name]} variants[{variant}] mean_end over {entry['seeds']} seeds")

    seeds = _load(out, "seeds")
    put_means("seeds", seeds, [
        (f"diloco-h10-fp4-{OVERLAP_MODE}1-share", "loss_ratio_overlap_4bit_1_step_late_moments_kept_mean_of_seeds"),
        (f"diloco-h10-fp4-{OVERLAP_MODE}1-share-forget", "loss_ratio_overlap_4bit_1_step_late_mean_of_seeds"),
    ])  # fmt: skip
    here = _load(out, "seeds_here")
    if here is not None:
        forget = f"diloco-h10-fp4-{OVERLAP_MODE}1-share-forget"
        put_means("seeds_here", here, [
            (forget, "loss_ratio_overlap_4bit_1_step_late_mean_of_seeds_this_machine"),
            (f"diloco-h10-fp4-{OVERLAP_MODE}1-fit-forget", "loss_ratio_overlap_4bit_1_step_late_fitted_mean_of_seeds"),
        ])  # fmt: skip
        runs = [
            r["end"] for record in (seeds, here) if record is not None
            for r in record["variants"].get(forget, {}).get("per_seed", {}).values()
        ]  # fmt: skip
        if runs and seeds is not None:
            source = f"{SOURCES['seeds']} and {SOURCES['seeds_here']} variants[{forget}] per_seed end, {len(runs)} runs"
            put("loss_ratio_overlap_4bit_1_step_late_mean_of_all_seeds", sum(runs) / len(runs), source)
    late = [(f"{d}-share-forget", f"{d}_steps_late_mean_of_seeds") for d in (2, 5, 10)] + [
        ("5-fit-forget", "5_steps_late_fitted_mean_of_seeds")
    ]
    put_means("delays", _load(out, "delays"), [
        (f"diloco-h10-fp4-{OVERLAP_MODE}{v}", f"loss_ratio_overlap_4bit_{k}") for v, k in late
    ])  # fmt: skip
    walltime = _load(out, "walltime")
    if walltime is not None:
        # landing a whole round late: decided when the lag was estimated at 7-8 steps (measured later: 3-5)
        variant = f"diloco-h10-fp4-{OVERLAP_MODE}10-share-forget"
        for link in walltime["runs"].get(variant, []):
            label = {10.0: "10mbit", 100.0: "100mbit"}.get(link["rate_mbit"])
            if label is not None:
                source = (
                    f"{SOURCES['walltime']} runs[{variant}] @ {link['rate_mbit']} Mbit/s, {len(link['per_seed'])} seeds"
                )
                put(f"loss_ratio_overlap_4bit_vs_blocking_equal_time_{label}", link["mean_ratio"], source)
    put_lag(put, _load(out, "nice"), _load(out, "nice_walltime"))
    put_audit_cost(put, _load(out, "audit_cost"))
    put_sampled_audits(put, _load(out, "audit_sampled"))
    put_means("fp4_seeds", _load(out, "fp4_seeds"), [
        ("diloco-h10-fp4", "loss_ratio_blocking_4bit_vs_blocking_fp32_mean_of_seeds"),
        ("diloco-h10-fp4-outer0.7m0.9", "loss_ratio_blocking_4bit_vs_blocking_fp32_nesterov_mean_of_seeds"),
    ])  # fmt: skip
    half_kept = [
        (f"diloco-h10-fp4-{OVERLAP_MODE}{d}-share-forget-keep0.5", f"loss_ratio_overlap_4bit_{lag}_late_half_kept")
        for d, lag in ((1, "1_step"), (2, "2_steps"), (5, "5_steps"))
    ]
    merged = ("diloco-h10-fp4-merge5-mix0.5", "loss_ratio_overlap_4bit_5_steps_late_merge")
    put_means("damped", _load(out, "damped"), [(v, f"{k}_mean_of_seeds") for v, k in (*half_kept, merged)])
    put_means("fresh", _load(out, "fresh"), [(DEFAULT_OVERLAP, "loss_ratio_overlap_4bit_vs_blocking_fp32")])
    put_means("fresh_nesterov", _load(out, "fresh_nesterov"), [
        (DEFAULT_OVERLAP.replace("-share", "-outer0.7m0.9-share"), "loss_ratio_overlap_4bit_vs_blocking_fp32_nesterov")
    ])  # fmt: skip
    churn = _load(out, "churn")
    if churn is not None:
        join = next((j for j in churn["joins"] if j["rate_mbit"] == 10.0), None)
        if join is not None:
            put(
                "joiner_10mbit_first_averaged_round_s",
                join["to_first_averaged_round"],
                f"{SOURCES['churn']} joins @ 10 Mbit/s",
            )
    slow = _load(out, "slowpeer")
    if slow is not None:
        put("slow_peer_share_of_rounds_averaged", slow["slow_peer_share_of_rounds_averaged"], "slowpeer.json")
        put("slow_peer_speed_ratio", slow["speed_ratio_fast_over_slow"], "slowpeer.json")
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.headline", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    figures = gather(args.out)
    headline = {key: entry["value"] for key, entry in figures.items()}
    headline["sources"] = {key: entry["source"] for key, entry in figures.items()}
    (args.out / "headline.json").write_text(json.dumps(headline, indent=2) + "\n")
    print_table("headline", ["figure", "value", "from"], [(k, v["value"], v["source"]) for k, v in figures.items()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
