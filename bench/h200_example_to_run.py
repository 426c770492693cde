"""Convert the pipelined example's text log (``bench/results/gpu_h200/example_run*.log``) into the
run log format (``docs/formats.md``, :class:`~kareus_fx.deploy.run_record.RunRecord`).

    python bench/h200_example_to_run.py bench/results/gpu_h200/example_run1.log \\
        --plan bench/results/gpu_h200/example_plan.json --out bench/results/gpu_h200/example_run1.jsonl

Each ``iter N: T ms ... clocks [c, ...] MHz | plan ... measured energy E J`` line becomes one
record of rank 0, stage 0, at the plan's max-throughput point (what ``examples/train_pipelined.py``
deployed): the time and the Zeus-measured energy of the one GPU, and the plan's prediction of that
point. The clocks list is the stage's instructions in the example's order, forward and backward of
each microbatch in turn (1F1B on one stage); the clocks were requested from a dry-run controller.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kareus_fx.deploy.run_record import RunRecord, record_line
from kareus_fx.plan.plan_format import Plan, load_plan

_ITERATION = re.compile(
    r"^iter (\d+):\s+([\d.]+) ms .*clocks \[([\d, ]+)\] MHz .*measured energy ([\d.]+) J$", re.MULTILINE
)


def convert(log_text: str, plan: Plan, plan_name: str) -> list[RunRecord]:
    """The records of every iteration line of ``log_text``."""
    point = plan.point_index("max-throughput")
    predicted = plan.frontier[point]
    workload = plan.workload
    records = []
    for match in _ITERATION.finditer(log_text):
        clocks = [int(c) for c in match.group(3).split(",")]
        names = [f"{kind}{mb}@S0" for mb in range(len(clocks) // 2) for kind in ("F", "B")]
        records.append(
            RunRecord(
                iteration=int(match.group(1)),
                rank=0,
                stages=[0],
                plan=plan_name,
                gpu=plan.gpu,
                point=point,
                clocks_mhz=dict(sorted(zip(names, clocks, strict=True))),
                clocks_requested=True,
                time_s=float(match.group(2)) / 1e3,
                energy_j=float(match.group(4)),
                energy_source="zeus",
                gpus_measured=1,
                predicted_time_s=float(predicted["time_s"]),
                predicted_energy_j=float(predicted["energy_j"]),
                predicted_gpus=int(workload["tp"] * workload["cp"] * workload["pp"]),
            )
        )
    if not records:
        raise SystemExit("no 'iter N: ... measured energy E J' line in the log")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    records = convert(args.log.read_text(), load_plan(args.plan), args.plan.name)
    args.out.write_text("".join(record_line(r) for r in records))
    print(f"wrote {len(records)} records to {args.out}")


if __name__ == "__main__":
    main()
