"""Does the iteration composer reproduce the Perseus planner's frontiers?

Feeds the Perseus artifact's GPT-3 175B stage profile (A100 SXM, BF16, TP=8; 8 stages, forward
and backward per stage, 855-1410 MHz) to ``kareus_fx.compose.compose_iteration`` on the 1F1B
pipeline with 8 stages and 12 / 24 / 48 / 96 microbatches, at the artifact's
communication-blocking power (83.64 W on A100) and time quantum (1 ms), and compares the result
with the frontier the Perseus planner (lowtime) computed from the same profile.

Units: the artifact's frontier CSVs are in the profile's own units (seconds and joules of one
GPU per stage, summed over the 8 stages); the x10 time and x10xTP energy scaling the artifact
applies when it emulates a full stage is not in these files (the solver's numbers match them
unscaled, step for step), so nothing is rescaled here.

Deviation, per reference point (the reference frontier with its dominated points dropped; the
planner also prints plans slower than its least-energy plan):

- energy deviation: ``|E_ours(t_ref) - e_ref| / e_ref``, where ``E_ours(t)`` is our frontier's
  energy linearly interpolated at time ``t`` (clamped to our frontier's time range);
- time deviation: ``|T_ours(e_ref) - t_ref| / t_ref``, where ``T_ours(e)`` is our frontier's time
  linearly interpolated at energy ``e`` (clamped to our frontier's energy range).

Also reported: ``max_relative_distance``, the two-sided relative Chebyshev distance between
the curves (for each point of either, the smallest eps such that the other frontier passes
within eps of it in time and in energy at once), which stays well-conditioned where the frontier
is steep (near minimum time) or flat (near minimum energy), where the two one-coordinate gaps
above magnify small shifts.

"Our frontier" is the composer's output: every plan re-evaluated with the profile's measured
times and energies (critical path of measured times; measured energies plus blocking power x
idle time), dominated plans dropped. The "solver" comparison instead takes lowtime's own
quantized time and model energy for each step (what the planner prints) and matches the
reference step by step on the 1 ms grid.

Usage: ``python bench/validate_composer.py [--json] [--microbatches 12 24] [--cost-model
exponential] [--jobs 4] [--data ../shared/data]``. Target: both deviations within 2%.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from kareus_fx.compose import compose_iteration, pareto_front, read_perseus_profile

NUM_STAGES = 8
A100_BLOCKING_POWER_W = 83.64  # Perseus artifact notebook, zeus commit 38cb3f90 (A40: 70.38 W)
UNIT_TIME_S = 1e-3  # the Perseus planner's time quantum
TARGET = 0.02
PROFILE = Path("calibration/perseus_a100_sxm/gpt3-175b_stage_profile.csv")
REFERENCE = "validation/perseus_planner_frontiers/gpt3-175b_bf16_mb{n}.csv"
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _read_reference(path: Path) -> list[tuple[float, float]]:
    with open(path, newline="") as f:
        return [(float(r["time"]), float(r["energy"])) for r in csv.DictReader(f)]


def _interp(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Linear interpolation with clamping; ``xs`` ascending."""
    return float(np.interp(x, xs, ys))


def frontier_deviation(ours: list[tuple[float, float]], reference: list[tuple[float, float]]) -> dict[str, float]:
    """Max relative time and energy gaps of ``ours`` at each reference point (see module doc)."""
    ours = sorted(pareto_front(ours, key=lambda p: p))
    ref = sorted(pareto_front(reference, key=lambda p: p))
    t = np.array([p[0] for p in ours])
    e = np.array([p[1] for p in ours])
    # Energy falls as time grows: interpolate time over energy on the reversed arrays.
    e_asc, t_by_e = e[::-1], t[::-1]
    energy_devs = [abs(_interp(tr, t, e) - er) / er for tr, er in ref]
    time_devs = [abs(_interp(er, e_asc, t_by_e) - tr) / tr for tr, er in ref]

    # Two-sided relative (Chebyshev) distance between the curves: for each point of one, the
    # smallest eps such that the other passes within eps in both time and energy.
    def nearest(points, tt, ee, ee_asc, tt_by_e):
        out = []
        for tr, er in points:
            candidates = [(tr, _interp(tr, tt, ee)), (_interp(er, ee_asc, tt_by_e), er)]
            candidates += list(zip(tt, ee))
            out.append(min(max(abs(tq - tr) / tr, abs(eq - er) / er) for tq, eq in candidates))
        return out

    rt = np.array([p[0] for p in ref])
    re_ = np.array([p[1] for p in ref])
    eps = nearest(ref, t, e, e_asc, t_by_e) + nearest(ours, rt, re_, re_[::-1], rt[::-1])
    i_e, i_t = int(np.argmax(energy_devs)), int(np.argmax(time_devs))
    return {
        "max_relative_distance": max(eps),
        "max_energy_dev": max(energy_devs),
        "max_energy_dev_at_time_s": ref[i_e][0],
        "max_time_dev": max(time_devs),
        "max_time_dev_at_energy_j": ref[i_t][1],
        "mean_energy_dev": float(np.mean(energy_devs)),
        "mean_time_dev": float(np.mean(time_devs)),
        "reference_points": len(ref),
        "our_points": len(ours),
        "min_time_s": {"ours": float(t[0]), "reference": ref[0][0]},
        "energy_at_min_time_j": {"ours": float(e[0]), "reference": ref[0][1]},
        "min_energy_j": {"ours": float(e[-1]), "reference": ref[-1][1]},
        "time_at_min_energy_s": {"ours": float(t[-1]), "reference": ref[-1][0]},
    }


