"""``kareus inspect``: read a graph dump without the model code and show what the passes found."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from kareus_fx.dump_summary import summary_table


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
            f"{i}. {slot['bound'] or '?'}: {_short_ops(slot['ops'])} "
            f"({slot['flops'] / 1e9:.1f} / {slot['bytes'] / 1e6:.1f})"
            for i, slot in enumerate(t["slots"])
        )
        c = t["collective"]
        fused = f" x{c['fused']} fused" if c["fused"] > 1 else ""
        table.add_row(
            f"{t['label']}\n[dim]{t['type']}[/dim]", str(t["count"]), slots,
            f"{c['kind']}{fused}\n{c['bytes'] / 2**20:.1f} MiB, group {c['group_size']}",
            ", ".join(map(str, t["launch_slots"])) or "none (sequential only)",
        )
    return table


def print_dump(dump: dict[str, Any], console: Console, title: str) -> None:
    """Graph totals, then each graph's partition types and leftovers."""
    console.print(summary_table(dump, title=title))
    for graph in dump["graphs"]:
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


def _short_ops(targets: list[str]) -> str:
    names = [t.split(".")[1] if t.startswith(("aten.", "kareus.")) else t for t in targets]
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} ops)"
