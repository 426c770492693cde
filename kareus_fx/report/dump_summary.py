"""Summaries of graph dumps: counts, FLOPs, bytes and collectives per graph, as data and as a table."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass
class GraphSummary:
    """Totals of one dumped graph."""

    name: str
    nodes: int = 0
    kernels: int = 0
    """Kernels the computation runs as (Inductor's fusion; one per op in dumps without kernel ids)."""
    compute_bound_ops: int = 0
    memory_bound_ops: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    collectives: Counter = field(default_factory=Counter)
    collective_bytes: Counter = field(default_factory=Counter)
    collectives_per_layer: Counter = field(default_factory=Counter)
    collectives_outside_layers: Counter = field(default_factory=Counter)


def summarise_graph(graph: dict[str, Any]) -> GraphSummary:
    """Totals of one ``{"name", "nodes"}`` dump entry.

    Collectives are attributed to a decoder layer when their ``module`` path contains
    ``layers.<i>`` (the reference models' naming); all others count as outside layers.
    """
    summary = GraphSummary(name=graph["name"], nodes=len(graph["nodes"]))
    kernels = set()
    for node in graph["nodes"]:
        if node["kind"] == "compute":
            kernels.add(node.get("kernel") or node["name"])
            summary.flops += node["flops"]
            summary.bytes += node["bytes"]
            if node["bound"] == "compute":
                summary.compute_bound_ops += 1
            else:
                summary.memory_bound_ops += 1
        elif node["kind"] == "collective":
            kind = node["collective"]["kind"]
            summary.collectives[kind] += 1
            summary.collective_bytes[kind] += node["collective"]["bytes"]
            match = _LAYER_INDEX.search(node["module"] or "")
            if match:
                summary.collectives_per_layer[(int(match.group(1)), kind)] += 1
            else:
                summary.collectives_outside_layers[kind] += 1
    summary.kernels = len(kernels)
    return summary


def summary_table(dump: dict[str, Any], title: str) -> Table:
    """A rich table with one row per graph of a dump."""
    table = Table(title=title)
    for column in (
        "graph",
        "nodes",
        "kernels",
        "compute-bound ops",
        "memory-bound ops",
        "TFLOP",
        "GB moved",
        "collectives (count, GiB)",
    ):
        table.add_column(column, justify="right" if column != "graph" else "left")
    for graph in dump["graphs"]:
        s = summarise_graph(graph)
        collectives = ", ".join(
            f"{kind} x{count} ({s.collective_bytes[kind] / 2**30:.2f})" for kind, count in sorted(s.collectives.items())
        )
        table.add_row(
            s.name,
            str(s.nodes),
            str(s.kernels),
            str(s.compute_bound_ops),
            str(s.memory_bound_ops),
            f"{s.flops / 1e12:.2f}",
            f"{s.bytes / 1e9:.2f}",
            collectives or "none",
        )
    return table


def collectives_by_layer_text(dump: dict[str, Any]) -> str:
    """One line per graph: collectives per decoder layer (when uniform) and outside the layers."""
    lines = []
    for graph in dump["graphs"]:
        s = summarise_graph(graph)
        per_layer: dict[int, Counter] = {}
        for (layer, kind), count in s.collectives_per_layer.items():
            per_layer.setdefault(layer, Counter())[kind] = count
        shapes = {tuple(sorted(c.items())) for c in per_layer.values()}
        if len(shapes) == 1:
            (shape,) = shapes
            layers_text = f"{len(per_layer)} decoder layers x ({', '.join(f'{k} {v}' for k, v in shape)})"
        else:
            layers_text = f"{len(per_layer)} decoder layers, uneven: " + "; ".join(
                f"{layer}: {dict(c)}" for layer, c in sorted(per_layer.items())
            )
        outside = ", ".join(f"{k} {v}" for k, v in sorted(s.collectives_outside_layers.items())) or "none"
        lines.append(f"{graph['name']} collectives: {layers_text}; outside the layers: {outside}")
    return "\n".join(lines)


def short_op_name(target: str) -> str:
    """``aten.mm.default`` -> ``mm``; other targets unchanged."""
    return target.split(".")[1] if target.startswith(("aten.", "kareus.")) and "." in target else target


def short_ops_text(targets: list[str]) -> str:
    """A slot's ops in a few words: the op, or the first and last of several and how many."""
    names = [short_op_name(t) for t in targets]
    if not names:
        return "no ops"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} ops)"
