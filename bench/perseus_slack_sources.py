"""Where Megatron-LM + Perseus's saving comes from on one plan, and how much stage imbalance the
paper's saving would take.

    python bench/perseus_slack_sources.py DIR [DIR ...] [--json]

``DIR`` is a ``kareus plan --preset NAME --out DIR`` directory; its ``perseus_profile.csv`` holds the
Megatron-LM microbatch's time and energy per stage, instruction and clock (what Perseus plans on).
For each plan this composes Perseus's iteration frontier (``compose_iteration``, the fastest point's
slack reclaimed, as the planner does) on three versions of that profile:

- **as planned**: the plan's own stages;
- **stages equalised**: every stage given the stages' mean option at each clock, so no stage waits
  on a slower one; what Perseus still saves there comes from the 1F1B schedule alone (the warm-up
  and cool-down instructions off the critical path) and from lowering a throttled clock request
  that costs no time;
- **last stage heavier by x**: the equalised profile with the last stage's times and energies
  scaled by ``1 + x`` (the same power), for x from 0 to 12 %: the faster stage then idles
  ``1 - 1 / (1 + x)`` of the slower one's step, the slack Perseus slows into.

The same slack reaches every method composed with Perseus: with the last stage of the plan's
Megatron-LM profile and of its Kareus microbatch options (``microbatch_options``) heavier by x, as
planned, it also prints Kareus's reductions (``frontier_metrics``: max-throughput time and energy
against Megatron-LM, iso-energy time against Megatron-LM + Perseus; the step tail, the same for
every method, left out).

It prints Megatron-LM + Perseus's max-throughput energy reduction against Megatron-LM (every
instruction at the maximum clock) for each, its least-energy point (time and energy against
Megatron-LM), and, for the calibration rows (the Llama rows shipped in the package; no validation
row is read), the idle share at which the sweep's reduction equals the paper's
(``stage_slack.matching_idle_share``). The sweep moves only the work's split between stages, at the
plan's own frequency curve; it is a diagnostic of what the testbed's pipeline must have been for our
frequency curve to give its saving, not a fit: nothing here changes a parameter or a preset. Every
number is a cost-model prediction of the simulated GPU the plan was made on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stage_slack import idle_share, matching_idle_share

from kareus_fx.compose.iteration import InstructionOption, IterationFrontier, IterationPoint, compose_iteration
from kareus_fx.compose.perseus_csv import read_perseus_profile
from kareus_fx.compose.pipeline_schedule import INSTRUCTIONS, Instruction
from kareus_fx.compose.slack import with_reclaimed_fastest
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.paper_testbed import calibration_rows, csv_number
from kareus_fx.plan.metrics import frontier_metrics

Options = Mapping[tuple[int, Instruction], Sequence[InstructionOption]]
Profile = dict[tuple[int, Instruction], list[InstructionOption]]

EXTRA_LOAD_PCT = (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0)
"""The last stage's extra work in the sweep, percent of the equalised stage."""
MAX_SOLVER_STEPS = 400
"""lowtime steps per frontier (the quantum coarsens to fit). Coarser than the planner's solve (the
testbed rows at a 0.5 ms quantum, up to 4,000 steps: ``plan/solver_sizing.py``) to keep the sweep
quick; on the Llama rows it gives the plans' Megatron-LM + Perseus saving to 0.1 pp and Kareus's
reductions to 0.4 pp."""


def clock_mhz(option: InstructionOption) -> int:
    """The clock of a Perseus profile's option (its knob)."""
    return cast(int, option.knob)


def megatron_point(options: Options, microbatches: int, blocking_power_w: float) -> IterationPoint:
    """Megatron-LM's iteration on a Perseus profile: every instruction at the maximum clock."""
    fastest_only = {key: [max(items, key=clock_mhz)] for key, items in options.items()}
    return compose_iteration(fastest_only, microbatches, blocking_power_w=blocking_power_w).points[0]


def perseus_frontier(options: Options, microbatches: int, blocking_power_w: float) -> IterationFrontier:
    """Perseus's iteration frontier on ``options``, its fastest point's slack reclaimed (as planned)."""
    return with_reclaimed_fastest(
        compose_iteration(options, microbatches, blocking_power_w=blocking_power_w, max_solver_steps=MAX_SOLVER_STEPS)
    )


