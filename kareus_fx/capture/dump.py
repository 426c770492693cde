"""Graph dumps: one JSON file per compiled graph, readable without the model code.

Schema (``schema_version`` 1; documented in docs/formats.md, "Graph dump format")::

    {"schema_version": 1, "kareus_fx_version": str, "gpu": str, "rank": int, "world_size": int,
     "graph_id": str,
     "graphs": [{"name": "forward" | "backward", "nodes": [NODE, ...]}]}

    NODE = {"name", "op", "fx_op", "kind", "shape", "symbolic_shape", "dtype", "flops", "bytes",
            "intensity", "bound", "collective", "inputs", "module", "nanobatch", "partition", "slot",
            "kernel", "arguments"}

A graph compiled with symbolic sizes (dynamic shapes) has ``"symbols": {"s38": {"hint", "min",
"max"}}`` (max null when unbounded); its nodes' ``shape``, ``flops`` and ``bytes`` are evaluated
at the hints (or at a plan bucket's length) and ``symbolic_shape`` keeps the expressions
(``["4", "s38", "64"]``; null for a static shape).

``kind`` is "collective" | "wait" | "compute" | "other"; ``collective`` is null or
``{"kind", "bytes", "group_name", "group_size"}``; ``bound`` is "compute" | "memory" for
computation nodes; ``module`` is the innermost ``nn.Module`` path Dynamo recorded (null when the
node has none); ``nanobatch`` is 0 | 1 | null and ``partition`` / ``slot`` null until those
passes label it (``node.meta["kareus_nanobatch"]``, ``["kareus_partition"]``, ``["kareus_slot"]``).
``kernel`` is the id of the kernel Inductor fuses a computation node into (``passes/kernel_groups.py``;
null for other nodes); ``bytes`` is the node's share of its kernel's traffic, ``intensity`` and
``bound`` the kernel's. ``arguments`` is the call's ``{"args", "kwargs"}`` with node references as
``{"node": NAME}`` (``capture/node_arguments.py``; null when an argument has no JSON form), so the
device profiler can run the op again.

A graph that went through the partition pass also has::

    "partitions": [{"id", "type", "collectives": [node names], "slots": [[node names], ...]}],
    "partition_types": [{"type", "label", "count", "collective": {"kind", "bytes", "group_size",
                         "fused"}, "slots": [{"ops", "flops", "bytes", "bound"}], "launch_slots"}],
    "leftover": {"nodes": [node names], "flops", "bytes", "collectives": [node names]}
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.fx

from kareus_fx import __version__
from kareus_fx.capture.dump_schema import DumpFile, cross_check
from kareus_fx.capture.node_arguments import encode_arguments
from kareus_fx.capture.validated_input import parse_json, read_bounded_text, validated_document
from kareus_fx.errors import KareusError
from kareus_fx.passes.analysis import META_KEY, NodeCost, module_path, shape_symbols, symbolic_shape, tensor_meta
from kareus_fx.passes.kernel_groups import KERNEL_META
from kareus_fx.passes.partitions import GraphPartitioning
from kareus_fx.workload import CollectiveSpec, OpCost, PartitionType, SlotSpec

SCHEMA_VERSION = 1
GRAPH_NAMES = ("forward", "backward")
MAX_DUMP_BYTES = 512 * 2**20
"""A dump of an 80-layer graph is tens of MB; a file beyond this is refused before it is read."""
_FIX = "regenerate the dump with this kareus-fx (options dump_dir, or `kareus dump`)"


def node_record(node: torch.fx.Node) -> dict[str, Any]:
    """The dump entry of one analysed node."""
    cost: NodeCost = node.meta.get(META_KEY, NodeCost(kind="other"))
    shape, dtype = tensor_meta(node)
    return {
        "name": node.name,
        "op": _op_name(node),
        "fx_op": node.op,
        "kind": cost.kind,
        "shape": shape,
        "symbolic_shape": symbolic_shape(node),
        "dtype": dtype,
        "flops": cost.flops,
        "bytes": cost.bytes,
        "intensity": None if cost.intensity in (None, float("inf")) else cost.intensity,
        "bound": cost.bound,
        "collective": asdict(cost.collective) if cost.collective else None,
        "inputs": [inp.name for inp in node.all_input_nodes],
        "module": module_path(node),
        "nanobatch": node.meta.get("kareus_nanobatch"),
        "partition": node.meta.get("kareus_partition"),
        "slot": node.meta.get("kareus_slot"),
        "kernel": node.meta.get(KERNEL_META),
        "arguments": encode_arguments(node),
    }


def graph_record(name: str, gm: torch.fx.GraphModule, partitioning: GraphPartitioning | None = None) -> dict[str, Any]:
    """The dump entry of one graph; ``name`` is "forward" or "backward"."""
    if name not in GRAPH_NAMES:
        raise ValueError(f"graph name must be one of {GRAPH_NAMES}, got {name!r}")
    record: dict[str, Any] = {"name": name, "nodes": [node_record(node) for node in gm.graph.nodes]}
    symbols = shape_symbols(gm)
    if symbols:
        record["symbols"] = symbols
    if partitioning is not None:
        record.update(partitioning_record(partitioning))
    return record


def partitioning_record(partitioning: GraphPartitioning) -> dict[str, Any]:
    """Partitions, partition types and leftovers of one graph, for the dump."""
    leftover_compute = [n for n in partitioning.leftover if n.meta[META_KEY].kind == "compute"]
    return {
        "partitions": [
            {
                "id": p.partition_id,
                "type": p.type_id,
                "collectives": [n.name for n in p.comm.collectives],
                "slots": [[n.name for n in slot] for slot in p.slots],
            }
            for p in partitioning.partitions
        ],
        "partition_types": [
            {
                "type": t.type_id,
                "label": partitioning.type_labels[t.type_id],
                "count": t.count,
                "collective": asdict(t.collective),
                "slots": [
                    {
                        "ops": [op.target for op in slot.ops],
                        "flops": slot.flops,
                        "bytes": slot.bytes,
                        "bound": slot.bound,
                    }
                    for slot in t.slots
                ],
                "launch_slots": list(t.launch_slots),
            }
            for t in partitioning.types.values()
        ],
        "leftover": {
            "nodes": [n.name for n in leftover_compute],
            "flops": sum(n.meta[META_KEY].flops for n in leftover_compute),
            "bytes": sum(n.meta[META_KEY].bytes for n in leftover_compute),
            "collectives": [n.name for n in partitioning.leftover if n.meta[META_KEY].kind == "collective"],
        },
    }


class GraphDumpFile:
    """Accumulates the graphs of one compiled graph and rewrites its JSON file atomically.

    The forward graph is compiled first and the backward lazily at the first backward call, so
    the file is rewritten when each graph arrives; a reader never sees a half-written file.
    """

    def __init__(self, path: Path, *, gpu: str, rank: int, world_size: int, graph_id: str) -> None:
        self.path = path
        self._header = {
            "schema_version": SCHEMA_VERSION,
            "kareus_fx_version": __version__,
            "gpu": gpu,
            "rank": rank,
            "world_size": world_size,
            "graph_id": graph_id,
        }
        self._graphs: list[dict[str, Any]] = []

    def add(self, name: str, gm: torch.fx.GraphModule, partitioning: GraphPartitioning | None = None) -> None:
        self._graphs.append(graph_record(name, gm, partitioning))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**self._header, "graphs": self._graphs}))
        os.replace(tmp, self.path)


class DumpFormatError(KareusError, ValueError):
    """A graph dump file that is not valid: names the file, the field and what was expected."""


def load_dump(path: str | Path) -> dict[str, Any]:
    """Read and validate a dump (:mod:`dump_schema`); any problem raises :class:`DumpFormatError`.

    Refused before parsing: a file larger than :data:`MAX_DUMP_BYTES`, or not UTF-8 text. The
    result holds only the fields the schema names."""
    source = str(path)
    text = read_bounded_text(path, MAX_DUMP_BYTES, DumpFormatError, "kareus graph dump")
    return validate_dump(parse_json(text, source, DumpFormatError, "kareus graph dump", _FIX), source)


def validate_dump(data: Any, source: str = "<dump>") -> dict[str, Any]:
    """The dump ``data`` as validated (every field a reader uses, nothing else), or
    :class:`DumpFormatError` naming the source, the field and the fix."""
    if not isinstance(data, dict) or "graphs" not in data:
        raise DumpFormatError(f"{source} is not a kareus graph dump: no 'graphs' key; {_FIX}")
    if data.get("schema_version") != SCHEMA_VERSION or isinstance(data.get("schema_version"), bool):
        raise DumpFormatError(
            f"{source} has dump schema_version {data.get('schema_version')!r}; this kareus-fx reads "
            f"version {SCHEMA_VERSION}: {_FIX}"
        )
    return validated_document(DumpFile, data, cross_check, source, DumpFormatError, _FIX)


def partition_types_from_dump(dump: dict[str, Any]) -> dict[str, PartitionType]:
    """Rebuild every graph's :class:`PartitionType` from a dump (no model code needed).

    Per-op costs come from the node records of one partition of the type (its slots have the
    type's structure by construction): one whose costs most of the type's partitions share, the
    middle layers' (:func:`_exemplars`).
    """
    types: dict[str, PartitionType] = {}
    for graph in dump["graphs"]:
        nodes = {n["name"]: n for n in graph["nodes"]}
        exemplar = _exemplars(graph.get("partitions") or [], nodes)
        for record in graph.get("partition_types") or []:
            partition = exemplar[record["type"]]
            slots = tuple(
                SlotSpec(
                    ops=tuple(
                        OpCost(
                            name=name,
                            target=nodes[name]["op"],
                            flops=nodes[name]["flops"],
                            bytes=nodes[name]["bytes"],
                            bound=nodes[name]["bound"],
                            kernel=nodes[name].get("kernel"),
                        )
                        for name in slot
                    )
                )
                for slot in partition["slots"]
            )
            types[record["type"]] = PartitionType(
                type_id=record["type"],
                graph=graph["name"],
                slots=slots,
                collective=CollectiveSpec(**record["collective"]),
                count=record["count"],
                launch_slots=tuple(record["launch_slots"]),
            )
    return types


def _exemplars(partitions: list[dict[str, Any]], nodes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per type, a partition whose costs (each slot's ops, FLOPs, bytes and kernel boundaries) most
    of the type's partitions share; of equally common ones, the one seen last first appears.

    The type is the structure, not the costs: an edge layer's partition can split the same bytes
    differently between its kernels (the first layer reads the embedding's output, or the
    activation the stage received), and the first partition of a type is an edge layer's. With
    this choice a stage's types are its middle layers', which every stage shares."""
    signatures: dict[str, dict[tuple, list[dict[str, Any]]]] = {}
    for partition in partitions:
        signature = tuple(
            tuple(
                (
                    nodes[name]["op"],
                    nodes[name]["flops"],
                    nodes[name]["bytes"],
                    i > 0
                    and nodes[name].get("kernel") is not None
                    and nodes[name].get("kernel") == nodes[slot[i - 1]].get("kernel"),
                )
                for i, name in enumerate(slot)
            )
            for slot in partition["slots"]
        )
        signatures.setdefault(partition["type"], {}).setdefault(signature, []).append(partition)
    exemplars = {}
    for ptype, by_signature in signatures.items():
        groups = list(by_signature.values())[::-1]  # latest first appearance first: max() keeps it on ties
        exemplars[ptype] = max(groups, key=len)[0]
    return exemplars


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        return (
            str(node.target)
            if hasattr(node.target, "overloadpacket")
            else getattr(node.target, "__name__", str(node.target))
        )
    return node.op
