"""Transformer Engine's asynchronous input-gradient all-reduce beside the weight-gradient GEMM.

The paper's testbed ran Megatron-LM, nanobatching and Kareus on NeMo with Megatron-core and
Transformer Engine (``mcore_gpt: true``, ``transformer_engine: true``, ``sequence_parallel:
false`` in ml-energy/kareus ``tests/artifact/conf/megatron_*_config.yaml``). In the backward of a
column-parallel linear without sequence parallelism, Transformer Engine's ``_Linear`` and
``_LayerNormLinear`` compute the input gradient (dgrad GEMM), launch its all-reduce over the
tensor-parallel group with ``async_op=True``, compute the weight gradient (wgrad GEMM) while it
runs, and wait for it only after (``transformer_engine/pytorch/module/linear.py``,
``layernorm_linear.py``: ``dgrad, dgrad_work = allreduce(dgrad, tp_group, async_op=True)``
before the wgrad GEMM; Megatron-core's own ``LinearWithGradAccumulationAndAsyncCommunication``
does the same under ``allreduce_dgrad``). So the un-split microbatch does not run that
collective alone: it overlaps the wgrad GEMM of the same linear, on NCCL's own stream.

This module finds those pairs in a traced backward graph and prices the sequence with them
overlapped (``Simulator.predict_sequence_async``). A backward all-reduce is a column-parallel
input gradient when its module (the linear Dynamo recorded, e.g. ``layers.3.mlp.gate_up_proj``)
has a weight-gradient matmul in the same graph whose output is the local weight, ``[out/tp, in]``
with ``in`` the all-reduced tensor's last dimension (the linear's input width). A row-parallel
linear's forward all-reduce (in the recomputed forward) fails that test: its weight is
``[hidden, in/tp]``. Each such all-reduce is paired with the nearest unpaired weight-gradient
matmul of its module (and nanobatch, in a nanobatched graph) in graph order (slices extended by ``layer_slice`` keep a full trace's
order for un-split graphs; a copy's nodes keep the module path of the layer they copy).

Assumptions: the traced linears hold their weights as ``[out, in]`` (``torch.nn.Linear``, the
reference models); the collective runs with the sequence's library and SM count (NCCL's default
channels), and the GEMM beside it slows with the collective's HBM draw as any kernel beside a
collective does in the simulator. Forward all-reduces (row-parallel outputs) stay exposed: the
next op needs them. Where a method's partitions schedule a collective themselves (nanobatching,
Kareus), their schedule replaces this one; the work outside partitions keeps it. The planner
prices it only where the request's engine runs it (``MegatronSettings.te_async_dgrad``: the
testbed presets); a user's workload keeps the traced order, which is how kareus deploys it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kareus_fx.plan.graph_workload import SequentialGraph, _collective, _op_cost
from kareus_fx.workload import Measurement, OpCost, PartitionType, SlotSpec

__all__ = ["AsyncDgrad", "async_dgrad_pairs", "async_dgrad_split", "predict_unsplit", "with_async_dgrad"]

_MATMULS = frozenset({"aten.mm.default", "aten.addmm.default"})


@dataclass(frozen=True)
class AsyncDgrad:
    """A sequence with its asynchronous input-gradient all-reduces taken out: the ``rest`` runs
    as before, each of ``beside`` runs its collective from the start of its wgrad GEMM(s)."""

    rest: SequentialGraph
    beside: tuple[PartitionType, ...]

    def reprice(
        self, measured: Mapping[int, Measurement], graph: SequentialGraph, simulator: Any
    ) -> dict[int, Measurement]:
        """``measured`` with these all-reduces beside their wgrad GEMMs (:func:`with_async_dgrad`)."""
        return with_async_dgrad(measured, graph, self, simulator)


def _is_weight_grad(node: Mapping[str, Any], width: int) -> bool:
    """A matmul whose output is a ``[out, in]`` weight with ``in == width`` (not a token-major activation)."""
    shape = node.get("shape")
    return node["op"] in _MATMULS and shape is not None and len(shape) == 2 and int(shape[-1]) == width


def async_dgrad_pairs(graph: Mapping[str, Any], names: Iterable[str] | None = None) -> list[tuple[str, str]]:
    """``(all-reduce, wgrad matmul)`` node names of a dumped backward graph (only among ``names``
    when given): each column-parallel input-gradient all-reduce and the weight-gradient GEMM of
    its linear (module docstring). Empty for a forward graph."""
    if graph["name"] != "backward":
        return []
    wanted = None if names is None else set(names)
    nodes = [n for n in graph["nodes"] if wanted is None or n["name"] in wanted]
    pairs: list[tuple[str, str]] = []
    used: set[int] = set()
    for i, node in enumerate(nodes):
        coll = node.get("collective")
        if node["kind"] != "collective" or coll is None or coll.get("kind") != "all_reduce" or not node.get("module"):
            continue
        shape = node.get("shape")
        if not shape:
            continue
        width = int(shape[-1])
        tokens = math.prod(int(s) for s in shape[:-1])
        candidates = [
            j
            for j, other in enumerate(nodes)
            if j not in used
            and other["kind"] == "compute"
            and other.get("module") == node["module"]
            and other.get("nanobatch") == node.get("nanobatch")
            and _is_weight_grad(other, width)
            and int(other["shape"][0]) != tokens
        ]
        if not candidates:
            continue
        j = min(candidates, key=lambda k: (abs(k - i), k))
        used.add(j)
        pairs.append((node["name"], nodes[j]["name"]))
    return pairs


def async_dgrad_split(graph: Mapping[str, Any], names: Iterable[str] | None = None) -> AsyncDgrad | None:
    """The dumped graph's sequence (only ``names`` when given, as ``graph_workload._sequential``
    reads it) with its asynchronous dgrad all-reduces beside their wgrad GEMMs; None if it has none.
    Identical pairs (same collective, same GEMM costs) share one :class:`PartitionType` with a count."""
    pairs = async_dgrad_pairs(graph, names)
    if not pairs:
        return None
    by_name = {n["name"]: n for n in graph["nodes"]}
    paired = {name for pair in pairs for name in pair}
    wanted = None if names is None else set(names)
    ops: list[OpCost] = []
    collectives = []
    for node in graph["nodes"]:
        if node["name"] in paired or (wanted is not None and node["name"] not in wanted):
            continue
        if node["kind"] == "compute":
            ops.append(_op_cost(node))
        elif node["kind"] == "collective":
            collectives.append(_collective(node))
    counts: dict[tuple, int] = {}
    specs: dict[tuple, tuple[Any, OpCost]] = {}
    for coll_name, gemm_name in pairs:
        coll = _collective(by_name[coll_name])
        gemm = _op_cost(by_name[gemm_name])
        key = (coll, gemm.target, gemm.flops, gemm.bytes)
        counts[key] = counts.get(key, 0) + 1
        specs.setdefault(key, (coll, gemm))
    beside = tuple(
        PartitionType(
            type_id=f"async-dgrad-{i}",
            graph="backward",
            slots=(SlotSpec((specs[key][1],)),),
            collective=specs[key][0],
            count=counts[key],
            launch_slots=(0,),
        )
        for i, key in enumerate(counts)
    )
    rest = SequentialGraph(graph="backward", ops=tuple(ops), collectives=tuple(collectives), fingerprint="")
    return AsyncDgrad(rest=rest, beside=beside)


def predict_unsplit(simulator: Any, graph: SequentialGraph, split: AsyncDgrad | None, clock_mhz: float) -> Any:
    """The simulator's prediction of ``graph`` run op after op, with ``split``'s asynchronous
    dgrad all-reduces beside their wgrad GEMMs (None: each collective alone)."""
    if split is None:
        return simulator.predict_sequence(graph.ops, graph.collectives, clock_mhz=clock_mhz)
    return simulator.predict_sequence_async(split.rest.ops, split.rest.collectives, split.beside, clock_mhz=clock_mhz)


def with_async_dgrad(
    measured: Mapping[int, Measurement],
    graph: SequentialGraph,
    split: AsyncDgrad | None,
    simulator: Any,
) -> dict[int, Measurement]:
    """Per clock, ``measured`` (the profiler's cost of ``graph`` run op after op) with the
    simulator's saving from the asynchronous dgrad all-reduces: measured - plain + overlapped, so
    an exact simulated profiler gives the overlapped prediction itself and a noisy one keeps its
    noise. ``split`` None: ``measured`` unchanged."""
    if split is None:
        return dict(measured)
    out: dict[int, Measurement] = {}
    for clock, m in measured.items():
        plain = predict_unsplit(simulator, graph, None, clock).measurement
        overlapped = predict_unsplit(simulator, graph, split, clock).measurement
        out[clock] = Measurement(
            m.time_s - plain.time_s + overlapped.time_s,
            m.energy_j - plain.energy_j + overlapped.energy_j,
            m.dynamic_energy_j - plain.dynamic_energy_j + overlapped.dynamic_energy_j,
            m.static_energy_j - plain.static_energy_j + overlapped.static_energy_j,
        )
    return out
