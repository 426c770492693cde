"""A recorded run against a plan: per iteration, planned and measured time and energy, and the
ratios' median and spread (p10-p90) over the iterations after warm-up.

The prediction of each iteration is read from the plan given (its frontier point the run
recorded; of a bucketed plan, the bucket's frontier the record names), not from the record, so a
run can be held against another plan of the same workload (a recalibrated one, ``kareus plan
--calibrate-from``). Energy is compared per GPU (a record's
energy covers ``gpus_measured`` GPUs, the plan's one pipeline ``tp x cp x pp``), assuming every
GPU of the pipeline costs alike.
"""

from __future__ import annotations

import base64
import html
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from kareus_fx.deploy.run_record import RunRecord
from kareus_fx.errors import KareusError
from kareus_fx.plan.plan_format import Plan
from kareus_fx.report.figure_png import figure_png

_COLUMNS = ("iter", "rank", "seq", "point", "time ms", "plan ms", "x", "energy J", "plan J", "x", "energy from")

__all__ = ["IterationRow", "RatioSpread", "RunComparison", "compare_run", "comparison_html", "print_comparison"]


@dataclass(frozen=True)
class RatioSpread:
    """Measured over planned: median and the 10th and 90th percentiles."""

    median: float
    p10: float
    p90: float

    @classmethod
    def of(cls, ratios: Sequence[float]) -> RatioSpread:
        if len(ratios) == 1:
            return cls(ratios[0], ratios[0], ratios[0])
        deciles = statistics.quantiles(ratios, n=10, method="inclusive")
        return cls(statistics.median(ratios), deciles[0], deciles[-1])


@dataclass(frozen=True)
class IterationRow:
    """One record against the plan."""

    iteration: int
    rank: int
    bucket: int | None
    point: int
    time_s: float
    planned_time_s: float
    time_ratio: float
    energy_j: float
    planned_energy_j: float
    energy_ratio: float
    energy_source: str


@dataclass(frozen=True)
class RunComparison:
    """Every row, and the spread of the rows from iteration ``warmup`` on."""

    plan: str
    warmup: int
    rows: tuple[IterationRow, ...]
    time: RatioSpread
    energy: RatioSpread
    energy_source: str

    def as_json(self) -> dict[str, Any]:
        """The numbers, machine-readably."""
        return asdict(self)


def compare_run(records: Sequence[RunRecord], plan: Plan, warmup: int = 1) -> RunComparison:
    """Hold ``records`` against ``plan`` (see the module docstring); refuses records of another GPU
    or a point or bucket the plan does not have, and a run with no iteration after ``warmup``."""
    workload = plan.workload
    pipeline_gpus = int(workload["tp"] * workload["cp"] * workload["pp"])
    frontiers = {seq: plan.bucket(seq).frontier for seq in plan.buckets}
    rows = []
    for record in records:
        frontier = plan.frontier if record.bucket is None else frontiers.get(record.bucket, [])
        if record.gpu != plan.gpu or record.point >= len(frontier):
            ran = f"point {record.point}" + ("" if record.bucket is None else f" of bucket seq={record.bucket}")
            raise KareusError(
                f"the run of {record.plan} (rank {record.rank}, iteration {record.iteration}) ran {ran} of a "
                f"{record.gpu} plan; {plan.source} is a {plan.gpu} plan of {_points_text(plan, frontiers)}: give "
                f"the plan the run deployed (or one re-planned for its workload)"
            )
        point = frontier[record.point]
        planned_time_s, planned_energy_j = float(point["time_s"]), float(point["energy_j"])
        rows.append(
            IterationRow(
                iteration=record.iteration,
                rank=record.rank,
                bucket=record.bucket,
                point=record.point,
                time_s=record.time_s,
                planned_time_s=planned_time_s,
                time_ratio=record.time_s / planned_time_s,
                energy_j=record.energy_j,
                planned_energy_j=planned_energy_j,
                energy_ratio=(record.energy_j / record.gpus_measured) / (planned_energy_j / pipeline_gpus),
                energy_source=record.energy_source,
            )
        )
    kept = [row for row in rows if row.iteration >= warmup]
    if not kept:
        raise KareusError(f"the run has no iteration after the {warmup} warm-up iteration(s); lower --warmup")
    sources = sorted({row.energy_source for row in kept})
    return RunComparison(
        plan=str(plan.source),
        warmup=warmup,
        rows=tuple(rows),
        time=RatioSpread.of([row.time_ratio for row in kept]),
        energy=RatioSpread.of([row.energy_ratio for row in kept]),
        energy_source="+".join(sources),
    )


