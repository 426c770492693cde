"""``kareus inspect``: read a graph dump or a plan without the model code and show what it holds.

A file is a plan when its JSON has a ``"format"`` key (``plan_format`` checks it is ``"kareus-plan"``);
otherwise it must be a graph dump (``dump``). Both render as text (rich) or as one self-contained HTML page.
"""

from __future__ import annotations

import html
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kareus_fx.capture.dump import MAX_DUMP_BYTES, DumpFormatError, validate_dump
from kareus_fx.capture.validated_input import parse_json, read_bounded_text
from kareus_fx.errors import KareusError
from kareus_fx.plan.plan_format import MAX_PLAN_BYTES, Plan, PlanFormatError, validate_plan
from kareus_fx.report.dump_summary import short_ops_text, summary_table
from kareus_fx.report.plan_summary import plan_report_html, print_plan


class InspectError(KareusError, ValueError):
    """A file ``kareus inspect`` cannot read."""


_FORMAT_KEY = re.compile(r'"format"\s*:')
"""A plan's text shows its ``format`` key, even cut short; a dump has no such key."""


def partition_types_table(graph: dict[str, Any]) -> Table | None:
    """One row per partition type of a dumped graph (None if the graph was not partitioned)."""
    types = graph.get("partition_types")
    if types is None:
        return None
    table = Table(title=f"{graph['name']}: {len(types)} partition types, {len(graph['partitions'])} partitions")
    for column in ("type", "count", "slots (bound: GFLOP / MB)", "collective (MiB, group)", "launch slots"):
        table.add_column(column)
    for t in sorted(types, key=lambda t: -t["count"]):
        slots = "\n".join(
            f"{i}. {slot['bound'] or '?'}: {short_ops_text(slot['ops'])} "
            f"({slot['flops'] / 1e9:.1f} / {slot['bytes'] / 1e6:.1f})"
            for i, slot in enumerate(t["slots"])
        )
        c = t["collective"]
        fused = f" x{c['fused']} fused" if c["fused"] > 1 else ""
        table.add_row(
            f"{t['label']}\n[dim]{t['type']}[/dim]",
            str(t["count"]),
            slots,
            f"{c['kind']}{fused}\n{c['bytes'] / 2**20:.1f} MiB, group {c['group_size']}",
            ", ".join(map(str, t["launch_slots"])) or "none (sequential only)",
        )
    return table


def symbols_text(symbols: dict[str, dict[str, Any]]) -> str:
    """``s38[2, inf] = 100`` per shape symbol: its range, and the size the graph was dumped at."""
    return ", ".join(
        f"{name}[{r['min']}, {'inf' if r['max'] is None else r['max']}]"
        + ("" if r["hint"] is None else f" = {r['hint']}")
        for name, r in sorted(symbols.items())
    )


def print_dump(dump: dict[str, Any], console: Console, title: str) -> None:
    """Graph totals, then each graph's partition types and leftovers."""
    console.print(summary_table(dump, title=title))
    for graph in dump["graphs"]:
        if graph.get("symbols"):
            console.print(
                f"{graph['name']}: symbolic sizes {symbols_text(graph['symbols'])}; shapes and costs below at the hints"
            )
        table = partition_types_table(graph)
        if table is None:
            console.print(f"{graph['name']}: not partitioned (no nanobatch split or no collectives)")
            continue
        console.print(table)
        leftover = graph["leftover"]
        console.print(
            f"{graph['name']} leftover (outside partitions): {len(leftover['nodes'])} ops, "
            f"{leftover['flops'] / 1e12:.3f} TFLOP, {leftover['bytes'] / 1e9:.2f} GB, "
            f"{len(leftover['collectives'])} collectives"
        )


# ----- plans or dumps ---------------------------------------------------------------------------
@dataclass(frozen=True)
class InspectedPlan:
    """A plan ``kareus inspect`` read."""

    path: Path
    plan: Plan


@dataclass(frozen=True)
class InspectedDump:
    """A graph dump ``kareus inspect`` read (validated, as plain data)."""

    path: Path
    dump: dict[str, Any]


Inspected = InspectedPlan | InspectedDump
"""A file ``kareus inspect`` read: a plan or a graph dump."""


def load_inspectable(path: str | Path) -> Inspected:
    """Read a plan (its ``format`` is ``"kareus-plan"``) or a graph dump, validated.

    A file whose text has a ``"format"`` key is read as a plan (even when cut short), any other
    as a dump. Raises :class:`~kareus_fx.plan.plan_format.PlanFormatError` or
    :class:`~kareus_fx.capture.dump.DumpFormatError` naming the problem, :class:`InspectError`
    when the file cannot be read or is larger than any plan or dump."""
    path = Path(path)
    text = read_bounded_text(path, max(MAX_PLAN_BYTES, MAX_DUMP_BYTES), InspectError, "kareus plan or graph dump")
    if _FORMAT_KEY.search(text):
        data = parse_json(text, str(path), PlanFormatError, "kareus plan", "regenerate the plan with `kareus plan`")
        return InspectedPlan(path, Plan(data=validate_plan(data, str(path)), source=str(path)))
    data = parse_json(text, str(path), DumpFormatError, "kareus graph dump", "regenerate the dump")
    return InspectedDump(path, validate_dump(data, str(path)))


def print_inspected(item: Inspected, console: Console) -> None:
    """The text summary of a plan or a dump."""
    if isinstance(item, InspectedPlan):
        print_plan(item.plan, console, title=str(item.path))
    else:
        print_dump(item.dump, console, title=str(item.path))


def inspected_html(item: Inspected) -> str:
    """A self-contained HTML page: the plan report, or the dump summary and partition types."""
    if isinstance(item, InspectedPlan):
        return plan_report_html(item.plan)
    console = Console(record=True, width=160, file=io.StringIO())
    print_dump(item.dump, console, title=str(item.path))
    body = console.export_html(inline_styles=True, code_format='<pre style="font-size:12px">{code}</pre>')
    title = f"kareus graph dump: {item.path.name}"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"</head>\n<body><h1>{html.escape(title)}</h1>\n"
        f"<p>GPU {html.escape(str(item.dump.get('gpu')))}, rank {item.dump.get('rank')} of "
        f"{item.dump.get('world_size')}, kareus-fx {html.escape(str(item.dump.get('kareus_fx_version')))}</p>\n"
        f"{body}\n</body></html>\n"
    )
