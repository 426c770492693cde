"""The schema of a graph dump (version 1; the layout is in :mod:`dump`'s docstring): every field
any reader of a dump touches (``kareus inspect``, ``--diff``, the planner's graph workloads).

Pydantic models give each field's type and range (:class:`DumpFile`); :func:`cross_check` what
relates fields (node names unique, every name a partition or leftover lists is a node, each
partition type has a partition of its type, launch slots within the slots). :func:`dump.load_dump`
runs both and hands readers only the validated data. A reader that needs a new field (an
optional per-node field, say) adds it to :class:`Node` first.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import StrictInt, StrictStr, model_validator

from kareus_fx.capture.validated_input import Count, Fail, Number, SchemaModel, int_range
from kareus_fx.workload import CollectiveKind, GraphName

__all__ = ["DumpFile", "cross_check"]

Bound = Literal["compute", "memory"]
SmallCount = Annotated[StrictInt, int_range(1, 1_000_000)]
"""1 to a million: a count of ranks, of fused collectives or of partitions of one type."""
Rank = Annotated[StrictInt, int_range(0, 1_000_000)]


class NodeCollective(SchemaModel):
    kind: CollectiveKind
    bytes: Number
    group_name: StrictStr
    group_size: SmallCount | None


# pydantic.mypy synthesizes ``__init__(..., **kwargs)``, which clashes with a field named kwargs
# (pydantic issue 3125, reported on the class line); the file's key is "kwargs", so the field keeps it
class NodeArguments(SchemaModel):  # type: ignore[no-redef]
    args: list[Any]
    kwargs: dict[StrictStr, Any]


class Node(SchemaModel):
    name: StrictStr
    op: StrictStr
    fx_op: StrictStr
    kind: Literal["collective", "wait", "compute", "other"]
    shape: list[Count] | None
    symbolic_shape: list[StrictStr] | None = None
    """The shape's sizes as expressions of the graph's ``symbols`` (None: a static shape)."""
    dtype: StrictStr | None
    flops: Number
    bytes: Number
    intensity: Number | None
    bound: Bound | None
    collective: NodeCollective | None
    inputs: list[StrictStr]
    module: StrictStr | None
    nanobatch: Literal[0, 1] | None
    partition: Count | StrictStr | None
    slot: Count | Literal["comm"] | None = None
    kernel: StrictStr | None = None
    """The Inductor kernel the node is fused into (``passes/kernel_groups.py``); absent in old dumps."""
    arguments: NodeArguments | None = None
    """The call's arguments (``capture/node_arguments.py``); absent in old dumps."""

    @model_validator(mode="after")
    def _collective_iff_kind(self) -> Node:
        if (self.kind == "collective") != (self.collective is not None):
            raise ValueError(
                f"a {self.kind!r} node has {'no' if self.collective is None else 'a'} collective "
                f"record (exactly the 'collective' nodes have one)"
            )
        return self


class Partition(SchemaModel):
    id: Count | StrictStr
    type: StrictStr
    collectives: list[StrictStr]
    slots: list[list[StrictStr]]


class TypeCollective(SchemaModel):
    kind: CollectiveKind
    bytes: Number
    group_size: SmallCount
    fused: SmallCount = 1


class TypeSlot(SchemaModel):
    ops: list[StrictStr]
    flops: Number
    bytes: Number
    bound: Bound | None


class PartitionTypeRecord(SchemaModel):
    type: StrictStr
    label: StrictStr
    count: SmallCount
    collective: TypeCollective
    slots: list[TypeSlot]
    launch_slots: list[Count]


class Leftover(SchemaModel):
    nodes: list[StrictStr]
    flops: Number
    bytes: Number
    collectives: list[StrictStr]


class SymbolRange(SchemaModel):
    """A shape symbol of a dynamic-shape graph: the size it was dumped at and its range."""

    hint: Count | None
    min: Count
    max: Count | None
    """None: unbounded."""


class Graph(SchemaModel):
    name: GraphName
    nodes: list[Node]
    symbols: dict[StrictStr, SymbolRange] | None = None
    partitions: list[Partition] | None = None
    partition_types: list[PartitionTypeRecord] | None = None
    leftover: Leftover | None = None

    @model_validator(mode="after")
    def _partitioned_together(self) -> Graph:
        present = [self.partitions is not None, self.partition_types is not None, self.leftover is not None]
        if any(present) and not all(present):
            raise ValueError(
                "a partitioned graph has partitions, partition_types and leftover, an un-partitioned one none of them"
            )
        return self


class DumpFile(SchemaModel):
    """A schema-1 dump. ``schema_version`` is checked before this model runs."""

    schema_version: Literal[1]
    kareus_fx_version: StrictStr | None = None
    gpu: StrictStr
    rank: Rank
    world_size: SmallCount
    graph_id: StrictStr | None = None
    graphs: list[Graph]


def cross_check(dump: DumpFile, fail: Fail) -> None:
    """Call ``fail(field, what is wrong)`` (which raises) unless the dump's parts agree."""
    if dump.rank >= dump.world_size:
        fail("rank", f"rank {dump.rank} outside world_size {dump.world_size}")
    seen_graphs: set[str] = set()
    for g, graph in enumerate(dump.graphs):
        where = f"graphs[{g}]"
        if graph.name in seen_graphs:
            fail(f"{where}.name", f"a second {graph.name!r} graph")
        seen_graphs.add(graph.name)
        names: set[str] = set()
        for n, node in enumerate(graph.nodes):
            if node.name in names:
                fail(f"{where}.nodes[{n}].name", f"node name {node.name!r} repeated")
            names.add(node.name)
        partitions, partition_types, leftover = graph.partitions, graph.partition_types, graph.leftover
        if partitions is None or partition_types is None or leftover is None:
            continue  # un-partitioned (Graph's validator: the three are present together or not at all)
        type_ids = [t.type for t in partition_types]
        if len(set(type_ids)) != len(type_ids):
            fail(f"{where}.partition_types", "a partition type id repeated")
        exemplar: dict[str, int] = {}
        for p, partition in enumerate(partitions):
            if partition.type not in type_ids:
                fail(f"{where}.partitions[{p}].type", f"unknown partition type {partition.type!r}")
            exemplar.setdefault(partition.type, p)
            for name in [*partition.collectives, *(n for slot in partition.slots for n in slot)]:
                if name not in names:
                    fail(f"{where}.partitions[{p}]", f"node {name!r} is not in the graph's nodes")
        for t, record in enumerate(partition_types):
            if record.type not in exemplar:
                fail(f"{where}.partition_types[{t}]", f"no partition of type {record.type!r}")
            slots = len(partitions[exemplar[record.type]].slots)
            if slots != len(record.slots) or not slots:
                fail(
                    f"{where}.partition_types[{t}].slots",
                    f"{len(record.slots)} slots, but its partitions have {slots} (and a type has at least one)",
                )
            for i, slot in enumerate(record.launch_slots):
                if slot >= slots:
                    fail(
                        f"{where}.partition_types[{t}].launch_slots[{i}]",
                        f"slot {slot} outside the type's {slots} slots",
                    )
        for name in [*leftover.nodes, *leftover.collectives]:
            if name not in names:
                fail(f"{where}.leftover", f"node {name!r} is not in the graph's nodes")
