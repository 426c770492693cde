"""Replay a plan against the synthetic straggler trace (Perseus's extrinsic energy bloat).

``--replicas`` data-parallel replicas run the plan; each hour of
``bench/traces/straggler_synthetic.csv`` names the slow replica and its slowdown (or nobody).
Replicas meet at every gradient synchronisation, so every replica's iteration takes the
straggler's time. Two ways to run the others:

- ``always-max-throughput``: they stay at Kareus's fastest point and wait for the straggler,
  blocked at the GPU's communication-blocking power (Perseus's accounting);
- ``straggler``: ``kareus_fx.policies.straggler.StragglerPolicy`` moves them to the least-energy
  point no slower than the straggler, so they wait less or not at all.

The straggler itself runs the fastest point either way (its energy is the same in both runs and
counted at the plan's prediction). Every time and energy is the plan's: with the simulated
profiler, a cost model's predictions. Throughput is the same in both runs by construction.

    python bench/straggler_replay.py --plan plans/qwen/plan.json --json
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.plan.plan_format import load_plan
from kareus_fx.policies.base import FrontierPoint, Observation
from kareus_fx.policies.straggler import StragglerPolicy

TRACE = Path(__file__).parent / "traces" / "straggler_synthetic.csv"


def read_trace(path: Path) -> list[tuple[int, float]]:
    """``(slow_replica, slowdown)`` per hour; replica -1 is nobody."""
    with path.open(newline="") as f:
        return [(int(row["slow_replica"]), float(row["slowdown"])) for row in csv.DictReader(f)]


def run(plan_path: str, trace: Sequence[tuple[int, float]], replicas: int) -> dict[str, Any]:
    plan = load_plan(plan_path)
    points = sorted((FrontierPoint.from_plan_point(i, p) for i, p in enumerate(plan.frontier)), key=lambda p: p.time_s)
    base = points[0]
    w = plan.workload
    blocking_w = gpu_spec(plan.gpu).blocking_power_w * w["tp"] * w["cp"] * w["pp"]
    policy = StragglerPolicy()
    energy = {"always-max-throughput": 0.0, "straggler": 0.0}
    iterations = 0.0
    chosen_per_hour = []
    for slow_replica, slowdown in trace:
        step_s = base.time_s * (slowdown if slow_replica >= 0 else 1.0)
        count = 3600.0 / step_s
        iterations += count
        straggler_j = base.energy_j if slow_replica >= 0 else 0.0
        healthy = replicas - (1 if slow_replica >= 0 else 0)
        observation = Observation(
            iteration=int(iterations),
            elapsed_s=0.0,
            current_index=base.index,
            slowest_replica_time_s=step_s,
            fastest_replica_time_s=base.time_s,
            replica_time_s=base.time_s,
        )
        point = next(p for p in points if p.index == policy.choose(points, observation))
        chosen_per_hour.append(point.time_s / base.time_s)
        waiting_j = {"always-max-throughput": (step_s - base.time_s), "straggler": max(0.0, step_s - point.time_s)}
        energy["always-max-throughput"] += count * (
            straggler_j + healthy * (base.energy_j + blocking_w * waiting_j["always-max-throughput"])
        )
        energy["straggler"] += count * (straggler_j + healthy * (point.energy_j + blocking_w * waiting_j["straggler"]))
    slow_hours = sum(1 for r, _ in trace if r >= 0)
    return {
        "plan": plan_path,
        "simulated": bool(plan.data.get("simulated")),
        "replicas": replicas,
        "hours": len(trace),
        "hours_with_a_straggler": slow_hours,
        "iterations": iterations,
        "energy_kwh": {k: v / 3.6e6 for k, v in energy.items()},
        "energy_reduction": 1.0 - energy["straggler"] / energy["always-max-throughput"],
        "mean_time_ratio_of_healthy_replicas_when_straggling": (
            sum(r for r, (s, _) in zip(chosen_per_hour, trace) if s >= 0) / slow_hours if slow_hours else 1.0
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = run(args.plan, read_trace(args.trace), args.replicas)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['hours']} h, {report['hours_with_a_straggler']} with a straggler, {args.replicas} replicas: "
            f"energy {report['energy_kwh']['always-max-throughput']:.1f} -> {report['energy_kwh']['straggler']:.1f} "
            f"kWh ({100 * report['energy_reduction']:.2f}% less) at the same throughput "
            f"({'simulated' if report['simulated'] else 'measured'} plan)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
