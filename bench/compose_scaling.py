"""How long does the iteration composer take as the pipeline grows; what does speeding it up cost?

Input: synthetic options per (stage, instruction), a clock sweep of ``--options`` clocks from
1410 down to 900 MHz: time ``t0 x (1410 / f)^0.9`` (``t0`` the forward / backward time at 1410
MHz, +-5% per stage), energy ``t x (150 + 320 (f / 1410)^3) W`` (convex, falling with the clock
except at the top). Blocking power 80 W. Synthetic numbers, not measurements: they only set
the problem's size and shape.

Methods, per case (stages x microbatches):

- ``lowtime 1ms``: the composer before this benchmark's changes, ``PhillipsDessouky.run`` at
  the 1 ms quantum (``solver_loop="lowtime"``): the baseline;
- ``exact 1ms``: the same solve through ``solver_loop="fast"`` with lowtime's Rust min-cut
  (``min_cut="lowtime"``: same plans, step for step): the exact frontier;
- ``dinic 1ms``: the fast loop with SciPy's Dinic min-cut (the default; ``solver_loop.py``);
- ``exact <K> steps`` / ``dinic <K> steps``: ``max_solver_steps=K`` (adaptive quantum, what
  ``kareus plan`` runs with K = 500), each min-cut.

A 1 ms solve whose step count (``count_solver_steps``) exceeds ``--max-baseline-steps`` (lowtime
loop) or ``--max-reference-steps`` (fast loop) is not run to the end: it runs ``--probe-steps``
steps and its total is estimated as setup + steps x (mean time of the probed steps), marked
``~``. The per-step cost grows as more of the DAG turns
critical, so the estimate is low.

Deviation of a frontier from its reference: ``dinic 1ms`` and each ``exact <K> steps`` from
``exact 1ms`` (only where that ran), ``dinic <K> steps`` from ``exact <K> steps`` (same quantum:
what the Dinic min-cut alone changes; the criterion). With
``E_X(t)`` the least energy of frontier X among its plans that take at most ``t`` (what a deadline
``t`` gets), the largest ``(E_adaptive(t) - E_1ms(t)) / E_1ms(t)`` over the 1 ms frontier's times
(``dE+``: energy lost; ``dE-`` the smallest, negative where the coarse solve found a better
plan), the largest ``|E~_adaptive(t) - E_1ms(t)| / E_1ms(t)`` with ``E~`` the frontier linearly
interpolated (``dE~``: the curves' gap, as ``bench/validate_composer.py`` measures it), and the
relative gap between the fastest plans (``dTmin``), and the multiplicative epsilon indicator
(``eps``): the least ``e`` such that every 1 ms frontier point ``(t, E)`` has an adaptive point
within ``(1 + e) t`` and ``(1 + e) E`` (the criterion "within 0.5 % in time and energy at every
point" is ``eps <= 0.005``).

Usage: ``python bench/compose_scaling.py [--cases 2x8 8x24 10x16 10x128]
[--steps 250 500 1000] [--max-baseline-steps 2000] [--max-reference-steps 5000] [--json]``.
Wall and CPU seconds, one process, cases in sequence; the ratio is lowtime 1ms CPU seconds /
the method's (the machine is shared: CPU time is the steadier measure), and for ``dinic <K>
steps`` also ``exact <K> steps``'s CPU seconds / its own (``vs exact``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

import kareus_fx.compose.iteration as iteration
from kareus_fx.compose import (
    CompositionError,
    InstructionOption,
    IterationFrontier,
    compose_iteration,
    count_solver_steps,
)

BLOCKING_POWER_W = 80.0
MAX_CLOCK_MHZ, MIN_CLOCK_MHZ = 1410.0, 900.0


@dataclass(frozen=True)
class Case:
    num_stages: int
    num_microbatches: int
    forward_s: float
    backward_s: float

    @property
    def name(self) -> str:
        return f"{self.num_stages}x{self.num_microbatches}"


# Testbed-like instruction times for PP2 x 8; Llama-3.3-70B-like (0.1 s / 0.2 s) for PP10.
INSTRUCTION_TIMES_S = {2: (0.04, 0.08), 8: (0.05, 0.1), 10: (0.1, 0.2)}


def parse_case(text: str) -> Case:
    stages, microbatches = (int(x) for x in text.lower().split("x"))
    forward_s, backward_s = INSTRUCTION_TIMES_S.get(stages, (0.1, 0.2))
    return Case(stages, microbatches, forward_s, backward_s)


def synthetic_options(case: Case, num_options: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    clocks_mhz = np.linspace(MAX_CLOCK_MHZ, MIN_CLOCK_MHZ, num_options)
    options = {}
    for stage in range(case.num_stages):
        for instruction, base_s in (("forward", case.forward_s), ("backward", case.backward_s)):
            times_s = base_s * rng.uniform(0.95, 1.05) * (MAX_CLOCK_MHZ / clocks_mhz) ** 0.9
            energies_j = times_s * (150.0 + 320.0 * (clocks_mhz / MAX_CLOCK_MHZ) ** 3)
            options[(stage, instruction)] = [
                InstructionOption(float(t), float(e), knob=int(c)) for t, e, c in zip(times_s, energies_j, clocks_mhz)
            ]
    return options


class _StopProbe(Exception):
    pass


@contextmanager
def probe_steps(limit: int) -> Iterator[list[tuple[float, float]]]:
    """Stop either solver loop after ``limit`` steps; collect each step's (wall, CPU) seconds."""
    step_times_s: list[tuple[float, float]] = []
    fast, lowtime_cls = iteration.run_phillips_dessouky, iteration.PhillipsDessouky

    def timed(steps):
        start = (time.perf_counter(), time.process_time())
        for step in steps:
            step_times_s.append((time.perf_counter() - start[0], time.process_time() - start[1]))
            yield step
            if len(step_times_s) >= limit:
                raise _StopProbe
            start = (time.perf_counter(), time.process_time())

    class ProbedLowtime(lowtime_cls):
        def run(self):
            return timed(super().run())

    iteration.run_phillips_dessouky = lambda dag, **kwargs: timed(fast(dag, **kwargs))
    iteration.PhillipsDessouky = ProbedLowtime
    try:
        yield step_times_s
    finally:
        iteration.run_phillips_dessouky, iteration.PhillipsDessouky = fast, lowtime_cls


