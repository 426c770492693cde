"""How well the calibrated simulator predicts measured data it was never fitted to.

    python bench/validate_simulator.py [--json] [--data ../shared/data]

Validation (``<data>/validation``, never read by the calibration):
(a) frequency model: time and power relative to the max clock vs SM clock, Bloom-176B pipeline
    stages (Perseus stage profiles) on A100-80GB SXM and on A40 (power-capped at high clocks);
(b) overlap model: time and energy of every (comm SMs, CTA size, overlap window) configuration of
    the Kareus attention partition with clocks locked at 1200 MHz (2 A100, TP=2).
The same metrics on the calibration data (GPT-3 stage profiles, the unlocked-clock overlap run)
are printed beside them. Targets: (a) MAPE <= 5%; (b) MAPE <= 10% and Spearman >= 0.9.

With ``--json`` one object is printed: ``frequency_mape``, ``overlap_time_mape``,
``overlap_energy_mape``, ``overlap_time_spearman``, ``overlap_energy_spearman`` (validation data,
MAPE as fractions), the same keys under ``calibration``, and a ``details`` breakdown.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from kareus_fx.cost_models.analytic_workloads import (
    BLOOM_176B,
    GPT3_175B,
    GPTShape,
    llama_attention_partition,
    transformer_stage_ops,
)
from kareus_fx.cost_models.calibration import (
    KAREUS_FILE,
    PERSEUS_A40_FILE,
    PERSEUS_A100_FILE,
    OverlapRow,
    load_harness,
    load_overlap,
    load_stage_profile,
    parse_overlap,
    parse_stage_profile,
    predict_overlap_row,
)
from kareus_fx.cost_models.sim_params import PARAMS_RESOURCE, gpu_params
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.workload import PartitionConfig

TARGETS = {
    "frequency_mape": 0.05,
    "overlap_time_mape": 0.10,
    "overlap_energy_mape": 0.10,
    "overlap_time_spearman": 0.9,
    "overlap_energy_spearman": 0.9,
}
DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def perseus_board_limit_w() -> float:
    """Power limit of the Perseus A100 testbed board, fitted on its GPT-3 profile (calibration)."""
    from importlib import resources

    text = resources.files("kareus_fx.cost_models").joinpath(PARAMS_RESOURCE).read_text()
    return float(json.loads(text)["harness"]["perseus_a100_board"]["power_limit_w"])


def frequency_errors(sim: Simulator, shape: GPTShape, measured: dict) -> dict[str, Any]:
    """Relative errors of time and power, each relative to the max clock, for every stage row."""
    fmax = max(f for (_, _, f) in measured)
    stages = sorted({s for (s, _, _) in measured})
    clocks = sorted({f for (_, _, f) in measured})
    t_err, p_err = [], []
    memo: dict[tuple, dict] = {}
    for stage in stages:
        for instruction in ("forward", "backward"):
            ops, _ = transformer_stage_ops(shape, stage, stages=len(stages), backward=instruction == "backward")
            key = tuple(ops)
            if key not in memo:  # stages with the same layers share one prediction
                memo[key] = {f: sim.predict_sequence(ops, (), f).measurement for f in clocks}
            pred = memo[key]
            t0, e0 = measured[(stage, instruction, fmax)]
            for f in clocks:
                if f == fmax:
                    continue
                t, e = measured[(stage, instruction, f)]
                m, m0 = pred[f], pred[fmax]
                t_err.append((m.time_s / m0.time_s) / (t / t0) - 1)
                p_err.append((m.energy_j / m.time_s) / (m0.energy_j / m0.time_s) / ((e / t) / (e0 / t0)) - 1)
    t_err, p_err = np.array(t_err), np.array(p_err)
    return {
        "time_ratio_mape": float(np.mean(np.abs(t_err))),
        "power_ratio_mape": float(np.mean(np.abs(p_err))),
        "time_ratio_max_abs_error": float(np.max(np.abs(t_err))),
        "power_ratio_max_abs_error": float(np.max(np.abs(p_err))),
        "points": len(t_err),
        "_errors": np.concatenate([t_err, p_err]),
    }


def overlap_errors(rows: list[OverlapRow], clock_mhz: float) -> dict[str, Any]:
    sim = Simulator("A100-SXM4-40GB")
    harness = load_harness()
    pred = [predict_overlap_row(sim, r, harness, clock_mhz).measurement for r in rows]
    t_meas = np.array([r.time_s for r in rows])
    e_meas = np.array([r.energy_j for r in rows])
    t_pred = np.array([m.time_s for m in pred])
    e_pred = np.array([m.energy_j for m in pred])
    t_err, e_err = t_pred / t_meas - 1, e_pred / e_meas - 1
    return {
        "time_mape": float(np.mean(np.abs(t_err))),
        "energy_mape": float(np.mean(np.abs(e_err))),
        "time_spearman": float(spearmanr(t_pred, t_meas).statistic),
        "energy_spearman": float(spearmanr(e_pred, e_meas).statistic),
        "time_max_abs_error": float(np.max(np.abs(t_err))),
        "energy_max_abs_error": float(np.max(np.abs(e_err))),
        "points": len(rows),
        "clock_mhz": clock_mhz,
        "per_window_time_mape": _per_window(rows, t_err),
        "per_window_energy_mape": _per_window(rows, e_err),
    }


def _per_window(rows: list[OverlapRow], err: np.ndarray) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    for r, e in zip(rows, err):
        out.setdefault(f"{r.start},{r.end}", []).append(abs(float(e)))
    return {k: round(float(np.mean(v)), 4) for k, v in out.items()}


def simulator_speed() -> dict[str, float]:
    """Microseconds per ``Simulator.measure`` call over the tuner's grid (Llama-3.2-3B attention at
    TP=4: clocks 900-1410 MHz step 30, comm SMs 3-30 step 3, every launch slot and sequential):
    the first pass (caches cold for each clock and SM count) and a repeat pass."""
    ptype = llama_attention_partition()
    sim = Simulator("A100-SXM4-40GB")
    configs = [
        PartitionConfig(f, n, s)
        for f in range(1410, 899, -30)
        for n in range(3, 31, 3)
        for s in (None, *ptype.launch_slots)
    ]
    out = {"configs": len(configs)}
    for name in ("first_pass_us", "repeat_us"):
        start = time.perf_counter()
        for cfg in configs:
            sim.measure(ptype, cfg)
        out[name] = round((time.perf_counter() - start) / len(configs) * 1e6, 1)
    return out


def evaluate(data: Path | None) -> dict[str, Any]:
    a100 = gpu_params("A100-SXM4-80GB")
    a100_board = Simulator(replace(a100.spec, tdp_w=perseus_board_limit_w()), a100.params)
    a40 = Simulator("A40")
    result: dict[str, Any] = {}

    def summary(freq_a100: dict, freq_a40: dict, overlap: dict) -> dict[str, Any]:
        pooled = np.concatenate([freq_a100.pop("_errors"), freq_a40.pop("_errors")])
        return {
            "frequency_mape": float(np.mean(np.abs(pooled))),
            "overlap_time_mape": overlap["time_mape"],
            "overlap_energy_mape": overlap["energy_mape"],
            "overlap_time_spearman": overlap["time_spearman"],
            "overlap_energy_spearman": overlap["energy_spearman"],
            "details": {"frequency_a100": freq_a100, "frequency_a40": freq_a40, "overlap": overlap},
        }

    cal = summary(
        frequency_errors(a100_board, GPT3_175B, load_stage_profile(PERSEUS_A100_FILE)),
        frequency_errors(a40, GPT3_175B, load_stage_profile(PERSEUS_A40_FILE)),
        overlap_errors(load_overlap(), a100_board.spec.clock_max_mhz),
    )
    cal["details"]["files"] = [PERSEUS_A100_FILE, PERSEUS_A40_FILE, KAREUS_FILE]
    if data is not None:
        val = data / "validation"
        with open(val / "perseus_stage_profiles/bloom_a100_sxm.csv") as f:
            bloom_a100 = parse_stage_profile(f)
        with open(val / "perseus_stage_profiles/bloom_a40.csv") as f:
            bloom_a40 = parse_stage_profile(f)
        with open(val / "kareus_attention_overlap_a100/locked_1200mhz.csv") as f:
            locked = parse_overlap(f)
        result = summary(
            frequency_errors(a100_board, BLOOM_176B, bloom_a100),
            frequency_errors(a40, BLOOM_176B, bloom_a40),
            overlap_errors(locked, 1200.0),
        )
        result["details"]["files"] = [
            "validation/perseus_stage_profiles/bloom_a100_sxm.csv",
            "validation/perseus_stage_profiles/bloom_a40.csv",
            "validation/kareus_attention_overlap_a100/locked_1200mhz.csv",
        ]
    result["calibration"] = cal
    result["simulator_us_per_call"] = simulator_speed()
    return result


def _verdict(key: str, value: float) -> str:
    target = TARGETS[key]
    ok = value <= target if key.endswith("mape") else value >= target
    return ("PASS" if ok else "MISS") + f" ({'<=' if key.endswith('mape') else '>='} {target:g})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="shared data folder (has validation/)")
    args = parser.parse_args(argv)
    data = args.data if (args.data / "validation").is_dir() else None
    if data is None:
        print(f"note: {args.data}/validation not found; calibration metrics only", file=sys.stderr)
    start = time.perf_counter()
    result = evaluate(data)
    result["seconds"] = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    cal = result["calibration"]
    print(f"{'metric':26} {'validation':>11} {'calibration':>12}  target")
    for key in TARGETS:
        val = result.get(key)
        shown = f"{val:11.4f}" if val is not None else f"{'n/a':>11}"
        print(f"{key:26} {shown} {cal[key]:12.4f}  {_verdict(key, val) if val is not None else ''}")
    for name, block in (("validation", result.get("details")), ("calibration", cal["details"])):
        if not block:
            continue
        fa, f40, ov = block["frequency_a100"], block["frequency_a40"], block["overlap"]
        print(
            f"\n{name}: frequency A100 time/power MAPE {fa['time_ratio_mape']:.4f}/{fa['power_ratio_mape']:.4f}, "
            f"A40 {f40['time_ratio_mape']:.4f}/{f40['power_ratio_mape']:.4f}; overlap at {ov['clock_mhz']:.0f} MHz "
            f"({ov['points']} configs) time/energy max error {ov['time_max_abs_error']:.3f}/"
            f"{ov['energy_max_abs_error']:.3f}"
        )
        print(f"  per-window time MAPE {ov['per_window_time_mape']}")
        print(f"  per-window energy MAPE {ov['per_window_energy_mape']}")
    speed = result["simulator_us_per_call"]
    print(
        f"\nsimulator: {speed['first_pass_us']} us/call first pass, {speed['repeat_us']} us/call repeat "
        f"({speed['configs']} configs of the Llama-3.2-3B TP=4 attention partition)"
    )
    print(f"({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
