"""What ``kareus inspect`` shows of a plan: provenance, partition types, the configuration chosen
at the max-throughput point, and the frontier with the baselines.

Everything is computed from the plan's JSON alone (no model code, no profiler). Tables are built
once as :class:`Tabular` data and rendered either as rich tables (text) or as HTML.

The timelines of the HTML report re-simulate partition types rebuilt from the plan's records
(:func:`rebuild_partition_type`). Assumption: a plan records per slot only the op names and the
slot's total FLOPs and bytes, so a rebuilt slot splits its totals evenly over its ops. That is
exact for a single-op slot (every compute-bound slot) and approximate for a group of short
memory-bound ops; the report prints the rebuilt prediction next to the plan's measurement where
the plan has one for the same configuration.
"""

from __future__ import annotations

import base64
import html
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.plan.plan_format import INSTRUCTIONS, Plan, instruction_key
from kareus_fx.plan.plan_schema import comm_library_of
from kareus_fx.report.dump_summary import short_op_name, short_ops_text
from kareus_fx.report.plan_report import metrics_table, report_html
from kareus_fx.report.timeline_plot import TimelinePanel, timeline_png
from kareus_fx.workload import CollectiveSpec, OpCost, PartitionConfig, PartitionType, SlotSpec

__all__ = [
    "Tabular",
    "TypeSchedule",
    "chosen_options_table",
    "frontier_text",
    "partition_types_table",
    "plan_report_html",
    "print_plan",
    "provenance_lines",
    "ranges_text",
    "rebuild_partition_type",
    "timelines_html",
    "type_schedules",
]


@dataclass(frozen=True)
class Tabular:
    """A table as data: rendered to text (rich) or HTML from the same rows."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def to_rich(self) -> Table:
        table = Table(title=escape(self.title))
        for header in self.headers:
            table.add_column(header)
        for row in self.rows:
            table.add_row(*(escape(cell) for cell in row))
        return table

    def to_html(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.headers)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(cell).replace(chr(10), '<br>')}</td>" for cell in row) + "</tr>"
            for row in self.rows
        )
        return f"<h3>{html.escape(self.title)}</h3>\n<table><tr>{head}</tr>{body}</table>\n"


# ----- provenance -------------------------------------------------------------------------------
def provenance_lines(plan: Plan) -> list[str]:
    """Workload, GPU, where the numbers come from, and what the energies cover."""
    data, w = plan.data, plan.workload
    preset = f" (preset {w['preset']})" if w.get("preset") else ""
    lines = [
        f"workload: {w['model']}{preset}, {'unknown' if w['layers'] is None else w['layers']} layers, TP{w['tp']} CP{w['cp']} PP{w['pp']} DP{w.get('dp', 1)} "
        f"({w['world_size']} GPUs per pipeline), {w['microbatches']} microbatches of {w['mbs']} x {w['seq']} tokens",
        f"GPU: {plan.gpu}; profiler: {data.get('profiler', '?')}",
    ]
    if data.get("simulated"):
        lines.append(
            "every time and energy below is a prediction of the simulated GPU (a calibrated cost "
            "model), not a measurement on hardware"
        )
        stale = _simulator_changed(plan)
        if stale:
            lines.append(stale)
    else:
        lines.append("times and energies were measured on the device by the profiler above")
    lines.append(f"energy scope: {data.get('energy_scope', '?')}")
    lines.append(f"made by kareus-fx {data.get('kareus_fx_version', '?')} at {data.get('created_utc', '?')}")
    return lines


def _simulator_changed(plan: Plan) -> str | None:
    """A warning when the simulator's parameters differ from those the plan was made with."""
    recorded = str(plan.data.get("profiler", ""))
    current = SimulatedProfiler(plan.gpu).kind
    if recorded.split(":")[:2] == current.split(":")[:2]:
        return None
    return (
        f"note: this plan was made with simulator parameters {recorded!r}; the installed simulator has "
        f"{current!r}, so re-simulated timelines may differ from the plan's numbers"
    )