def timed_compose(options, case: Case, **kwargs) -> tuple[IterationFrontier, float, float]:
    start, start_cpu = time.perf_counter(), time.process_time()
    frontier = compose_iteration(options, case.num_microbatches, blocking_power_w=BLOCKING_POWER_W, **kwargs)
    return frontier, time.perf_counter() - start, time.process_time() - start_cpu


def estimate_compose_s(options, case: Case, steps: int, probe: int, **kwargs) -> tuple[float, float]:
    """Wall and CPU seconds: setup + ``steps`` x mean probed step time (see module doc)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    with probe_steps(probe) as step_times_s:
        try:
            compose_iteration(options, case.num_microbatches, blocking_power_w=BLOCKING_POWER_W, **kwargs)
        except _StopProbe:
            pass
    elapsed = (time.perf_counter() - start, time.process_time() - start_cpu)
    per_step = np.array(step_times_s)
    return tuple(elapsed[i] - per_step[:, i].sum() + steps * per_step[:, i].mean() for i in range(2))


def least_energy_within(frontier: IterationFrontier, times_s: np.ndarray) -> np.ndarray:
    """``E(t)``: least energy among the frontier's plans taking at most ``t`` (inf if none)."""
    t = np.array([p.time_s for p in frontier.points])  # points: fastest first, energy falling
    e = np.array([p.energy_j for p in frontier.points])
    idx = np.searchsorted(t, times_s, side="right") - 1
    return np.where(idx >= 0, e[np.clip(idx, 0, None)], np.inf)


def epsilon_indicator(approx: IterationFrontier, exact: IterationFrontier) -> float:
    """Least ``e >= 0`` with every point of ``exact`` matched by a point of ``approx`` no more
    than ``(1 + e)`` times slower and ``(1 + e)`` times costlier (module docstring)."""
    a = np.array([(p.time_s, p.energy_j) for p in approx.points])
    x = np.array([(p.time_s, p.energy_j) for p in exact.points])
    worse = np.maximum(a[None, :, 0] / x[:, None, 0], a[None, :, 1] / x[:, None, 1])
    return float(max(worse.min(axis=1).max() - 1.0, 0.0))


def deviation(adaptive: IterationFrontier, reference: IterationFrontier) -> dict[str, float]:
    ref_t = np.array([p.time_s for p in reference.points])
    ref_e = np.array([p.energy_j for p in reference.points])
    gap = (least_energy_within(adaptive, ref_t) - ref_e) / ref_e
    finite = np.isfinite(gap)
    fastest_gap = (adaptive.points[0].time_s - reference.points[0].time_s) / ref_t[0]
    ada_t = np.array([p.time_s for p in adaptive.points])
    ada_e = np.array([p.energy_j for p in adaptive.points])
    curve_gap = (np.interp(ref_t, ada_t, ada_e) - ref_e) / ref_e
    return {
        "max_curve_energy_gap": float(np.abs(curve_gap).max()),
        "epsilon": epsilon_indicator(adaptive, reference),
        "max_energy_loss": float(gap[finite].max()),
        "min_energy_gap": float(gap[finite].min()),
        "fastest_time_gap": float(fastest_gap),
        "reference_points_without_plan": int((~finite).sum()),
    }


