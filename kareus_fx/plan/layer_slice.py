"""A pipeline stage's graphs at full size from two traces of a slice of its layers.

Tracing every layer of a stage costs about a second per layer and graph (Dynamo, aot_autograd,
the backend's passes); the decoder layers are identical, so the planner traces each stage, in its
role (embedding on the first stage, LM head and loss on the last), with ``k`` and ``k + 1`` layers
(``SLICE_LAYERS``): 2 layers (first and last), then 3 (first, one middle, last). The partition
pass's edge rule counts partitions (``passes/partitions.py``, step 6), so it is applied again at
the full-size counts (below).

What one more layer adds is measured node by node: per node key, the longer trace's count minus
the shorter's, never negative (else :class:`SliceNotRepresentativeError`; the planner then warns
and traces the stage in full). The stage's graph is the longer trace's with ``layers - k - 1``
more copies of that added layer: the same ops, shapes, costs, collectives, partition types and
leftover membership per node as a full trace, so its fingerprint
(:func:`~kareus_fx.plan.graph_workload.graph_fingerprint`, a multiset of ops) is the full
trace's, and deployment checks a plan against a live graph exactly as before. Each partition
type's count is extended linearly, ``count(k+1) + (layers - k - 1) x (count(k+1) - count(k))``; a
type the partition pass would dissolve as an edge at that count (``passes/partitions.py``, step
6) but the slice keeps is refused.

Nodes are compared by everything that prices or fingerprints them (op, kind, shape, dtype, FLOPs,
bytes, bound, collective without its group name, nanobatch, slot, the type of their partition and
whether they are leftover work), not by name, inputs or module path, which number layers.
Only computation and collective nodes are kept (placeholders hold every layer's parameters, waits
and outputs are free). The result is a summary dump for
:func:`~kareus_fx.plan.graph_workload.partitioned_graphs` and ``sequential_graphs``, not a
replayable one. When the longer trace is the shorter one with one contiguous block inserted
(:func:`inserted_block`: the un-split graphs and the nanobatched forward), the copies (named
``<node>~<copy>``) go there and the order is a full trace's, so sums of costs are too, to the last
bit (the iteration solver is sensitive to that), and so are the kernels: a kernel that spans the
layer boundary (Inductor fuses a layer's residual add into the next layer's RMSNorm) chains each
copy into the next (:func:`_copies_with_kernels`). Otherwise (aot_autograd's nanobatched backward
interleaves layers) they follow the added layer's last node, in its order, and their kernels
join only within a copy; the simulated profiler's cost of work outside partitions does not
depend on order beyond rounding. ``partitions`` holds the longer trace's partitions (one exemplar
per type is all those readers use).

Assumption: every middle decoder layer of the model has the same structure (no per-layer
attention pattern or width), which holds for the reference models (``kareus_fx.models``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from itertools import pairwise
from typing import Any

from kareus_fx.errors import UnsupportedGraphError

__all__ = [
    "SLICE_LAYERS",
    "SPARSE_SLICE_LAYERS",
    "SliceNotRepresentativeError",
    "added_layer",
    "block_dump",
    "extend_dump",
    "inserted_block",
    "slice_pays",
]

SLICE_LAYERS = (2, 3)
"""Layer counts of the two slice traces, the same for both splits (each trace dumps both,
``tracing.trace_both_splits``): first + last, then first + one middle + last. (Un-split 1 and 2
layers give the same op multiset but not the full trace's backward order, whose float sums then
differ in the last bit.)"""

_PRICED_KINDS = ("compute", "collective")
_NODE_FIELDS = ("op", "kind", "shape", "dtype", "flops", "bytes", "bound", "nanobatch")
NodeKey = tuple[str | bool | None, ...]
"""A priced node's comparison key: its ``_NODE_FIELDS`` (repr), collective (repr, group name
left out), partition type, slot (repr), and whether it is leftover work of a partitioned graph."""


SPARSE_SLICE_LAYERS = (3, 4)
"""Layer counts of the slice traces of a mixture of experts. Its nanobatched backward has a partition
type that one more sparse layer adds two of, from one in two layers: there the partition pass
dissolves it as an edge (fewer than half the most frequent type's count, ``passes/partitions.py``)
while the full stage keeps it, so a 2-layer slice is not the full stage's structure and 3 layers
are the least that are."""


def slice_pays(num_layers: int, slice_layers: tuple[int, int] = SLICE_LAYERS) -> bool:
    """Whether tracing the slices costs fewer layer traces than the ``num_layers``-layer stage."""
    return sum(slice_layers) < num_layers


class SliceNotRepresentativeError(UnsupportedGraphError):
    """Two slice traces of a stage that do not differ by one repeated block of nodes."""


def inserted_block(shorter: Sequence[Hashable], longer: Sequence[Hashable]) -> tuple[int, int] | None:
    """``(at, length)`` when ``longer`` is ``shorter`` with one block of ``length`` nodes inserted
    at ``at``, the first position where they differ; else None.

    If the traces are ``X + layer + Y`` and ``X + Y`` (layers in graph order), the block is the
    layer rotated by ``r = at - len(X)`` (``Y`` starts with ``layer[:r]``), so inserting it at
    ``at`` ``n`` times gives ``X + layer * (n + 1) + Y``: a full trace's order."""
    length = len(longer) - len(shorter)
    at = 0
    while at < len(shorter) and shorter[at] == longer[at]:
        at += 1
    if length <= 0 or at == 0 or longer[at + length :] != shorter[at:]:
        return None
    return at, length


def added_layer(shorter: Sequence[Hashable], longer: Sequence[Hashable], what: str) -> list[int]:
    """Positions in ``longer`` of the nodes one more layer adds: per key, the last
    ``count_longer - count_shorter`` nodes with that key. Raises
    :class:`SliceNotRepresentativeError` if a key is rarer in ``longer`` or nothing is added."""
    added = Counter(longer)
    added.subtract(Counter(shorter))
    fewer = sorted(str(key) for key, count in added.items() if count < 0)
    if fewer:
        raise SliceNotRepresentativeError(
            f"{what}: the trace with one more layer has fewer nodes of {len(fewer)} kinds "
            f"(e.g. {fewer[0][:200]}); the layers are not a repeated block"
        )
    if not +added:
        raise SliceNotRepresentativeError(f"{what}: the trace with one more layer adds no nodes")
    positions = []
    for index in range(len(longer) - 1, -1, -1):
        if added[longer[index]] > 0:
            added[longer[index]] -= 1
            positions.append(index)
    return positions[::-1]


def _priced_nodes(graph: Mapping[str, Any], dissolved: frozenset[str]) -> tuple[list[Mapping[str, Any]], list[NodeKey]]:
    """The graph's computation and collective nodes and their comparison keys, with the
    partitions of the ``dissolved`` types counted as leftover work (as the partition pass's edge
    rule leaves them at full size)."""
    partition_type: dict[str, str] = {}
    for partition in graph.get("partitions") or []:
        if partition["type"] in dissolved:
            continue
        for name in [*partition["collectives"], *(n for slot in partition["slots"] for n in slot)]:
            partition_type[name] = partition["type"]
    nodes = [n for n in graph["nodes"] if n["kind"] in _PRICED_KINDS]
    partitioned = "partitions" in graph
    keys = []
    for node in nodes:
        collective = node.get("collective")
        ptype = partition_type.get(node["name"])
        keys.append(
            (
                *(repr(node.get(f)) for f in _NODE_FIELDS),
                None
                if collective is None
                else repr(sorted((k, v) for k, v in collective.items() if k != "group_name")),
                ptype,
                repr(node.get("slot")) if ptype is not None else None,
                partitioned and ptype is None,
            )
        )
    return nodes, keys


def _extended_counts(short: Mapping[str, Any], long: Mapping[str, Any], copies: int) -> dict[str, int]:
    """Each partition type's count at full size, extended linearly (negative: a type that one
    more layer makes rarer, an edge of the slice)."""
    short_counts = {t["type"]: t["count"] for t in short.get("partition_types") or []}
    long_counts = {t["type"]: t["count"] for t in long.get("partition_types") or []}
    return {
        t: long_counts.get(t, 0) + copies * (long_counts.get(t, 0) - short_counts.get(t, 0))
        for t in {*short_counts, *long_counts}
    }


def _copies_with_kernels(
    block: Sequence[Mapping[str, Any]], long_nodes: Sequence[Mapping[str, Any]], at: int, copies: int, chain: bool
) -> tuple[list[dict[str, Any]], list[Mapping[str, Any]]]:
    """``copies`` copies of ``block`` to insert at ``at`` in ``long_nodes``, named ``<node>~<copy>``
    with kernel ids ``<kernel>~<copy>``, and ``long_nodes[at:]`` with kernel ids that follow them.

    A node of the block that shares its predecessor's kernel in ``long_nodes`` shares its actual
    predecessor's. With ``chain`` (``long_nodes[at - 1]`` stands for the block's last node, which
    precedes each later copy) that holds for ``block[0]`` too, so a kernel that spans the layer
    boundary (Inductor fuses a layer's residual add into the next layer's norm) chains each copy
    into the next, and the last copy into ``long_nodes[at]``, as in a full trace
    (``workload.fused_kernels`` merges consecutive ops of one id). Without it kernels join only
    within a copy, never across its ends."""
    joins = [
        chain and block[0].get("kernel") is not None and block[0].get("kernel") == long_nodes[at - 1].get("kernel")
    ]
    joins += [
        node.get("kernel") is not None and node.get("kernel") == before.get("kernel")
        for before, node in pairwise(block)
    ]
    inserted: list[dict[str, Any]] = []
    # at >= 1: inserted_block refuses 0, the other path follows a node
    previous_kernel: str | None = long_nodes[at - 1].get("kernel")
    for copy in range(1, copies + 1):
        renamed: dict[str, str | None] = {}
        for node, joined in zip(block, joins):
            kernel = node.get("kernel")
            if kernel is not None:
                if joined:
                    renamed[kernel] = previous_kernel
                renamed.setdefault(kernel, f"{kernel}~{copy}")
            previous_kernel = None if kernel is None else renamed[kernel]
            inserted.append(
                {**node, "name": f"{node['name']}~{copy}", "inputs": [], "partition": None, "kernel": previous_kernel}
            )
    tail = list(long_nodes[at:])
    if copies and joins[0]:  # the block's first kernel in long_nodes[at:] now follows the last copy
        boundary = long_nodes[at].get("kernel")
        tail = [{**node, "kernel": previous_kernel} if node.get("kernel") == boundary else node for node in tail]
    return inserted, tail


def _extend_graph(short: Mapping[str, Any], long: Mapping[str, Any], copies: int, what: str) -> dict[str, Any]:
    counts = _extended_counts(short, long, copies)
    most = max(counts.values(), default=0)
    # The partition pass's edge rule (passes/partitions.py, step 6) at full size.
    dissolved = frozenset(t for t, count in counts.items() if 2 * count < most)
    _, short_keys = _priced_nodes(short, dissolved)
    long_nodes, long_keys = _priced_nodes(long, dissolved)
    exact = inserted_block(short_keys, long_keys)
    if exact is not None:  # the graph order of a full trace
        at, length = exact
        block = long_nodes[at : at + length]
        # the node before the block stands for the block's last node, as before each later copy
        chain = long_keys[at - 1] == long_keys[at + length - 1]
    else:
        positions = added_layer(short_keys, long_keys, what)
        block = [long_nodes[i] for i in positions]
        at, chain = positions[-1] + 1, False
    inserted, tail = _copies_with_kernels(block, long_nodes, at, copies, chain)
    nodes = [*long_nodes[:at], *inserted, *tail]
    record: dict[str, Any] = {
        "name": long["name"],
        "nodes": nodes,
        "extended": {"inserted_at": at, "block_nodes": len(block), "copies": copies, "graph_order": exact is not None},
    }
    if long.get("partition_types") is None:
        return record
    leftover_names = {node["name"] for node, key in zip(long_nodes, long_keys) if key[-1]}
    left_nodes = [n for n in nodes if n["name"].split("~")[0] in leftover_names]
    compute = [n for n in left_nodes if n["kind"] == "compute"]
    record.update(
        partitions=[p for p in long["partitions"] if p["type"] not in dissolved],
        partition_types=[
            {**t, "count": counts[t["type"]]} for t in long["partition_types"] if t["type"] not in dissolved
        ],
        leftover={
            "nodes": [n["name"] for n in compute],
            "flops": sum(n["flops"] for n in compute),
            "bytes": sum(n["bytes"] for n in compute),
            "collectives": [n["name"] for n in left_nodes if n["kind"] == "collective"],
        },
    )
    return record


def extend_dump(
    short: Mapping[str, Any], long: Mapping[str, Any], long_layers: int, layers: int, what: str
) -> dict[str, Any]:
    """The summary dump of a ``layers``-layer stage from dumps of a ``long_layers - 1`` and a
    ``long_layers``-layer slice of it (``short``, ``long``: the same stage role, split and
    options). ``what`` names the stage and split in errors."""
    if layers < long_layers:
        raise ValueError(f"a {layers}-layer stage is traced whole, not extended from a {long_layers}-layer slice")
    short_graphs = {g["name"]: g for g in short["graphs"]}
    graphs = []
    for graph in long["graphs"]:
        if graph["name"] not in short_graphs:
            raise SliceNotRepresentativeError(f"{what}: only one slice trace has a {graph['name']} graph")
        graphs.append(
            _extend_graph(short_graphs[graph["name"]], graph, layers - long_layers, f"{what} {graph['name']}")
        )
    return {**long, "graphs": graphs, "extended_from_layers": [long_layers - 1, long_layers], "layers": layers}


def block_dump(block: Mapping[str, Any], layers: int, what: str) -> dict[str, Any]:
    """The summary dump of ``layers`` repeats of one compiled block (per-block compile, where each
    decoder layer is its own graph, run once per layer): :func:`extend_dump` from no layer to the
    ``block`` dump. Every op, collective, leftover node and partition count is ``layers`` times
    the block's; the edge rule does not change (every type's count scales alike)."""
    empty = [
        {"name": g["name"], "nodes": [], **({} if g.get("partition_types") is None else {"partition_types": []})}
        for g in block["graphs"]
    ]
    return extend_dump({**block, "graphs": empty}, block, 1, layers, what)