def perseus_saving(options: Options, microbatches: int, blocking_power_w: float) -> dict[str, float]:
    """Megatron-LM (the maximum clock everywhere) and Megatron-LM + Perseus on ``options``: the
    fastest point's energy reduction and the least-energy point, in percent against Megatron-LM."""
    megatron = megatron_point(options, microbatches, blocking_power_w)
    frontier = perseus_frontier(options, microbatches, blocking_power_w)
    fastest = frontier.points[0]
    least = min(frontier.points, key=lambda p: p.energy_j)
    return {
        "megatron_time_s": megatron.time_s,
        "megatron_energy_j": megatron.energy_j,
        "mp_energy_red_pct": 100.0 * (1.0 - fastest.energy_j / megatron.energy_j),
        "mp_time_red_pct": 100.0 * (1.0 - fastest.time_s / megatron.time_s),
        "least_energy_red_pct": 100.0 * (1.0 - least.energy_j / megatron.energy_j),
        "least_energy_time_increase_pct": 100.0 * (least.time_s / megatron.time_s - 1.0),
    }


def equalised(options: Options) -> Profile:
    """Every stage with the stages' mean time and energy of each instruction at each clock."""
    stages = sorted({stage for stage, _ in options})
    out: Profile = {}
    for instruction in INSTRUCTIONS:
        per_stage = [{clock_mhz(o): o for o in options[(s, instruction)]} for s in stages]
        clocks = sorted(set.intersection(*(set(p) for p in per_stage)))
        if not clocks:
            raise ValueError(f"the stages' {instruction} options share no clock")
        mean = [
            dataclasses.replace(
                per_stage[0][clock],
                time_s=sum(p[clock].time_s for p in per_stage) / len(stages),
                energy_j=sum(p[clock].energy_j for p in per_stage) / len(stages),
            )
            for clock in clocks
        ]
        for stage in stages:
            out[(stage, instruction)] = list(mean)
    return out


def with_heavier_last_stage(options: Options, extra: float) -> Profile:
    """``options`` with the last stage's times and energies scaled by ``1 + extra`` (its power kept)."""
    last = max(stage for stage, _ in options)
    scale = 1.0 + extra
    return {
        key: [
            dataclasses.replace(o, time_s=o.time_s * scale, energy_j=o.energy_j * scale) if key[0] == last else o
            for o in items
        ]
        for key, items in options.items()
    }


def slack_sources(options: Options, microbatches: int, blocking_power_w: float) -> dict[str, Any]:
    """The three versions of the module docstring: each one's savings and its idle share (percent)."""
    base = equalised(options)
    sweep = []
    for extra_pct in EXTRA_LOAD_PCT:
        heavier = with_heavier_last_stage(base, extra_pct / 100.0)
        sweep.append(
            {
                "extra_load_pct": extra_pct,
                "idle_share_pct": 100.0 * idle_share(dict(heavier)),
                "ours_mp_energy_red_pct": perseus_saving(heavier, microbatches, blocking_power_w)["mp_energy_red_pct"],
            }
        )
    return {
        "as_planned": {
            "idle_share_pct": 100.0 * idle_share(dict(options)),
            **perseus_saving(options, microbatches, blocking_power_w),
        },
        "stages_equalised": perseus_saving(base, microbatches, blocking_power_w),
        "heavier_last_stage": sweep,
    }


def kareus_options(plan: Mapping[str, Any]) -> Profile:
    """Kareus's microbatch options of a plan (``microbatch_options``, each stage's pipeline send
    included), as composer options (knob: the option's index)."""
    out: Profile = {}
    for key, items in plan["microbatch_options"].items():
        stage, instruction = key.split("/")
        out[(int(stage), cast(Instruction, instruction))] = [
            InstructionOption(float(o["time_s"]), float(o["energy_j"]), i) for i, o in enumerate(items)
        ]
    return out