def run_case(case: Case, args: argparse.Namespace) -> dict:
    options = synthetic_options(case, args.options)
    steps_1ms = count_solver_steps(options, case.num_microbatches)
    row: dict = {"case": case.name, "steps_1ms": steps_1ms, "methods": {}}
    reference = None
    solves = {
        "lowtime 1ms": ({"solver_loop": "lowtime"}, args.max_baseline_steps),
        "exact 1ms": ({"min_cut": "lowtime"}, args.max_reference_steps),
        "dinic 1ms": ({"min_cut": "dinic"}, args.max_reference_steps),
    }
    for name, (kwargs, limit) in solves.items():
        if steps_1ms <= limit:
            frontier, wall_s, cpu_s = timed_compose(options, case, **kwargs)
            row["methods"][name] = {
                "wall_s": wall_s,
                "cpu_s": cpu_s,
                "steps": len(frontier.trace) - 1,
                "estimated": False,
            }
            if name == "exact 1ms":
                reference = frontier
            elif name == "dinic 1ms" and reference is not None:
                row["methods"][name]["deviation"] = deviation(frontier, reference)
        else:
            wall_s, cpu_s = estimate_compose_s(options, case, steps_1ms, args.probe_steps, **kwargs)
            row["methods"][name] = {
                "wall_s": wall_s,
                "cpu_s": cpu_s,
                "steps": steps_1ms,
                "estimated": True,
            }
    for max_steps in args.steps:
        exact = None
        for cut in ("lowtime", "dinic"):
            try:
                frontier, wall_s, cpu_s = timed_compose(options, case, max_solver_steps=max_steps, min_cut=cut)
            except CompositionError as e:  # too few steps for this pipeline
                print(f"{case.name}, {max_steps} steps: {e}", file=sys.stderr)
                break
            entry = {
                "wall_s": wall_s,
                "cpu_s": cpu_s,
                "steps": len(frontier.trace) - 1,
                "unit_time_s": frontier.unit_time_s,
                "estimated": False,
            }
            if cut == "lowtime":
                exact = frontier
                if reference is not None:
                    entry["deviation"] = deviation(frontier, reference)
                row["methods"][f"exact {max_steps} steps"] = entry
            else:
                entry["deviation"] = deviation(frontier, exact)
                row["methods"][f"dinic {max_steps} steps"] = entry
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["2x8", "8x24", "10x16", "10x128"])
    parser.add_argument("--steps", type=int, nargs="+", default=[250, 500, 1000])
    parser.add_argument("--options", type=int, default=20, help="clocks per instruction")
    parser.add_argument("--max-baseline-steps", type=int, default=2000, help="lowtime 1ms solves run to the end")
    parser.add_argument("--max-reference-steps", type=int, default=5000, help="fast 1ms solves run to the end")
    parser.add_argument("--probe-steps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    if args.json:
        print(json.dumps([run_case(parse_case(text), args) for text in args.cases], indent=2))
        return 0
    print(
        f"iteration composer scaling (synthetic options, {args.options} clocks, "
        f"{BLOCKING_POWER_W:g} W blocking; ~ = estimated from {args.probe_steps} probed steps)"
    )
    print(
        f"{'case':>7} {'method':>16} {'quantum ms':>10} {'steps':>6} {'wall s':>9} {'cpu s':>8} "
        f"{'cpu ratio':>10} {'vs exact':>9} {'dE+':>8} {'dE-':>8} {'dE~':>8} {'dTmin':>8} {'eps':>8}"
    )
    for text in args.cases:  # one case at a time: rows appear as they finish
        row = run_case(parse_case(text), args)
        base_cpu_s = row["methods"]["lowtime 1ms"]["cpu_s"]
        for name, m in row["methods"].items():
            mark = "~" if m["estimated"] else " "
            dev = m.get("deviation")
            devs = (
                f"{dev['max_energy_loss']:>8.3%} {dev['min_energy_gap']:>8.3%} "
                f"{dev['max_curve_energy_gap']:>8.3%} {dev['fastest_time_gap']:>8.3%} {dev['epsilon']:>8.3%}"
                if dev
                else ""
            )
            exact = row["methods"].get(name.replace("dinic", "exact")) if name.startswith("dinic") else None
            vs_exact = f"{exact['cpu_s'] / m['cpu_s']:>8.1f}x" if exact else " " * 9
            print(
                f"{row['case']:>7} {name:>16} {m.get('unit_time_s', 1e-3) * 1e3:>10.2f} "
                f"{m['steps']:>6} {mark}{m['wall_s']:>8.1f} {m['cpu_s']:>8.1f} "
                f"{base_cpu_s / m['cpu_s']:>9.1f}x {vs_exact} {devs}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
