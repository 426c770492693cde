"""End-to-end fidelity: the simulated plans beside the paper's measured testbed results.

    python bench/validate_end_to_end.py [--json | --markdown] [--rerun | --rerun-presets P,...] [--rows calibration|validation|all]
                                        [--stage-layers even|balanced --results FILE] [--jobs N]
    python bench/validate_end_to_end.py --ablation [--rerun] [--jobs N] [--json]

For every row of the paper's testbed tables it plans the row's preset on the simulated profiler
(A100-SXM4-40GB, seed 0, ``kareus plan`` in-process) and compares each method's metrics with the
paper's measured ones, in percentage points:

- calibration rows: ``/work/shared/data/calibration/kareus_paper_testbed/llama3.2-3b.csv`` (a copy
  with its source line lives in ``cost_models/data/calibration/``); the simulator may be fitted to
  these;
- validation rows: ``/work/shared/data/validation/kareus_paper_testbed/`` (Qwen3-1.7B rows of
  tables 3, 4, 9 and 10, and table 8's ablation). Only this bench reads that folder; nothing is
  fitted to it. Without the folder the validation part is skipped (and says so).

Metric groups of the summary (``max_abs_err_pp``; ``mean_abs_err_pp`` averages every grouped cell): ``time`` = max-throughput time reduction of
N+P and Kareus; ``energy`` = max-throughput energy reduction of M+P, N+P and Kareus; ``iso`` =
iso-time energy and iso-energy time reduction of N+P and Kareus; ``ablation`` = table 8's time and
energy increases over Kareus (``ABLATION_METHODS``; "Kareus without frequency scaling" is a second
plan of the preset made with ``--max-clock-only``). ``mp_time_red`` is printed but in no group (the paper's is within
half a point of zero). ``within_target`` counts the compared cells within the target of
their group (``TARGET_PP``: 3 pp for time, energy and ablation, 5 pp for iso). NA cells (OOM or lost in the PDF extraction, or a metric our frontier does
not reach: listed in ``ours_na_where_paper_has_value``) are skipped and counted. ``kareus_not_below`` lists the rows where the paper has
Kareus >= N+P and >= M+P (time and energy) but ours does not.

``--ablation`` separates two mechanisms of the misses: every row planned with activation
recomputation ``none`` or ``full`` (``kareus plan --recompute``) and the throttled clock's swing
off (``throttle_swing_mhz`` 0: a steady clock at the cap, through ``KAREUS_SIM_PARAM_OVERRIDES``)
or on (the calibrated swing), four corners, each with the validation targets: cells within target,
mean absolute errors, table 8's increases, Table 1's testbed-over-ours iteration time
(``absolute_scale.py``) and ``kareus_not_below``. The corner ``full`` / ``on`` is the presets'
own setting, cached in ``bench/results/end_to_end.json``; the others in
``bench/results/recompute_swing/``. Each (preset, recompute) is traced once for both swings
(the stage split is the preset's, the same in every corner).

Plans are cached in ``bench/results/end_to_end.json`` (``--rerun`` plans again; ``--rerun-presets`` plans
again only the named presets and keeps the others' cached plans, so its summary mixes plans of two
versions of the code: for trying a change on a few rows, not for a results file). Every preset's
pipeline is balanced as the paper's testbed (``kareus plan --stage-layers``); ``--stage-layers even
--results FILE`` plans Megatron-LM's even split instead, for comparison. Our numbers are cost-model
predictions of a simulated GPU, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from kareus_fx.cost_models.end_to_end_fit import simulator_overrides
from kareus_fx.cost_models.paper_testbed import (
    CALIBRATION_ROWS,
    TARGET_PP,
    compare_rows,
    csv_number,
    mean_abs,
    read_rows,
)
from kareus_fx.plan.planner import make_plan, plan_traced
from kareus_fx.plan.presets import PRESETS
from kareus_fx.plan.request import plan_request_from_preset
from kareus_fx.plan.stage_tracing import trace_plan_stages

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path("/work/shared/data")
CALIBRATION_CSV = ROOT / "cost_models" / CALIBRATION_ROWS
VALIDATION_DIR = SHARED_DATA / "validation" / "kareus_paper_testbed"
VALIDATION_CSV = VALIDATION_DIR / "qwen3-1.7b.csv"
DEFAULT_RESULTS = Path(__file__).parent / "results" / "end_to_end.json"
ABLATION_DIR = Path(__file__).parent / "results" / "recompute_swing"
RECOMPUTES = ("none", "full")
SWINGS = {"off": {"throttle_swing_mhz": 0.0}, "on": {}}
"""The throttle swing's settings: ``off`` a steady clock at the cap, ``on`` the calibrated swing."""
PRESET_CORNER = ("full", "on")
"""The presets' own setting (the testbed's recompute, the calibrated simulator)."""