def solver_step_deviation(solver: list[tuple[float, float]], reference: list[tuple[float, float]]) -> dict[str, float]:
    """lowtime's own (time, energy) per step against the planner's, matched on the 1 ms grid."""
    ours = {round(t / UNIT_TIME_S): e for t, e in solver}
    matched = [(ours[round(t / UNIT_TIME_S)], e) for t, e in reference if round(t / UNIT_TIME_S) in ours]
    devs = [abs(a - b) / b for a, b in matched]
    return {
        "matched_steps": len(matched),
        "reference_steps": len(reference),
        "solver_steps": len(solver),
        "max_energy_dev": max(devs) if devs else float("nan"),
    }


def run_case(num_microbatches: int, data: Path, cost_model: str) -> dict:
    profile = read_perseus_profile(data / PROFILE)
    reference = _read_reference(data / REFERENCE.format(n=num_microbatches))
    start, start_cpu = time.perf_counter(), time.process_time()
    frontier = compose_iteration(
        profile,
        num_microbatches,
        blocking_power_w=A100_BLOCKING_POWER_W,
        unit_time_s=UNIT_TIME_S,
        cost_model=cost_model,
    )
    wall_s = time.perf_counter() - start
    cpu_s = time.process_time() - start_cpu
    ours = [(p.time_s, p.energy_j) for p in frontier.points]
    solver = [(p.solver_time_s, p.solver_energy_j) for p in frontier.trace[1:]]
    solver_front = [(p.solver_time_s, p.solver_energy_j) for p in frontier.trace]
    quantization = [abs(p.time_s - p.solver_time_s) / p.solver_time_s for p in frontier.trace]
    return {
        "num_microbatches": num_microbatches,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "solver_steps": len(frontier.trace) - 1,
        "frontier": frontier_deviation(ours, reference),
        "solver_frontier": frontier_deviation(solver_front, reference),
        "solver_steps_vs_reference": solver_step_deviation(solver, reference),
        "max_measured_vs_quantized_time_gap": max(quantization),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[12, 24, 48, 96])
    parser.add_argument("--cost-model", choices=["convex", "exponential"], default="convex")
    parser.add_argument("--jobs", type=int, default=1, help="cases solved in parallel processes")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared data folder")
    args = parser.parse_args(argv)

    missing = [
        p
        for p in [args.data / PROFILE] + [args.data / REFERENCE.format(n=n) for n in args.microbatches]
        if not p.is_file()
    ]
    if missing:
        print(
            "validate_composer: missing data file(s): "
            + ", ".join(str(p) for p in missing)
            + ". Point --data at the shared data folder (it holds calibration/ and validation/).",
            file=sys.stderr,
        )
        return 2

    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_case, n, args.data, args.cost_model) for n in args.microbatches]
            cases = [f.result() for f in futures]
    else:
        cases = []
        for n in args.microbatches:
            cases.append(run_case(n, args.data, args.cost_model))
            if not args.json:
                c = cases[-1]
                print(
                    f"mb={n:3d}: time dev {c['frontier']['max_time_dev']:.4%}, energy dev "
                    f"{c['frontier']['max_energy_dev']:.4%}, {c['wall_s']:.1f} s",
                    file=sys.stderr,
                )

    max_time_dev = max(c["frontier"]["max_time_dev"] for c in cases)
    max_energy_dev = max(c["frontier"]["max_energy_dev"] for c in cases)
    result = {
        "max_time_dev": max_time_dev,
        "max_energy_dev": max_energy_dev,
        "target": TARGET,
        "within_target": max_time_dev <= TARGET and max_energy_dev <= TARGET,
        "cost_model": args.cost_model,
        "unit_time_s": UNIT_TIME_S,
        "blocking_power_w": A100_BLOCKING_POWER_W,
        "num_stages": NUM_STAGES,
        "cases": {str(c["num_microbatches"]): c for c in cases},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0

    print(
        f"Perseus planner frontiers (GPT-3 175B, A100 SXM, {NUM_STAGES} stages, 1F1B, "
        f"{A100_BLOCKING_POWER_W} W blocking, {UNIT_TIME_S * 1e3:g} ms quantum, "
        f"cost model {args.cost_model})"
    )
    header = (
        f"{'mb':>4} {'wall s':>8} {'cpu s':>8} {'steps':>6} {'time dev':>9} {'energy dev':>11} "
        f"{'distance':>9} {'solver E dev':>13} {'min t ours/ref':>17} {'min E ours/ref':>19}"
    )
    print(header)
    for c in cases:
        f = c["frontier"]
        print(
            f"{c['num_microbatches']:>4} {c['wall_s']:>8.1f} {c['cpu_s']:>8.1f} "
            f"{c['solver_steps']:>6} "
            f"{f['max_time_dev']:>9.3%} {f['max_energy_dev']:>11.3%} "
            f"{f['max_relative_distance']:>9.3%} "
            f"{c['solver_steps_vs_reference']['max_energy_dev']:>13.3%} "
            f"{f['min_time_s']['ours']:>8.3f}/{f['min_time_s']['reference']:<8.3f} "
            f"{f['min_energy_j']['ours']:>9.1f}/{f['min_energy_j']['reference']:<9.1f}"
        )
    verdict = "within" if result["within_target"] else "MISSES"
    print(f"overall: time dev {max_time_dev:.3%}, energy dev {max_energy_dev:.3%} ({verdict} the {TARGET:.0%} target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
