"""How the composed iteration frontiers and the paper's metrics move with the solver's resolution.

Usage:
    python bench/compose_resolution.py [--presets P,...] [--steps 500,1000,2000] [--json] [--results FILE]

Each preset is traced once; its plan is then composed with the planner's own step cap
(``solver_sizing.solver_step_cap``), at each cap in ``--steps`` (the lowtime solver's steps per method,
which set the time quantum: the span of the slowest and fastest plans over the steps, down to a
1 ms floor) and at each quantum floor in ``--floors-ms`` (steps uncapped). Per resolution it reports the quantum, the compose
and tune wall times, every method's four metrics (``plan/metrics.py``) and each method's frontier
against the finest one's: the largest relative energy excess at a deadline (``least energy
within T`` of the coarse frontier against the finest, over the finest frontier's times) and the
frontier's point count. The finest resolution is the reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from kareus_fx.plan import solver_sizing
from kareus_fx.plan.metrics import least_energy_within
from kareus_fx.plan.planner import plan_traced
from kareus_fx.plan.request import plan_request_from_preset
from kareus_fx.plan.stage_tracing import trace_plan_stages

DEFAULT_PRESETS = (
    "qwen3-1.7b-tp8-mbs16-seq4k",
    "qwen3-1.7b-cp2tp4-mbs16-seq4k",
    "qwen3-1.7b-tp8-mbs8-seq4k",
)
UNCAPPED_STEPS = 10**7
"""A step cap no testbed solve reaches (the floor runs solve at the floor's quantum)."""
METHODS = ("megatron+perseus", "nanobatching+perseus", "kareus")


def frontier_excess(coarse: list[tuple[float, float]], fine: list[tuple[float, float]]) -> float:
    """Largest relative energy excess of ``coarse`` over ``fine`` at the deadlines of ``fine``'s
    points that ``coarse`` can meet (the step frontier ``least energy within T``)."""
    worst = 0.0
    for t, e in fine:
        ours = least_energy_within(coarse, t)
        if ours is not None:
            worst = max(worst, ours / e - 1.0)
    return worst


def _pareto(frontier: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The frontier's Pareto points by time (energy falling as time grows)."""
    out: list[tuple[float, float]] = []
    for t, e in sorted(frontier):
        if not out or e < out[-1][1]:
            out.append((t, e))
    return out


def _interpolate(a: tuple[float, float], b: tuple[float, float], x: float, axis: int) -> float:
    """The other coordinate of the segment ``a``-``b`` where coordinate ``axis`` is ``x``."""
    w = (x - a[axis]) / (b[axis] - a[axis])
    return a[1 - axis] + w * (b[1 - axis] - a[1 - axis])


def interpolated_iso(frontier: list[tuple[float, float]], mp: list[tuple[float, float]]) -> dict[str, float | None]:
    """The two iso reductions read off ``frontier`` linearly between its Pareto points (where
    ``metrics.py`` takes the best real point meeting the deadline or budget): how much of an iso
    number is the frontier's spacing."""
    front, mp_front = _pareto(frontier), _pareto(mp)
    deadline_s, mp_fast_e = mp_front[0]
    mp_slow_t, budget_j = mp_front[-1]
    energy: float | None = None
    time_s: float | None = None
    for a, b in zip(front, front[1:] + [front[-1]]):
        if energy is None and a[0] <= deadline_s and (b is a or b[0] > deadline_s):
            energy = a[1] if b is a else _interpolate(a, b, deadline_s, 0)
        if time_s is None and a[1] > budget_j >= b[1]:
            time_s = _interpolate(a, b, budget_j, 1)
    if front[0][1] <= budget_j:
        time_s = front[0][0]
    return {
        "iso_time_energy_reduction": None if energy is None else 1.0 - energy / mp_fast_e,
        "iso_energy_time_reduction": None if time_s is None else 1.0 - time_s / mp_slow_t,
    }


def run(presets: list[str], steps: list[int], floors_ms: list[float]) -> dict:
    """Per preset, a run per step cap (at the planner's quantum floor) and per quantum floor in
    ``floors_ms`` (steps uncapped); the last run is the reference."""
    out: dict = {}
    original = (
        solver_sizing.MAX_SOLVER_STEPS,
        solver_sizing.FINE_SOLVER_STEPS,
        solver_sizing.DEFAULT_UNIT_TIME_S,
        solver_sizing.FINE_UNIT_TIME_S,
    )
    configs: list[tuple[str, int | None, float | None]] = [("planner", None, None)]
    configs += [(str(n), n, original[2]) for n in steps]
    configs += [(f"floor {f:g} ms", UNCAPPED_STEPS, f / 1e3) for f in floors_ms]
    try:
        for preset in presets:
            with tempfile.TemporaryDirectory(prefix="kareus-resolution-") as tmp:
                t0 = time.perf_counter()
                req, traced = trace_plan_stages(plan_request_from_preset(preset), Path(tmp) / "dumps")
                trace_s = time.perf_counter() - t0
                runs: dict = {}
                for n, cap, floor_s in configs:
                    # None: the planner's own cap (solver_sizing.solver_step_cap); else exactly ``cap``.
                    caps = original[:2] if cap is None else (cap, cap)
                    solver_sizing.MAX_SOLVER_STEPS, solver_sizing.FINE_SOLVER_STEPS = caps
                    # None: the planner's own floors; else ``floor_s`` for every pipeline.
                    floors = original[2:] if floor_s is None else (floor_s, floor_s)
                    solver_sizing.DEFAULT_UNIT_TIME_S, solver_sizing.FINE_UNIT_TIME_S = floors
                    t0 = time.perf_counter()
                    outcome = plan_traced(req, traced, Path(tmp) / "work", progress=False)
                    wall_s = time.perf_counter() - t0
                    fronts = {
                        m: [(p.time_s, p.energy_j) for p in outcome.iteration[m].points] for m in outcome.iteration
                    }
                    runs[n] = {
                        "unit_time_s": outcome.iteration["kareus"].unit_time_s,
                        "wall_s": wall_s,
                        "compose_s": outcome.wall_s["compose_s"],
                        "metrics": {m: outcome.data["methods"][m]["metrics"] for m in METHODS},
                        "interpolated": {m: interpolated_iso(fronts[m], fronts["megatron+perseus"]) for m in METHODS},
                        "fronts": fronts,
                    }
                    print(
                        f"{preset} {n} unit={runs[n]['unit_time_s'] * 1e3:.3f} ms compose={runs[n]['compose_s']:.1f} s",
                        file=sys.stderr,
                    )
                finest = runs[configs[-1][0]]["fronts"]
                for n in runs:
                    runs[n]["frontier"] = {
                        m: {
                            "points": len(runs[n]["fronts"][m]),
                            "max_energy_excess_vs_finest": frontier_excess(runs[n]["fronts"][m], finest[m]),
                        }
                        for m in METHODS
                    }
                    del runs[n]["fronts"]
                out[preset] = {"trace_s": trace_s, "runs": runs}
    finally:
        (
            solver_sizing.MAX_SOLVER_STEPS,
            solver_sizing.FINE_SOLVER_STEPS,
            solver_sizing.DEFAULT_UNIT_TIME_S,
            solver_sizing.FINE_UNIT_TIME_S,
        ) = original
    return out


def table(report: dict) -> str:
    lines = []
    short = {"megatron+perseus": "M+P", "nanobatching+perseus": "N+P", "kareus": "K"}
    for preset, data in report.items():
        lines.append(f"{preset} (trace {data['trace_s']:.1f} s)")
        for n, r in data["runs"].items():
            lines.append(
                f"  {n}: unit {r['unit_time_s'] * 1e3:.3f} ms, compose {r['compose_s']:.1f} s, plan {r['wall_s']:.1f} s"
            )
            for m in METHODS:
                mt = r["metrics"][m]
                cells = " ".join(
                    "   NA" if mt[k] is None else f"{100 * mt[k]:5.2f}"
                    for k in (
                        "max_throughput_time_reduction",
                        "max_throughput_energy_reduction",
                        "iso_time_energy_reduction",
                        "iso_energy_time_reduction",
                    )
                )
                fr = r["frontier"][m]
                lines.append(
                    f"    {short[m]:4} time/energy/iso-t-E/iso-E-t % {cells}  points {fr['points']:4d} "
                    f"excess {100 * fr['max_energy_excess_vs_finest']:.2f} %"
                )
                ip = r["interpolated"][m]
                lines.append(
                    "         iso interpolated "
                    + " ".join(
                        "   NA" if ip[k] is None else f"{100 * ip[k]:5.2f}"
                        for k in ("iso_time_energy_reduction", "iso_energy_time_reduction")
                    )
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(DEFAULT_PRESETS))
    parser.add_argument("--steps", default="500,1000,2000")
    parser.add_argument("--floors-ms", default="", help="quantum floors (ms) to solve at, steps uncapped")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--results", type=Path)
    args = parser.parse_args(argv)
    steps = sorted(int(s) for s in args.steps.split(",") if s)
    floors_ms = sorted((float(f) for f in args.floors_ms.split(",") if f), reverse=True)
    report = run(args.presets.split(","), steps, floors_ms)
    if args.results:
        args.results.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