ABLATION_PRESET = "qwen3-1.7b-tp8-mbs8-seq4k"
MAX_CLOCK_SUFFIX = "+max-clock-only"
"""Results key suffix of a plan made with ``max_clock_only`` (``kareus plan --max-clock-only``)."""
# Table 8's variants as (results key, method) (paper section 6.4): without frequency scaling, Kareus
# planned at the maximum clock only (its kernel schedule still tuned); without kernel scheduling (SM
# allocation and launch timing) Kareus keeps the nanobatching schedule and scales frequency:
# Nanobatching + Perseus; without both: Nanobatching. Each is set against Kareus of the ordinary plan.
ABLATION_METHODS = {
    "kareus_without_frequency": (ABLATION_PRESET + MAX_CLOCK_SUFFIX, "kareus"),
    "kareus_without_kernel_schedule": (ABLATION_PRESET, "nanobatching+perseus"),
    "nanobatching": (ABLATION_PRESET, "nanobatching"),
}


def read_csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return read_rows(f)


def labelled_testbed_rows() -> list[dict[str, str]]:
    """Every testbed row, calibration then validation, each with ``data`` naming its set."""
    return [
        dict(row, data=data)
        for data, path in (("calibration", CALIBRATION_CSV), ("validation", VALIDATION_CSV))
        for row in read_csv_rows(path)
    ]


def plan_metrics(key: str, stage_layers: str | None = None) -> dict:
    """Plan one results key (a preset, or a preset + ``MAX_CLOCK_SUFFIX``) and keep its metrics;
    ``stage_layers`` overrides the preset's stage split (``kareus plan --stage-layers``)."""
    started = time.perf_counter()
    preset = key.removesuffix(MAX_CLOCK_SUFFIX)
    split = {} if stage_layers is None else {"stage_layers": stage_layers}
    outcome = make_plan(plan_request_from_preset(preset, max_clock_only=key != preset, **split), progress=False)
    return _kept(outcome.data, time.perf_counter() - started)


def _kept(data: dict, wall_s: float) -> dict:
    """What the results file keeps of a plan: every method's metrics and fastest point (time,
    energy over all GPUs: what ``absolute_scale.py`` reads), and the job's shape."""
    workload = data["workload"]
    return {
        "metrics": {m: d["metrics"] for m, d in data["methods"].items()},
        "fastest": {m: dict(zip(("time_s", "energy_j"), min(d["frontier"]))) for m, d in data["methods"].items()},
        "profiler": data["profiler"],
        "stage_layers": workload["stage_layers"],
        "recompute": workload["recompute"],
        "gpus": workload["tp"] * workload["cp"] * workload["pp"],
        "model": workload["model"],
        "microbatches": workload["microbatches"],
        "mbs": workload["mbs"],
        "seq": workload["seq"],
        "gpu": data["gpu"],
        "wall_s": wall_s,
    }


