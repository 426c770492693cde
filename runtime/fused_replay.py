"""A partition slot's recorded ops rebuilt as one FX graph and compiled by Inductor: the device
profiler's fused replay (``PartitionReplay.build(..., fused=True)``).

The per-op replay (:mod:`kareus_fx.runtime.kernel_rebuild`) runs one aten kernel per recorded
op, each on its own random inputs, so every pointwise op reads and writes its tensors in HBM. A
deployment runs Inductor's kernels, which fuse those ops; on one H200 the per-op replay of
memory-bound backward partitions took 2.5-3.9x the simulated time, growing with the op count
(``bench/results/gpu_h200/README.md``, run 9). This module keeps the slot's dataflow instead:

- every op of the slot becomes a node calling its recorded aten overload with its recorded
  arguments (the dump's ``arguments``, :mod:`kareus_fx.capture.node_arguments`);
- an input made by a free op of the dump (kind ``other``: a view, a permute, ``getitem``) is
  rebuilt through that op when the op's own inputs can be, so Inductor sees the view as the
  deployment does;
- any other input (a placeholder, a collective's result, an op of another slot) becomes a
  graph input: a random, contiguous tensor of its recorded shape and dtype;
- the graph returns every value some node outside it reads (the dump's ``inputs`` lists), so
  Inductor writes what the real graph keeps and does not drop the slot's work as dead.

A slot is fused only when every op has recorded arguments; otherwise :func:`fused_slot_kernel`
raises :class:`FusedReplayError` and the caller replays that slot op by op. Assumptions: the
slot's ops appear in the dump's node order (the dump is written in graph order); Inductor fuses
within the slot only, as the stream-schedule pass' collective launch points cut the graph at slot
boundaries.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from kareus_fx.capture.node_arguments import decode_arguments
from kareus_fx.runtime.recorded_ops import NodeTable, random_tensor, resolve_overload
from kareus_fx.workload import OpCost

__all__ = ["FusedReplayError", "fused_slot_kernel", "slot_graph"]


class FusedReplayError(ValueError):
    """A slot whose recorded ops cannot be rebuilt as one graph (an op without recorded arguments)."""


def _target(record: Mapping[str, Any]) -> Callable[..., Any]:
    return operator.getitem if record["op"] == "getitem" else resolve_overload(str(record["op"]))


def _consumers(table: NodeTable) -> dict[str, set[str]]:
    readers: dict[str, set[str]] = {name: set() for name in table}
    for name, record in table.items():
        for source in record.get("inputs") or ():
            readers.setdefault(source, set()).add(name)
    return readers


class _SlotGraphBuilder:
    """Builds one slot's graph; ``inputs`` holds the (name, shape, dtype) of each graph input."""

    def __init__(self, table: NodeTable, slot_names: set[str]) -> None:
        self.table = table
        self.slot_names = slot_names
        self.graph = fx.Graph()
        self.values: dict[str, fx.Node] = {}
        self.inputs: list[tuple[str, list[int], str]] = []
        self.placeholders: list[fx.Node] = []

    def value(self, name: str) -> fx.Node:
        """The node standing for dump node ``name`` in this graph (built on first use)."""
        if name in self.values:
            return self.values[name]
        record = self.table.get(name)
        if record is None:
            raise FusedReplayError(f"input {name} is not in the dump")
        if self._rebuildable_free_op(record):
            node = self._call(name, record)
        else:
            if record.get("shape") is None or record.get("dtype") is None:
                raise FusedReplayError(f"input {name} has no recorded tensor shape")
            node = self.graph.placeholder(f"in_{len(self.placeholders)}")
            self.placeholders.append(node)
            self.inputs.append((name, list(record["shape"]), str(record["dtype"])))
        self.values[name] = node
        return node

    def _rebuildable_free_op(self, record: Mapping[str, Any]) -> bool:
        return (
            record.get("fx_op") == "call_function"
            and record.get("kind") == "other"
            and record.get("arguments") is not None
            and any(self._depends_on_slot(i) for i in record.get("inputs") or ())
        )

    def _depends_on_slot(self, name: str, depth: int = 0) -> bool:
        """Whether ``name`` is a slot op or a free op over one (views chain a few deep)."""
        if name in self.slot_names:
            return True
        record = self.table.get(name, {})
        if depth > 8 or record.get("kind") != "other" or record.get("fx_op") != "call_function":
            return False
        return any(self._depends_on_slot(i, depth + 1) for i in record.get("inputs") or ())

    def _call(self, name: str, record: Mapping[str, Any]) -> fx.Node:
        if record.get("arguments") is None:
            raise FusedReplayError(f"op {name} ({record.get('op')}) has no recorded arguments")
        args, kwargs = decode_arguments(record["arguments"], self.value, torch.device("meta"))
        node = self.graph.call_function(_target(record), tuple(args), kwargs)
        node.name = name
        return node

    def add_op(self, name: str) -> None:
        record = self.table.get(name)
        if record is None:
            raise FusedReplayError(f"op {name} is not in the dump")
        self.values[name] = self._call(name, record)


def slot_graph(ops: Sequence[OpCost], table: NodeTable) -> tuple[fx.GraphModule, list[tuple[str, list[int], str]]]:
    """The graph of one slot's ``ops`` from the dump's node ``table`` and its inputs' (dump name,
    shape, dtype), in the graph's argument order. FusedReplayError where it cannot be built."""
    if not ops:
        raise FusedReplayError("an empty slot has nothing to fuse")
    names = [op.name for op in ops]
    order = {name: index for index, name in enumerate(table)}
    if any(name not in order for name in names):
        raise FusedReplayError("a slot op is not in the dump")
    builder = _SlotGraphBuilder(table, set(names))
    for name in sorted(names, key=order.__getitem__):
        builder.add_op(name)
    readers = _consumers(table)
    built = set(builder.values)
    outputs = [
        builder.values[name]
        for name in builder.values
        if builder.values[name].op != "placeholder" and (readers.get(name, set()) - built or name == names[-1])
    ]
    builder.graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), builder.graph), builder.inputs


def fused_slot_kernel(
    ops: Sequence[OpCost], table: NodeTable, device: torch.device
) -> tuple[Callable[[], Any], fx.GraphModule, list[torch.Tensor]]:
    """One slot as one call of its Inductor-compiled graph on random inputs: (run, the graph,
    the inputs). The first ``run()`` compiles (call it before timing or capturing)."""
    gm, inputs = slot_graph(ops, table)
    tensors = [random_tensor(shape, getattr(torch, dtype), device) for _, shape, dtype in inputs]
    compiled = torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False)

    def run() -> Any:
        with torch.no_grad():
            return compiled(*tensors)

    return run, gm, tensors