def kareus_sweep(
    megatron_profile: Options, kareus: Options, microbatches: int, blocking_power_w: float
) -> list[dict[str, float | None]]:
    """Kareus's reductions (percent; ``frontier_metrics``, against Megatron-LM and Megatron-LM +
    Perseus) with the last stage of both profiles, as planned, heavier by each of ``EXTRA_LOAD_PCT``
    (the step tail left out: it is the same for every method)."""
    out: list[dict[str, float | None]] = []
    for extra_pct in EXTRA_LOAD_PCT:
        meg = with_heavier_last_stage(megatron_profile, extra_pct / 100.0)
        base = megatron_point(meg, microbatches, blocking_power_w)

        def points(options: Options) -> list[tuple[float, float]]:
            return [(p.time_s, p.energy_j) for p in perseus_frontier(options, microbatches, blocking_power_w).points]

        mp = points(meg)
        heavier = with_heavier_last_stage(kareus, extra_pct / 100.0)
        metrics = frontier_metrics(points(heavier), (base.time_s, base.energy_j), mp)
        mp_metrics = frontier_metrics(mp, (base.time_s, base.energy_j), mp)
        out.append(
            {
                "extra_load_pct": extra_pct,
                "mp_energy_red_pct": _pct(mp_metrics["max_throughput_energy_reduction"]),
                **{f"kareus_{name}_pct": _pct(value) for name, value in metrics.items()},
            }
        )
    return out


def _pct(fraction: float | None) -> float | None:
    return None if fraction is None else 100.0 * fraction


def calibration_paper_mp_energy_red() -> dict[str, float]:
    """The paper's Megatron-LM + Perseus energy reduction (percent) of each calibration row."""
    out = {}
    for row in calibration_rows():
        value = csv_number(row["mp_energy_red"])
        if value is not None:
            out[row["preset"]] = value
    return out


def analyse(plan_dir: Path, paper: Mapping[str, float]) -> dict[str, Any]:
    """:func:`slack_sources` of the plan in ``plan_dir``, with the idle share matching the paper's
    saving where the plan is of a calibration row."""
    plan = json.loads((plan_dir / "plan.json").read_text())
    preset = plan["workload"].get("preset")
    options = read_perseus_profile(plan_dir / "perseus_profile.csv")
    microbatches, blocking_power_w = int(plan["workload"]["microbatches"]), gpu_spec(plan["gpu"]).blocking_power_w
    sources = slack_sources(options, microbatches, blocking_power_w)
    paper_pct = paper.get(preset) if preset is not None else None
    return {
        "preset": preset,
        "gpu": plan["gpu"],
        **sources,
        "kareus_heavier_last_stage": kareus_sweep(options, kareus_options(plan), microbatches, blocking_power_w),
        "paper_mp_energy_red_pct": paper_pct,
        "idle_share_pct_matching_paper": None
        if paper_pct is None
        else matching_idle_share(sources["heavier_last_stage"], paper_pct),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("plans", nargs="+", type=Path, help="plan directories (kareus plan --out DIR)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    paper = calibration_paper_mp_energy_red()
    report = [analyse(d, paper) for d in args.plans]
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print("Megatron-LM + Perseus on each plan's profile (ours: simulated; paper: measured, calibration rows only)")
    for r in report:
        planned, equal = r["as_planned"], r["stages_equalised"]
        print(
            f"  {r['preset']}: as planned (idle {planned['idle_share_pct']:.1f} %) saves "
            f"{planned['mp_energy_red_pct']:.1f} %, stages equalised {equal['mp_energy_red_pct']:.1f} %; "
            f"least energy {planned['least_energy_red_pct']:.1f} % below Megatron-LM at "
            f"+{planned['least_energy_time_increase_pct']:.1f} % time"
        )
        sweep = "  ".join(
            f"+{p['extra_load_pct']:.0f} % (idle {p['idle_share_pct']:.1f} %) -> {p['ours_mp_energy_red_pct']:.1f} %"
            for p in r["heavier_last_stage"]
        )
        print(f"    last stage heavier: {sweep}")
        kareus = "  ".join(
            f"+{p['extra_load_pct']:.0f} %: M+P e {_fmt(p['mp_energy_red_pct'])}, K t "
            f"{_fmt(p['kareus_max_throughput_time_reduction_pct'])} e {_fmt(p['kareus_max_throughput_energy_reduction_pct'])} "
            f"iso-e t {_fmt(p['kareus_iso_energy_time_reduction_pct'])}"
            for p in r["kareus_heavier_last_stage"]
        )
        print(f"    as planned, last stage heavier, Kareus beside M+P: {kareus}")
        if r["paper_mp_energy_red_pct"] is not None:
            match = r["idle_share_pct_matching_paper"]
            print(
                f"    paper {r['paper_mp_energy_red_pct']:.1f} %: at idle share "
                f"{'n/a' if match is None else f'{match:.1f} %'}"
            )
    return 0


def _fmt(pct: float | None) -> str:
    return "n/a" if pct is None else f"{pct:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