# ----- partition types --------------------------------------------------------------------------
def rebuild_partition_type(type_id: str, record: Mapping[str, Any]) -> PartitionType:
    """A :class:`PartitionType` from a plan's ``partition_types`` record (see the module docstring:
    a slot's FLOPs and bytes are split evenly over its ops)."""
    slots = []
    for s, slot in enumerate(record["slots"]):
        targets = list(slot["ops"]) or ["?"]
        n = len(targets)
        bound = slot.get("bound")
        slots.append(
            SlotSpec(
                ops=tuple(
                    OpCost(
                        name=f"slot{s}.{k}:{short_op_name(target)}",
                        target=target,
                        flops=slot["flops"] / n,
                        bytes=slot["bytes"] / n,
                        bound=bound,
                    )
                    for k, target in enumerate(targets)
                )
            )
        )
    return PartitionType(
        type_id=type_id,
        graph=record["graph"],
        slots=tuple(slots),
        collective=CollectiveSpec(**record["collective"]),
        count=int(record["count"]),
        launch_slots=tuple(record["launch_slots"]),
    )


def partition_types_table(plan: Plan) -> Tabular:
    """One row per plan partition type: structure, collective and how its tuning went."""
    rows = []
    for tid, rec in plan.data["partition_types"].items():
        c = rec["collective"]
        fused = f" x{c['fused']} fused" if c.get("fused", 1) > 1 else ""
        slots = "\n".join(
            f"{i}. {slot.get('bound') or '?'}: {short_ops_text(slot['ops'])} "
            f"({slot['flops'] / 1e9:.2f} GFLOP / {slot['bytes'] / 1e6:.1f} MB)"
            for i, slot in enumerate(rec["slots"])
        )
        tuning = rec.get("tuning") or {}
        tuned = (
            (
                f"{tuning['measured']} of {tuning['space_size']} ({100 * tuning['fraction_measured']:.1f}%), "
                f"{tuning['stop_reason']}"
            )
            if tuning
            else "n/a"
        )
        rows.append(
            (
                tid,
                rec["graph"],
                str(rec["count"]),
                f"{c['kind']}{fused}\n{c['bytes'] / 2**20:.1f} MiB, group {c['group_size']}",
                slots,
                ", ".join(map(str, rec["launch_slots"])) or "none (sequential only)",
                tuned,
                str(len(rec["frontier"])),
            )
        )
    return Tabular(
        title=f"{len(rows)} partition types",
        headers=(
            "type",
            "graph",
            "count per microbatch",
            "collective",
            "slots (bound: ops, work)",
            "launch slots",
            "tuning: measured of space",
            "frontier points",
        ),
        rows=tuple(rows),
    )


# ----- the chosen configuration -----------------------------------------------------------------
def _config_text(option: Mapping[str, Any]) -> str:
    if option["configs"] is None:
        return "whole microbatch un-split (sequential)"
    parts = []
    for tid, cfg in sorted(option["configs"].items()):
        where = "sequential" if cfg["launch_slot"] is None else f"launch at slot {cfg['launch_slot']}"
        parts.append(f"{tid}: {cfg['comm_sms']} comm SMs, {where}")
    return "\n".join(parts)


def chosen_options_table(plan: Plan, point_index: int) -> Tabular:
    """Per (stage, instruction) the microbatch options the frontier point runs, grouped."""
    point = plan.frontier[point_index]
    rows = []
    for stage in range(plan.workload["pp"] * plan.workload.get("virtual_stages", 1)):  # global stages
        for instruction in INSTRUCTIONS:
            key = instruction_key(stage, instruction)
            by_option: dict[int, list[int]] = {}
            for microbatch, index in enumerate(point["choices"][key]):
                by_option.setdefault(index, []).append(microbatch)
            for index, microbatches in sorted(by_option.items()):
                option = plan.data["microbatch_options"][key][index]
                rows.append(
                    (
                        f"{stage}",
                        instruction,
                        ranges_text(microbatches),
                        f"{option['clock_mhz']}",
                        _config_text(option),
                        f"{option['time_s'] * 1e3:.3f}",
                        f"{option['energy_j']:.2f}",
                    )
                )
    return Tabular(
        title=(
            f"configuration at frontier point {point_index} of {len(plan.frontier)} "
            f"({point['time_s']:.4f} s, {point['energy_j'] / 1e3:.3f} kJ per iteration)"
        ),
        headers=(
            "stage",
            "instruction",
            "microbatches",
            "clock (MHz)",
            "per partition type",
            "microbatch time (ms)",
            "microbatch energy (J, traced GPU)",
        ),
        rows=tuple(rows),
    )