def plan_corners(preset: str, keys: list[str], corners: list[tuple[str, str]]) -> dict:
    """Plan ``keys`` (``preset`` and its ``MAX_CLOCK_SUFFIX`` key) in each (recompute, swing)
    corner, tracing ``preset`` once per recompute. Returns {corner name: {key: kept plan}}."""
    out: dict[str, dict] = {}
    for recompute in dict.fromkeys(r for r, _ in corners):
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="kareus-ablation-") as tmp:
            req, traced = trace_plan_stages(plan_request_from_preset(preset, recompute=recompute), Path(tmp) / "dumps")
            trace_s = time.perf_counter() - started
            for swing in [s for r, s in corners if r == recompute]:
                with simulator_overrides(SWINGS[swing]):
                    for key in keys:
                        t0 = time.perf_counter()
                        outcome = plan_traced(
                            dataclasses.replace(req, max_clock_only=key != preset),
                            traced,
                            Path(tmp) / f"work-{swing}",
                            progress=False,
                        )
                        kept = _kept(outcome.data, time.perf_counter() - t0 + trace_s)
                        out.setdefault(corner_name(recompute, swing), {})[key] = kept
    return out


def corner_name(recompute: str, swing: str) -> str:
    return f"recompute-{recompute}_swing-{swing}"


def corner_results(recompute: str, swing: str) -> Path:
    """Results file of one ablation corner (the presets' own corner is the default file)."""
    if (recompute, swing) == PRESET_CORNER:
        return DEFAULT_RESULTS
    return ABLATION_DIR / f"{corner_name(recompute, swing)}.json"


def _increase_pct(variant: dict, kareus: dict, kind: str) -> float:
    """A variant's fastest point against Kareus's, in percent, from their reductions against
    Megatron-LM (the same Megatron-LM in every plan of the preset: same graphs, same profiler)."""
    key = f"max_throughput_{kind}_reduction"
    return 100.0 * ((1.0 - variant[key]) / (1.0 - kareus[key]) - 1.0)


def compare_ablation(rows: list[dict[str, str]], plans: dict) -> tuple[list[dict], dict]:
    """Table 8: time and energy increase over Kareus of each ablated variant."""
    kareus = plans[ABLATION_PRESET]["metrics"]["kareus"]
    ours = {
        variant: tuple(_increase_pct(plans[key]["metrics"][method], kareus, kind) for kind in ("time", "energy"))
        for variant, (key, method) in ABLATION_METHODS.items()
    }
    cells, worst, na, compared, within = [], 0.0, 0, 0, 0
    for row in rows:
        for i, kind in enumerate(("time", "energy")):
            paper = csv_number(row[f"{kind}_increase_vs_kareus"])
            mine = ours.get(row["variant"], (None, None))[i]
            if paper is None or mine is None:
                na += 1
                cells.append(
                    {
                        "variant": row["variant"],
                        "metric": f"{kind}_increase",
                        "paper": paper,
                        "ours": mine,
                        "err_pp": None,
                    }
                )
                continue
            cells.append(
                {
                    "variant": row["variant"],
                    "metric": f"{kind}_increase",
                    "paper": paper,
                    "ours": mine,
                    "err_pp": mine - paper,
                }
            )
            worst, compared = max(worst, abs(mine - paper)), compared + 1
            within += abs(mine - paper) <= TARGET_PP["ablation"]
    return cells, {
        "rows": len(rows),
        "compared": compared,
        "max_abs_err_pp": round(worst, 2),
        "within_target": within,
        "mean_abs_err_pp": mean_abs([abs(c["err_pp"]) for c in cells if c["err_pp"] is not None]),
        "na_cells": na,
    }


def _fmt(value: float | None) -> str:
    return "NA" if value is None else f"{value:.1f}"


_SHORT = {
    "mp_time_red": "M+P t",
    "np_time_red": "N+P t",
    "kareus_time_red": "K t",
    "mp_energy_red": "M+P e",
    "np_energy_red": "N+P e",
    "kareus_energy_red": "K e",
    "np_iso_time_energy_red": "N+P iso-t e",
    "kareus_iso_time_energy_red": "K iso-t e",
    "np_iso_energy_time_red": "N+P iso-e t",
    "kareus_iso_energy_time_red": "K iso-e t",
}


