"""What one microbatch of one pipeline stage costs to run, read from graph dumps.

A stage's forward and backward graphs are dumped twice (``tracing.trace_both_splits``): split into
nanobatches (partition types plus the work outside partitions) and un-split (the sequential
Megatron-LM microbatch). This module turns those dumps into the inputs of the profilers and the
composer: :class:`PartitionedGraph` and :class:`SequentialGraph`. No model code is needed.

Assumption: a dump is one Dynamo graph whose ``graphs`` are "forward" and "backward" (the
reference models compile with ``fullgraph=True``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kareus_fx.capture.dump import partition_types_from_dump
from kareus_fx.errors import UnsupportedGraphError
from kareus_fx.workload import CollectiveSpec, GraphName, OpCost, PartitionType

__all__ = [
    "PartitionedGraph",
    "SequentialGraph",
    "graph_fingerprint",
    "partitioned_graphs",
    "sequential_graphs",
    "with_extra_ops",
]


@dataclass(frozen=True)
class SequentialGraph:
    """A graph run op after op: its compute ops in graph order and its collectives."""

    graph: GraphName
    ops: tuple[OpCost, ...]
    collectives: tuple[CollectiveSpec, ...]
    fingerprint: str


@dataclass(frozen=True)
class PartitionedGraph:
    """A nanobatched graph: its partition types and the work outside every partition."""

    graph: GraphName
    ptypes: tuple[PartitionType, ...]
    outside: SequentialGraph
    """Leftovers (embedding, loss, edge partitions, ops between partitions), run sequentially."""
    fingerprint: str


def graph_fingerprint(graph_record: Mapping[str, Any]) -> str:
    """A hash of a dumped graph's structure: every compute and collective op, its shapes and cost.

    Two traces of the same model, layout and microbatch shape give the same fingerprint; a plan
    compares it with the graph it is deployed on. A collective counts by its kind, bytes and
    group size, not its group's name: names number process groups in creation order, which
    differs between the planner's trace (one group per stage) and a job with several TP groups.
    The ops count as a multiset, not in graph order: the planner derives a stage's fingerprint
    from a slice of its layers (``layer_slice.py``), whose added layer it knows op by op but not
    where aot_autograd's backward interleaves it; another model, shape, dtype or layer count
    still changes the multiset.
    """
    items = sorted(
        json.dumps(
            (
                n["op"],
                n.get("shape"),
                n.get("kind"),
                None
                if n.get("collective") is None
                else {k: v for k, v in n["collective"].items() if k != "group_name"},
            ),
            sort_keys=True,
            default=str,
        )
        for n in graph_record["nodes"]
        if n.get("kind") in ("compute", "collective")
    )
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def _op_cost(node: Mapping[str, Any]) -> OpCost:
    return OpCost(
        name=node["name"],
        target=node["op"],
        flops=node["flops"],
        bytes=node["bytes"],
        bound=node["bound"],
        kernel=node.get("kernel"),
    )


_COLLECTIVE_FIELDS = tuple(f.name for f in dataclasses.fields(CollectiveSpec))


def _collective(node: Mapping[str, Any]) -> CollectiveSpec:
    """The node's collective (the dump also records its group name, which costs do not depend on)."""
    return CollectiveSpec(**{k: node["collective"][k] for k in _COLLECTIVE_FIELDS if k in node["collective"]})


def _sequential(graph: Mapping[str, Any], names: Iterable[str] | None = None) -> SequentialGraph:
    """The graph's compute ops and collectives (only ``names`` when given), in graph order."""
    wanted = None if names is None else set(names)
    ops, collectives = [], []
    for node in graph["nodes"]:
        if wanted is not None and node["name"] not in wanted:
            continue
        if node["kind"] == "compute":
            ops.append(_op_cost(node))
        elif node["kind"] == "collective":
            collectives.append(_collective(node))
    return SequentialGraph(
        graph=graph["name"], ops=tuple(ops), collectives=tuple(collectives), fingerprint=graph_fingerprint(graph)
    )


def _graphs_by_name(dump: Mapping[str, Any], what: str) -> dict[GraphName, Mapping[str, Any]]:
    """The dump's graphs by name (a loaded dump: its schema holds graph names to ``GraphName``)."""
    graphs: dict[GraphName, Mapping[str, Any]] = {g["name"]: g for g in dump["graphs"]}
    missing = {"forward", "backward"} - set(graphs)
    if missing:
        raise UnsupportedGraphError(
            f"{what} dump has no {' or '.join(sorted(missing))} graph; trace forward and backward "
            f"(loss.backward()) of one microbatch"
        )
    return graphs


def sequential_graphs(dump: Mapping[str, Any]) -> dict[GraphName, SequentialGraph]:
    """Forward and backward of an un-split dump (``options={"nanobatch": False}``)."""
    return {name: _sequential(g) for name, g in sorted(_graphs_by_name(dump, "un-split").items())}


def partitioned_graphs(dump: Mapping[str, Any]) -> dict[GraphName, PartitionedGraph]:
    """Forward and backward of a nanobatched dump: partition types and leftovers.

    Raises :class:`UnsupportedGraphError` when a graph has no partitions (the split fell back or
    the graph has no collective to overlap): the caller plans it sequentially instead.
    """
    types = partition_types_from_dump(dict(dump))
    result: dict[GraphName, PartitionedGraph] = {}
    for name, graph in sorted(_graphs_by_name(dump, "nanobatched").items()):
        ptypes = tuple(t for t in types.values() if t.graph == name)
        if not ptypes:
            raise UnsupportedGraphError(
                f"the nanobatched {name} graph has no partitions (the split fell back, or it has "
                f"no collective to overlap); plan it with nanobatch=False"
            )
        leftover = graph["leftover"]
        names = [*leftover["nodes"], *leftover["collectives"]]
        result[name] = PartitionedGraph(
            graph=name, ptypes=ptypes, outside=_sequential(graph, names), fingerprint=graph_fingerprint(graph)
        )
    return result


def with_extra_ops(
    sequential: Mapping[GraphName, SequentialGraph],
    partitioned: Mapping[GraphName, PartitionedGraph] | None,
    extra: Mapping[GraphName, tuple[OpCost, ...]],
) -> tuple[dict[GraphName, SequentialGraph], dict[GraphName, PartitionedGraph] | None]:
    """A stage's graphs with ``extra`` ops that the traced model does not run (the training
    framework's: ``megatron_dropout.py``, ``megatron_main_grad.py``) run after each graph's own: in
    the un-split graph and in the nanobatched graph's work outside its partitions. Fingerprints
    stay the traced graphs' (deployment checks those)."""

    def appended(graph: SequentialGraph) -> SequentialGraph:
        return dataclasses.replace(graph, ops=graph.ops + extra.get(graph.graph, ()))

    seq = {name: appended(g) for name, g in sequential.items()}
    if partitioned is None:
        return seq, None
    return seq, {name: dataclasses.replace(g, outside=appended(g.outside)) for name, g in partitioned.items()}