@dataclass(frozen=True)
class TypeSchedule:
    """The schedule a partition type runs at a frontier point (its most frequent one)."""

    type_id: str
    config: PartitionConfig
    uses: int
    """(stage, instruction, microbatch) nodes that run the type with this schedule."""
    other_schedules: int
    """Other distinct schedules of the type at the same point."""


def type_schedules(plan: Plan, point_index: int, default_comm_sms: int) -> dict[str, TypeSchedule]:
    """Per partition type its most frequent (clock, comm SMs, launch slot) at the frontier point.

    A microbatch that runs un-split runs every type sequentially at its clock with
    ``default_comm_sms`` (what un-split execution uses)."""
    point = plan.frontier[point_index]
    counts: dict[str, Counter] = {}
    types_of_graph: dict[str, set[str]] = {}
    for stage in plan.data["stages"]:
        for instruction, graph in stage["graphs"].items():
            types_of_graph.setdefault(instruction_key(stage["stage"], instruction), set()).update(
                graph["partition_types"].values()
            )
    for key, indices in point["choices"].items():
        for index in indices:
            option = plan.data["microbatch_options"][key][index]
            if option["configs"] is None:
                for tid in types_of_graph.get(key, ()):
                    counts.setdefault(tid, Counter())[
                        PartitionConfig(option["clock_mhz"], default_comm_sms, None, "nccl")
                    ] += 1
                continue
            for tid, cfg in option["configs"].items():
                config = PartitionConfig(option["clock_mhz"], cfg["comm_sms"], cfg["launch_slot"], comm_library_of(cfg))
                counts.setdefault(tid, Counter())[config] += 1
    schedules = {}
    for tid, counter in counts.items():
        config, uses = counter.most_common(1)[0]
        schedules[tid] = TypeSchedule(tid, config, uses, len(counter) - 1)
    return schedules


# ----- text output ------------------------------------------------------------------------------
def print_plan(plan: Plan, console: Console, title: str) -> None:
    """The text summary of ``kareus inspect PLAN``."""
    console.print(f"[bold]{escape(title)}[/bold]: kareus plan (schema {plan.data['schema_version']})")
    for line in provenance_lines(plan):
        console.print(escape(line))
    if plan.buckets:
        console.print(f"sequence-length buckets {', '.join(map(str, plan.buckets))} (tables: the largest)")
        for seq in plan.buckets:
            console.print(escape(f"  seq {seq}: {frontier_text(plan.bucket(seq))}"))
    console.print(partition_types_table(plan).to_rich())
    fastest = plan.point_index("max-throughput")
    console.print(chosen_options_table(plan, fastest).to_rich())
    console.print(escape(frontier_text(plan)))
    console.print(metrics_table(plan.data))


def frontier_text(plan: Plan) -> str:
    """One line on the iteration frontier: size, fastest and least-energy points."""
    points = plan.frontier
    fastest = points[plan.point_index("max-throughput")]
    least = min(points, key=lambda p: (p["energy_j"], p["time_s"]))
    return (
        f"Kareus iteration frontier: {len(points)} points, from {fastest['time_s']:.4f} s / "
        f"{fastest['energy_j'] / 1e3:.3f} kJ (max throughput) to {least['time_s']:.4f} s / "
        f"{least['energy_j'] / 1e3:.3f} kJ (least energy); baselines: "
        f"{', '.join(m for m in plan.data['methods'] if m != 'kareus')}"
    )