def _points_text(plan: Plan, frontiers: dict[int, list[Mapping[str, Any]]]) -> str:
    """How many frontier points ``plan`` has (per bucket of a bucketed plan)."""
    if not frontiers:
        return f"{len(plan.frontier)} points"
    return "buckets " + ", ".join(f"seq={seq} ({len(points)} points)" for seq, points in frontiers.items())


def print_comparison(comparison: RunComparison, console: Console) -> None:
    """The per-iteration table and the ratios' summary."""
    table = Table(title=f"run against {comparison.plan}")
    for column in _COLUMNS:
        table.add_column(column, justify="right")
    for row in comparison.rows:
        table.add_row(*_cells(row))
    console.print(table)
    console.print(_summary(comparison))


def _cells(row: IterationRow) -> tuple[str, ...]:
    """One row's cells, in :data:`_COLUMNS` order."""
    return (
        str(row.iteration),
        str(row.rank),
        "-" if row.bucket is None else str(row.bucket),
        str(row.point),
        f"{row.time_s * 1e3:.1f}",
        f"{row.planned_time_s * 1e3:.1f}",
        f"{row.time_ratio:.3f}",
        f"{row.energy_j:.2f}",
        f"{row.planned_energy_j:.2f}",
        f"{row.energy_ratio:.3f}",
        row.energy_source,
    )


def _summary(comparison: RunComparison) -> str:
    t, e = comparison.time, comparison.energy
    return (
        f"measured / planned from iteration {comparison.warmup} on: time median {t.median:.3f} "
        f"(p10-p90 {t.p10:.3f}-{t.p90:.3f}), energy per GPU median {e.median:.3f} (p10-p90 {e.p10:.3f}-{e.p90:.3f}, "
        f"energy from {comparison.energy_source})"
    )


def ratios_png(comparison: RunComparison) -> bytes:
    """Measured over planned time and energy per iteration, with the warm-up shaded."""

    def draw(ax: Any) -> None:
        for rank in sorted({row.rank for row in comparison.rows}):
            rows = [row for row in comparison.rows if row.rank == rank]
            its = [row.iteration for row in rows]
            ax.plot(its, [row.time_ratio for row in rows], marker="o", label=f"time, rank {rank}")
            ax.plot(its, [row.energy_ratio for row in rows], marker="s", label=f"energy per GPU, rank {rank}")
        ax.axhline(1.0, color="grey", linewidth=1)
        if comparison.warmup:
            ax.axvspan(-0.5, comparison.warmup - 0.5, color="grey", alpha=0.15, label="warm-up")
        ax.set_xlabel("iteration")
        ax.set_ylabel("measured / planned")
        ax.grid(alpha=0.3)
        ax.legend()

    return figure_png(draw, figsize=(7, 4))


def comparison_html(comparison: RunComparison) -> str:
    """A self-contained page: the plot, the summary and the per-iteration table."""
    image = base64.b64encode(ratios_png(comparison)).decode()
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in _cells(row)) + "</tr>" for row in comparison.rows
    )
    head = "".join(f"<th>{html.escape(column)}</th>" for column in _COLUMNS)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>run against {html.escape(comparison.plan)}</title></head>
<body>
<h1>Run against {html.escape(comparison.plan)}</h1>
<p>{html.escape(_summary(comparison))}</p>
<img id="ratios" alt="measured over planned per iteration" src="data:image/png;base64,{image}">
<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>
</body></html>
"""