def markdown(report: dict) -> str:
    """The comparison as README tables: one row per preset, ``paper / ours`` per metric (%)."""
    lines = []
    for part in ("calibration", "validation"):
        cells = report.get(f"{part}_cells")
        if not cells:
            continue
        lines += [
            f"{part} rows (paper / ours, %):",
            "",
            "| preset | " + " | ".join(_SHORT.values()) + " |",
            "|---" * (len(_SHORT) + 1) + "|",
        ]
        for preset in dict.fromkeys(c["preset"] for c in cells):
            by_metric = {c["metric"]: c for c in cells if c["preset"] == preset}
            lines.append(
                f"| {preset} | "
                + " | ".join(f"{_fmt(by_metric[m]['paper'])} / {_fmt(by_metric[m]['ours'])}" for m in _SHORT)
                + " |"
            )
        lines += ["", f"summary: `{json.dumps({k: v for k, v in report[part].items() if k != 'ablation'})}`", ""]
    if report.get("ablation_cells"):
        lines += [
            "Table 8 ablation (increase over Kareus, paper / ours, %):",
            "",
            "| variant | time | energy |",
            "|---|---|---|",
        ]
        for variant in dict.fromkeys(c["variant"] for c in report["ablation_cells"]):
            t, e = (
                next(c for c in report["ablation_cells"] if c["variant"] == variant and c["metric"] == f"{k}_increase")
                for k in ("time", "energy")
            )
            lines.append(
                f"| {variant} | {_fmt(t['paper'])} / {_fmt(t['ours'])} | {_fmt(e['paper'])} / {_fmt(e['ours'])} |"
            )
    return "\n".join(lines)


def _ablation_keys(presets: list[str]) -> dict[str, list[str]]:
    """Per preset its results keys (the table 8 preset also its ``MAX_CLOCK_SUFFIX`` key)."""
    return {p: [p, p + MAX_CLOCK_SUFFIX] if p == ABLATION_PRESET else [p] for p in dict.fromkeys(presets)}


def _plan_corners_job(job: tuple[str, list[str], list[tuple[str, str]]]) -> tuple[str, dict]:
    preset, keys, corners = job
    return preset, plan_corners(preset, keys, corners)


def corner_summary(plans: dict, calibration_rows: list, validation_rows: list, ablation_rows: list) -> dict:
    """One corner's validation targets (module docstring, ``--ablation``), over the rows planned
    in it (``rows_planned``)."""
    from absolute_scale import TABLE1, TABLE1_PRESET  # imports this module: not at the top

    planned = {
        "calibration": sum(r["preset"] in plans for r in calibration_rows),
        "validation": sum(r["preset"] in plans for r in validation_rows),
    }
    out: dict = {"rows_planned": planned}
    calibration_rows = [r for r in calibration_rows if r["preset"] in plans]
    validation_rows = [r for r in validation_rows if r["preset"] in plans]
    if not all(key in plans for key, _ in ABLATION_METHODS.values()):
        ablation_rows = []
    if calibration_rows:
        _, cal = compare_rows(calibration_rows, plans)
        out["calibration"] = {k: cal[k] for k in ("within_target", "compared", "mean_abs_err_pp", "kareus_not_below")}
    if validation_rows:
        _, val = compare_rows(validation_rows, plans)
        out["validation"] = {k: val[k] for k in ("within_target", "compared", "mean_abs_err_pp", "kareus_not_below")}
    if ablation_rows:
        cells, ablation = compare_ablation(ablation_rows, plans)
        out["table8"] = {
            f"{c['variant']} {c['metric']}": [c["paper"], None if c["ours"] is None else round(c["ours"], 2)]
            for c in cells
        }
        out["table8_within_target"] = ablation["within_target"]
    fastest = plans.get(TABLE1_PRESET, {}).get("fastest")
    if fastest is not None:
        out["table1_time_paper_over_ours"] = {m: round(row[0] / fastest[m]["time_s"], 3) for m, row in TABLE1.items()}
    return out