def ranges_text(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = values[0]
    for v in list(values[1:]) + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(out)


# ----- HTML report --------------------------------------------------------------------------------
def plan_report_html(plan: Plan) -> str:
    """The self-contained HTML report of a plan: :func:`report.report_html` (frontier image and
    metrics) followed by provenance, partition types, the chosen configuration and, per partition
    type, the timeline of its chosen schedule beside the sequential one (re-simulated)."""
    fastest = plan.point_index("max-throughput")
    sections = [
        "<h2>Provenance</h2><ul>"
        + "".join(f"<li>{html.escape(line)}</li>" for line in provenance_lines(plan))
        + "</ul>",
        f"<p>{html.escape(frontier_text(plan))}</p>",
        "<h2>Partition types</h2>",
        partition_types_table(plan).to_html(),
        "<h2>Chosen configuration (max throughput)</h2>",
        chosen_options_table(plan, fastest).to_html(),
        "<h2>Partition timelines at max throughput</h2>",
        timelines_html(plan, fastest),
    ]
    return report_html(plan.data, extra_sections="\n".join(sections))


def timelines_html(plan: Plan, point_index: int) -> str:
    """Per partition type a timeline image: its schedule at the point beside the sequential one."""
    sim = Simulator(plan.gpu)
    default_sms = sim.params.default_comm_sms
    schedules = type_schedules(plan, point_index, default_sms)
    sequential = PartitionConfig(int(sim.spec.clock_max_mhz), default_sms, None, "nccl")
    parts = [
        f"<p>Each partition type re-simulated on the simulated {html.escape(plan.gpu)} from the plan's "
        f"record (a slot's FLOPs and bytes are split evenly over its ops: exact for single-op slots, "
        f"approximate for groups of memory-bound ops). Left: the schedule at the max-throughput point; "
        f"right: sequential execution as Megatron-LM runs it ({sequential.clock_mhz} MHz, "
        f"{default_sms} comm SMs, the collective after the computation).</p>"
    ]
    for tid, record in plan.data["partition_types"].items():
        schedule = schedules.get(tid)
        if schedule is None:
            parts.append(f"<h3>{html.escape(tid)}</h3><p>not run at this point</p>")
            continue
        ptype = rebuild_partition_type(tid, record)
        chosen = sim.predict(ptype, schedule.config, timeline=True)
        baseline = sim.predict(ptype, sequential, timeline=True)
        bound = {op.name: op.bound for slot in ptype.slots for op in slot.ops}
        png = timeline_png(
            [
                TimelinePanel(
                    f"chosen: {_schedule_text(schedule.config)}\n{_prediction_text(chosen)}", chosen.timeline
                ),
                TimelinePanel(
                    f"sequential: {_schedule_text(sequential)}\n{_prediction_text(baseline)}", baseline.timeline
                ),
            ],
            bound_of=bound.get,
            title=f"{tid} ({record['graph']}, {record['collective']['kind']}, x{record['count']} per microbatch)",
        )
        note = _measured_note(record, schedule.config, chosen.measurement.time_s)
        others = (
            f"; {schedule.other_schedules} other schedule(s) of this type at this point"
            if schedule.other_schedules
            else ""
        )
        caption = (
            f"this schedule in {schedule.uses} of the (stage, instruction, microbatch) steps that run "
            f"the type{others}. {note}"
        )
        parts.append(
            f"<h3>{html.escape(tid)}</h3><p>{html.escape(caption)}</p>"
            f'<img class="timeline" alt="timeline of {html.escape(tid)}" '
            f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        )
    return "\n".join(parts)


def _schedule_text(config: PartitionConfig) -> str:
    where = "sequential" if config.launch_slot is None else f"launch at slot {config.launch_slot}"
    return f"{config.clock_mhz} MHz, {config.comm_sms} comm SMs ({config.comm_library}), {where}"


def _prediction_text(prediction: Any) -> str:
    m = prediction.measurement
    return f"{m.time_s * 1e6:.1f} µs, {m.energy_j * 1e3:.2f} mJ"


def _measured_note(record: Mapping[str, Any], config: PartitionConfig, rebuilt_time_s: float) -> str:
    """How the rebuilt type's prediction compares with the plan's number for the same config."""
    for point in record["frontier"]:
        point_config = PartitionConfig(
            point["clock_mhz"], point["comm_sms"], point["launch_slot"], comm_library_of(point)
        )
        if point_config == config:
            off = rebuilt_time_s / point["time_s"] - 1.0
            return (
                f"The plan's tuner measured {point['time_s'] * 1e6:.1f} µs for this schedule; the rebuilt "
                f"type predicts {rebuilt_time_s * 1e6:.1f} µs ({100 * off:+.1f}%)."
            )
    return "The schedule is not on the type's tuned frontier in the plan (no measured time to compare)."
