"""Stage slack: Megatron-LM + Perseus's energy saving against the pipeline's stage imbalance.

    python bench/stage_slack.py [--rerun] [--results bench/results/stage_slack.json] [--json]

At maximum throughput Perseus saves energy only by slowing what is off the critical path; on a
two-stage 1F1B pipeline that is mostly the faster stage's idle time in every step, so its saving
grows with the stages' imbalance. The testbed split its stages "as balanced as possible" by hand
(paper section 6.1) with its own measurements; the split it chose is not published. For every
testbed row with a measured Megatron-LM + Perseus energy reduction, this plans every stage split
from Megatron-LM's even one to the preset's balanced one (one layer at a time) and prints:

- the faster stage's idle share at the maximum clock, ``1 - min/max`` of the stages' Megatron-LM
  forward + backward time of one microbatch (the slack Perseus can slow into);
- our Megatron-LM + Perseus maximum-throughput energy reduction on that split;
- the paper's measured reduction, and the idle share at which ours would equal it (linear
  interpolation between the two splits that bracket it; None outside the planned range).

The interpolated idle share is a diagnostic of the pipeline the testbed must have run, not a fit:
nothing here changes a parameter or a preset. Every "ours" number is a cost-model prediction of the
simulated A100-SXM4-40GB; the Qwen rows are validation data.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate_end_to_end import csv_number, labelled_testbed_rows

from kareus_fx.plan.planner import make_plan
from kareus_fx.plan.request import plan_request_from_preset

DEFAULT_RESULTS = Path(__file__).parent / "results" / "stage_slack.json"


def testbed_rows() -> list[dict]:
    """Rows with a measured Megatron-LM + Perseus energy reduction (percent), calibration first."""
    return [
        {"preset": row["preset"], "data": row["data"], "paper_mp_energy_red_pct": csv_number(row["mp_energy_red"])}
        for row in labelled_testbed_rows()
        if csv_number(row["mp_energy_red"]) is not None
    ]


def idle_share(megatron_options: dict) -> float:
    """The faster stage's idle share at the maximum clock: ``1 - min/max`` of the stages' forward +
    backward time (each instruction's fastest option: Megatron-LM runs the maximum clock)."""
    per_stage: dict[int, float] = {}
    for (stage, _instruction), options in megatron_options.items():
        per_stage[stage] = per_stage.get(stage, 0.0) + min(o.time_s for o in options)
    return 1.0 - min(per_stage.values()) / max(per_stage.values())


def plan_split(preset: str, stage_layers: tuple[int, ...] | str) -> dict:
    """One split's stage layers, idle share and Megatron-LM + Perseus energy reduction (percent)."""
    started = time.perf_counter()
    outcome = make_plan(plan_request_from_preset(preset, stage_layers=stage_layers), progress=False)
    reduction = outcome.data["methods"]["megatron+perseus"]["metrics"]["max_throughput_energy_reduction"]
    return {
        "stage_layers": outcome.data["workload"]["stage_layers"],
        "idle_share_pct": 100.0 * idle_share(outcome.iteration["megatron"].options),
        "ours_mp_energy_red_pct": 100.0 * reduction,
        "wall_s": time.perf_counter() - started,
    }


def splits_between(even: list[int], balanced: list[int]) -> list[tuple[int, int]]:
    """Two-stage splits from ``even`` to ``balanced``, one layer moved at a time (both included)."""
    if len(even) != 2 or len(balanced) != 2:
        raise ValueError(f"two pipeline stages expected, got {even} and {balanced}")
    total = sum(even)
    step = 1 if balanced[0] >= even[0] else -1
    return [(first, total - first) for first in range(even[0], balanced[0] + step, step)]


def matching_idle_share(points: list[dict], paper_pct: float) -> float | None:
    """The idle share at which ours equals ``paper_pct``, interpolated between bracketing splits."""
    ordered = sorted(points, key=lambda p: p["idle_share_pct"])
    for a, b in itertools.pairwise(ordered):
        lo, hi = sorted((a["ours_mp_energy_red_pct"], b["ours_mp_energy_red_pct"]))
        if lo <= paper_pct <= hi and hi > lo:
            w = (paper_pct - a["ours_mp_energy_red_pct"]) / (b["ours_mp_energy_red_pct"] - a["ours_mp_energy_red_pct"])
            return a["idle_share_pct"] + w * (b["idle_share_pct"] - a["idle_share_pct"])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--rerun", action="store_true", help="plan again even if the results file has the split")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    stored = json.loads(args.results.read_text()) if args.results.exists() and not args.rerun else {}
    plans: dict = dict(stored.get("plans", {}))
    report = []
    for row in testbed_rows():
        preset = row["preset"]
        per_preset = plans.setdefault(preset, {})
        for rule in ("even", "balanced"):
            if rule not in per_preset:
                print(f"planning {preset} ({rule}) ...", file=sys.stderr, flush=True)
                per_preset[rule] = plan_split(preset, rule)
        for split in splits_between(per_preset["even"]["stage_layers"], per_preset["balanced"]["stage_layers"]):
            key = ",".join(map(str, split))
            if key not in per_preset and list(split) not in (
                per_preset["even"]["stage_layers"],
                per_preset["balanced"]["stage_layers"],
            ):
                print(f"planning {preset} ({key}) ...", file=sys.stderr, flush=True)
                per_preset[key] = plan_split(preset, split)
        points = sorted(per_preset.values(), key=lambda p: p["stage_layers"])
        unique = list({tuple(p["stage_layers"]): p for p in points}.values())
        report.append(
            {
                **row,
                "splits": [
                    {k: p[k] for k in ("stage_layers", "idle_share_pct", "ours_mp_energy_red_pct")} for p in unique
                ],
                "idle_share_pct_matching_paper": matching_idle_share(unique, row["paper_mp_energy_red_pct"]),
                "balanced_idle_share_pct": per_preset["balanced"]["idle_share_pct"],
            }
        )
    result = {
        "note": "ours: simulated A100-SXM4-40GB (cost model); paper: measured on 16 A100-SXM4-40GB",
        "plans": plans,
        "rows": report,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(
        "Megatron-LM + Perseus max-throughput energy reduction against the faster stage's idle share "
        "(ours: simulated; paper: measured)"
    )
    for r in report:
        cells = "  ".join(
            f"{'+'.join(map(str, s['stage_layers']))}: idle {s['idle_share_pct']:4.1f} % -> "
            f"{s['ours_mp_energy_red_pct']:4.1f} %"
            for s in r["splits"]
        )
        match = r["idle_share_pct_matching_paper"]
        print(
            f"  {r['preset']:32s} paper {r['paper_mp_energy_red_pct']:4.1f} %  {cells}  "
            f"paper's at idle {'n/a' if match is None else f'{match:.1f} %'}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