def run_ablation(args: argparse.Namespace, calibration_rows: list, validation_rows: list, ablation_rows: list) -> dict:
    """Plan what is missing in every (recompute, swing) corner and summarise each."""
    corners = [(r, s) for r in RECOMPUTES for s in SWINGS]
    files = {c: corner_results(*c) for c in corners}
    stored = {c: json.loads(f.read_text()) if f.exists() else {} for c, f in files.items()}
    if args.rerun:  # no corner mixes plans of two runs
        for c in corners:
            stored[c]["plans"] = {}
    # Table 8's and Table 1's presets first, then the validation rows, then the calibration rows.
    presets = [ABLATION_PRESET, "qwen3-1.7b-cp2tp4-mbs16-seq4k"] if ablation_rows else []
    presets += [r["preset"] for r in validation_rows + calibration_rows]
    # One job per (preset, recompute), both swings on one trace: the presets' own recompute
    # first (table 8's and table 1's presets before the rest), so a partial run has whole corners.
    jobs = []
    for recompute in sorted(RECOMPUTES, key=lambda r: r != PRESET_CORNER[0]):
        for preset, keys in _ablation_keys(presets).items():
            todo = [
                c
                for c in corners
                if c[0] == recompute and (args.rerun or any(k not in stored[c].get("plans", {}) for k in keys))
            ]
            if todo:
                jobs.append((preset, keys, todo))
    by_name = {corner_name(*c): c for c in corners}

    def keep(preset: str, planned: dict) -> None:
        print(f"planned {preset} in {sorted(planned)}", file=sys.stderr, flush=True)
        for name, plans in planned.items():
            corner = by_name[name]
            stored[corner].setdefault("plans", {}).update(plans)
            files[corner].parent.mkdir(parents=True, exist_ok=True)
            files[corner].write_text(json.dumps(stored[corner], indent=1, sort_keys=True))

    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
            for future in as_completed([pool.submit(_plan_corners_job, job) for job in jobs]):
                keep(*future.result())
    else:
        for job in jobs:
            keep(*_plan_corners_job(job))
    return {
        corner_name(*c): corner_summary(stored[c].get("plans", {}), calibration_rows, validation_rows, ablation_rows)
        for c in corners
    }


