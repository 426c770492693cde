"""Code generation of one scheduled aten graph: Inductor's inner compile, holding the graph's order.

The passes (nanobatch issue order, a plan's launch slots and hooks) leave each aten graph in the
order its collectives, waits and hooks must run. Inductor then fuses pointwise and reduction ops
into kernels; its own reordering could undo that order, so for these graphs:

- ``reorder_for_peak_memory``, ``reorder_for_compute_comm_overlap``, ``reorder_for_locality``
  and the aten-level overlap scheduler are off (each is a pass that moves collectives or the
  ops around them);
- :class:`NanobatchFusionChoices` (Inductor's ``InductorChoices`` hook) refuses to fuse work of
  one nanobatch with the other's (by the ``kareus_nanobatch`` labels of the aten nodes a kernel
  computes): a kernel spanning both would wait for both halves' collectives and undo the
  overlap. Inductor fuses them otherwise (they read the same weights);
- :func:`hold_plan_order`, Inductor's post-fusion custom scheduler pass, orders the fused
  kernels by their first op's position in the graph, as a lexicographic topological sort: a
  kernel that fused an op after a collective's wait runs after that wait, and never pulls the
  collective (or its hooks) ahead of where the graph has them. Inductor's own sort after fusion
  is a depth-first one that runs a fused kernel's producers right before it instead.

The hook ops are ordered effects (``kareus_fx.deploy.hook_ops``): Inductor lowers each to a
fallback kernel chained to the previous one, so they keep their order among themselves and are
never eliminated. ``inductor=False`` runs the graph op by op (``boxed_nop``), for debugging.

:func:`reading_kernels` reads the kernels Inductor's scheduler made (with its own estimate of
the bytes each moves, ``get_read_write_buffers_sizes``) for ``bench/kernel_fidelity.py``.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch._guards
import torch.fx
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor import config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.virtualized import V

from kareus_fx.passes.nanobatch import NANOBATCH_META

__all__ = [
    "GraphCodegen",
    "InductorKernel",
    "NanobatchFusionChoices",
    "hold_plan_order",
    "output_code",
    "reading_kernels",
]

# Inductor config for the kareus graphs (module docstring).
ORDER_HOLDING_CONFIG: dict[str, Any] = {
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": False,
    "reorder_for_locality": False,
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
}


def _nanobatches(node: Any) -> set[int]:
    """Nanobatch labels of the aten nodes a (fused) scheduler node computes (shared work: none)."""
    return {
        origin.meta.get(NANOBATCH_META)
        for sub in node.get_nodes()
        if sub.node is not None
        for origin in sub.node.origins
    } - {None}


class NanobatchFusionChoices(InductorChoices):
    """Inductor's fusion choices, except that one nanobatch's work never fuses with the other's."""

    @staticmethod
    def can_fuse(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        first, second = _nanobatches(node1), _nanobatches(node2)
        if first and second and first != second:
            return False
        return InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)


@dataclass(frozen=True)
class InductorKernel:
    """One kernel of Inductor's schedule: the aten ops it computes, whether it is an extern
    (library or fallback) call, and Inductor's estimate of the bytes it reads and writes."""

    origins: tuple[str, ...]
    targets: tuple[str, ...]
    extern: bool
    bytes: float


_READOUTS: list[list[InductorKernel]] = []


@contextlib.contextmanager
def reading_kernels() -> Iterator[list[InductorKernel]]:
    """Collect the kernels of every graph Inductor compiles in the block (its FX graph cache is
    off in the block: a cache hit skips the scheduler)."""
    readout: list[InductorKernel] = []
    _READOUTS.append(readout)
    try:
        with inductor_config.patch(fx_graph_cache=False):
            yield readout
    finally:
        _READOUTS.remove(readout)


def _read_kernels(nodes: list[Any]) -> list[InductorKernel]:
    from torch._inductor.ir import MultiOutput
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    kernels = []
    for node in nodes:
        if isinstance(node, NopKernelSchedulerNode) or isinstance(node.node, MultiOutput):
            continue  # no kernel: an alias, or one output of a multi-output extern kernel
        origins = sorted(
            {o for sub in node.get_nodes() if sub.node is not None for o in sub.node.origins}, key=lambda o: o.name
        )
        kernels.append(
            InductorKernel(
                origins=tuple(o.name for o in origins),
                targets=tuple(str(o.target) for o in origins),
                extern=isinstance(node, ExternKernelSchedulerNode),
                bytes=float(node.get_read_write_buffers_sizes()),
            )
        )
    return kernels


def hold_plan_order(nodes: list[Any]) -> list[Any]:
    """Inductor post-fusion pass: the fused scheduler nodes in graph order (module docstring).

    Key of a (fused) node: ``min_order``, the position of its first op in the scheduler's
    pre-fusion order, which is the lowered graph's order. Among the nodes whose inputs are
    ready, the smallest key runs first.
    """
    producer = {name: node for node in nodes for name in node.get_buffer_names()}
    waiting_on: dict[Any, set[Any]] = {}
    users: dict[Any, list[Any]] = {node: [] for node in nodes}
    for node in nodes:
        deps = {producer[d.name] for d in node.unmet_dependencies if d.name in producer} - {node}
        waiting_on[node] = deps
        for dep in deps:
            users[dep].append(node)
    index = {node: i for i, node in enumerate(nodes)}
    ready = [(node.min_order, index[node]) for node in nodes if not waiting_on[node]]
    heapq.heapify(ready)
    ordered: list[Any] = []
    while ready:
        _, i = heapq.heappop(ready)
        node = nodes[i]
        ordered.append(node)
        for user in users[node]:
            waiting_on[user].discard(node)
            if not waiting_on[user]:
                heapq.heappush(ready, (user.min_order, index[user]))
    if len(ordered) != len(nodes):  # a cycle cannot come from a scheduler; keep Inductor's order
        ordered = nodes
    for readout in _READOUTS:
        readout.extend(_read_kernels(ordered))
    return ordered


@dataclass
class GraphCodegen:
    """Compile an aten forward, backward or inference graph with Inductor's inner compile, or op
    by op. Calls return a boxed callable."""

    inductor: bool = True
    is_backward: bool = False
    is_inference: bool = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if not self.inductor:
            return boxed_nop(gm, example_inputs)
        # A plan compiles several variants of one aten graph; Inductor records the output strides
        # of a graph in the tracing context once. The variants compute the same outputs from the
        # same graph (only the order differs), so each records the same strides afresh.
        context = torch._guards.TracingContext.try_get()
        if context is not None and context.output_strides:
            context.output_strides.clear()
        with (
            V.set_choices_handler(NanobatchFusionChoices()),
            inductor_config.patch({**ORDER_HOLDING_CONFIG, "_post_fusion_custom_pass": hold_plan_order}),
        ):
            return compile_fx_inner(gm, example_inputs, is_backward=self.is_backward, is_inference=self.is_inference)


def output_code(compiled: Any) -> str | None:
    """Inductor's generated source of a compiled graph (None when it ran op by op)."""
    return getattr(compiled, "source_code", None)