def ablation_markdown(summaries: dict) -> str:
    """The four corners side by side (README trust section)."""
    lines = [
        "| recompute, swing | validation within target (time / energy / iso) | mean abs err pp (validation / "
        "calibration) | table 8 energy (freq / kernel sched / nanobatching) | table 8 time | table 1 time "
        "ratio (M, M+P, N, N+P) | kareus_not_below |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        v, c, t8 = s.get("validation", {}), s.get("calibration", {}), s.get("table8", {})
        within = v.get("within_target", {})
        compared = v.get("compared", {})
        variants = ("kareus_without_frequency", "kareus_without_kernel_schedule", "nanobatching")
        energy = " / ".join(_fmt(t8.get(f"{x} energy_increase", [None, None])[1]) for x in variants)
        timing = " / ".join(_fmt(t8.get(f"{x} time_increase", [None, None])[1]) for x in variants)
        ratio = ", ".join(f"{r:.3f}" for r in s.get("table1_time_paper_over_ours", {}).values())
        lines.append(
            f"| {name.replace('recompute-', '').replace('_swing-', ', ')} | "
            + " / ".join(f"{within.get(g, 'NA')} of {compared.get(g, 'NA')}" for g in ("time", "energy", "iso"))
            + f" | {v.get('mean_abs_err_pp')} / {c.get('mean_abs_err_pp')} | {energy} | {timing} | {ratio} | "
            + f"{len(v.get('kareus_not_below', [])) + len(c.get('kareus_not_below', []))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the comparison as README tables")
    parser.add_argument("--rerun", action="store_true", help="plan again even if the results file has the preset")
    parser.add_argument(
        "--rerun-presets",
        type=lambda names: set(names.split(",")),
        default=set(),
        help="comma-separated presets to plan again (the others keep their cached plans)",
    )
    parser.add_argument("--rows", choices=("calibration", "validation", "all"), default="all")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument(
        "--stage-layers",
        choices=("even", "balanced"),
        default=None,
        help="plan every preset with this stage split instead of its own (balanced, as the paper's "
        "testbed); with --results elsewhere, to compare",
    )
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="recompute none/full x throttle swing off/on: every corner's validation targets",
    )
    parser.add_argument("--jobs", type=int, default=1, help="with --ablation: presets planned side by side")
    args = parser.parse_args(argv)
    unknown = args.rerun_presets - PRESETS.keys()
    if unknown:
        parser.error(f"--rerun-presets: no preset named {', '.join(sorted(unknown))} (see kareus_fx/plan/presets.py)")
    if args.ablation and (args.stage_layers is not None or args.results != DEFAULT_RESULTS):
        parser.error("--ablation plans the presets' own stage split into its own files: drop --stage-layers/--results")
    if args.stage_layers is not None and args.results == DEFAULT_RESULTS:
        parser.error("--stage-layers plans another pipeline than the presets': give --results FILE for its results")

    calibration_rows = read_csv_rows(CALIBRATION_CSV) if args.rows != "validation" else []
    validation_rows: list[dict[str, str]] = []
    ablation_rows: list[dict[str, str]] = []
    if args.rows != "calibration" and VALIDATION_DIR.is_dir():
        validation_rows = read_csv_rows(VALIDATION_CSV)
        ablation_rows = read_csv_rows(VALIDATION_DIR / f"{ABLATION_PRESET}_ablation.csv")

    if args.ablation:
        summaries = run_ablation(args, calibration_rows, validation_rows, ablation_rows)
        print(json.dumps(summaries, indent=1) if args.json else ablation_markdown(summaries))
        return 0

    stored = json.loads(args.results.read_text()) if args.results.exists() else {}
    plans = stored.get("plans", {})
    needed = [r["preset"] for r in calibration_rows + validation_rows]
    if ablation_rows:
        needed += dict.fromkeys(key for key, _ in ABLATION_METHODS.values())
    for key in dict.fromkeys(needed):
        if key in plans and not args.rerun and key.removesuffix(MAX_CLOCK_SUFFIX) not in args.rerun_presets:
            continue
        print(f"planning {key} ...", file=sys.stderr, flush=True)
        plans[key] = plan_metrics(key, args.stage_layers)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({**stored, "plans": plans}, indent=1, sort_keys=True))

    report: dict = {"note": "ours: simulated A100-SXM4-40GB (cost-model predictions); paper: measured, 16 A100s"}
    if calibration_rows:
        report["calibration_cells"], report["calibration"] = compare_rows(calibration_rows, plans)
    if validation_rows:
        report["validation_cells"], report["validation"] = compare_rows(validation_rows, plans)
        report["ablation_cells"], ablation = compare_ablation(ablation_rows, plans)
        report["validation"]["max_abs_err_pp"]["ablation"] = ablation["max_abs_err_pp"]
        report["validation"]["ablation"] = ablation
    elif args.rows != "calibration":
        report["validation"] = {"skipped": f"{VALIDATION_DIR} not found"}
    args.results.write_text(
        json.dumps(
            {**stored, "plans": plans, **{k: v for k, v in report.items() if k != "note"}}, indent=1, sort_keys=True
        )
    )
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    if args.markdown:
        print(markdown(report))
        return 0
    print(report["note"])
    for part in ("calibration", "validation"):
        if f"{part}_cells" not in report:
            continue
        print(f"\n{part}: (paper / ours, %)")
        for c in report[f"{part}_cells"]:
            print(f"  {c['preset']:34s} {c['metric']:28s} {_fmt(c['paper']):>6s} / {_fmt(c['ours']):>6s}")
        print(f"  summary: {json.dumps(report[part])}")
    for c in report.get("ablation_cells", []):
        print(f"  ablation {c['variant']:34s} {c['metric']:16s} {_fmt(c['paper']):>6s} / {_fmt(c['ours']):>6s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
