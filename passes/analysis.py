"""Label every node of an aten graph: collective, wait, computation (with FLOPs, bytes, bound) or other.

Reads only fake-tensor metadata (``node.meta["val"]``), so it works on graphs traced on the meta
device at full size. Results go to ``node.meta["kareus_cost"]`` (a :class:`NodeCost`) and are
also returned.

Assumptions:
- FLOPs: torch's flop-counter registry where it has the op (matmuls, convolutions, attention);
  the CPU flash-attention kernels that a CPU trace produces count like the GPU ones (same
  formula); ``kareus::attention`` counts only the causal pairs it computes. Any other computation counts one FLOP per element of its largest tensor
  (elementwise ops, norms, reductions, copies), which is what makes them memory-bound.
- Bytes: every distinct tensor input read once plus every output written once (HBM traffic of
  an unfused kernel). Embedding lookups read only the gathered rows.
- Views, aliases, ``getitem`` and symbolic-size nodes move nothing: kind "other", zero cost.
- Compute- vs memory-bound: arithmetic intensity against the GPU's ridge point at its maximum
  clock (peak BF16 FLOP/s over HBM bandwidth). The label is a property of (op, GPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import sympy
import torch
import torch.fx
from torch._inductor import config as inductor_config
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils._sympy.numbers import int_oo
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from kareus_fx.capture.node_arguments import int_arg, node_arg, tensor_value
from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.models.attention_op import attention_backward_flops, attention_flops
from kareus_fx.workload import CollectiveKind

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

NodeKind = Literal["collective", "wait", "compute", "other"]
Bound = Literal["compute", "memory"]

META_KEY = "kareus_cost"
# The root local Dynamo names the compiled module by: L['self'], L['fn'], L['mod'], ...
_DYNAMO_ROOT = re.compile(r"^L\['[^']+'\]\.?")

# Functional collectives -> (kind, how one rank's full buffer is found: "input" or "output").
_COLLECTIVES: dict[Any, tuple[CollectiveKind, str]] = {
    c10d.all_reduce.default: ("all_reduce", "input"),
    c10d.all_reduce_coalesced.default: ("all_reduce", "input"),
    c10d.all_gather_into_tensor.default: ("all_gather", "output"),
    c10d.all_gather_into_tensor_coalesced.default: ("all_gather", "output"),
    c10d.reduce_scatter_tensor.default: ("reduce_scatter", "input"),
    c10d.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", "input"),
    c10d.all_to_all_single.default: ("all_to_all", "input"),
}
_WAITS = {c10d.wait_tensor.default}

# Ops that move no data although they are not aten views.
_FREE_OPS = {
    operator.getitem,
    aten.detach.default,
    aten.alias.default,
    aten.lift_fresh.default,
    aten._unsafe_view.default,  # a view whose result is not tracked as an alias
    aten.sym_size.int,
    aten.sym_numel.default,
    aten.sym_stride.int,
}

# CPU attention kernels: same work as the GPU flash kernels a GPU trace would show.
_CPU_SDPA_FORWARD = {aten._scaled_dot_product_flash_attention_for_cpu.default}
_CPU_SDPA_BACKWARD = {aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
_EMBEDDING = {aten.embedding.default}
# kareus_fx.models.attention_op: the fused causal attention the reference models use.
_KAREUS_ATTENTION = torch.ops.kareus.attention.default
_KAREUS_ATTENTION_BACKWARD = torch.ops.kareus.attention_backward.default


@dataclass(frozen=True)
class CollectiveInfo:
    """A functional collective: kind, one rank's full buffer in bytes, and its group."""

    kind: CollectiveKind
    bytes: float
    group_name: str
    group_size: int | None


@dataclass(frozen=True)
class NodeCost:
    """What one node does. ``bound`` and ``intensity`` are set for computation nodes only."""

    kind: NodeKind
    flops: float = 0.0
    bytes: float = 0.0
    intensity: float | None = None
    bound: Bound | None = None
    collective: CollectiveInfo | None = None


def analyse_graph(gm: torch.fx.GraphModule, gpu: GPUSpec) -> dict[torch.fx.Node, NodeCost]:
    """Label every node of ``gm`` against ``gpu``; store each label in ``node.meta[META_KEY]``."""
    ridge = gpu.ridge_point_flops_per_byte()
    costs: dict[torch.fx.Node, NodeCost] = {}
    for node in gm.graph.nodes:
        cost = _node_cost(node, ridge)
        node.meta[META_KEY] = cost
        costs[node] = cost
    return costs


def tensor_meta(node: torch.fx.Node) -> tuple[list[int] | None, str | None]:
    """Shape and dtype of a node's (first) tensor output, from fake-tensor metadata."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    if not isinstance(val, torch.Tensor):
        return None, None
    return [_concrete(s) for s in val.shape], str(val.dtype).removeprefix("torch.")


def symbolic_shape(node: torch.fx.Node) -> list[str] | None:
    """The (first) tensor output's shape with symbolic sizes as their expressions
    (``["4", "s38", "64"]``); None when every size is concrete or the node has no tensor."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    if not isinstance(val, torch.Tensor):
        return None
    sizes = [str(s.node.expr) if isinstance(s, torch.SymInt) else str(int(s)) for s in val.shape]
    return sizes if any(not size.isdigit() for size in sizes) else None


def shape_symbols(gm: torch.fx.GraphModule) -> dict[str, dict[str, int | None]]:
    """The shape symbols a graph's tensors use: name -> {"hint", "min", "max"} (max None when
    unbounded), from the graph's ShapeEnv. Empty for a graph with static shapes."""
    symbols: dict[str, dict[str, int | None]] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        for tensor in val if isinstance(val, (tuple, list)) else (val,):
            if not isinstance(tensor, torch.Tensor):
                continue
            for size in tensor.shape:
                if not isinstance(size, torch.SymInt) or size.node.maybe_as_int() is not None:
                    continue
                shape_env = size.node.shape_env
                for symbol in size.node.expr.free_symbols:
                    if str(symbol) in symbols:
                        continue
                    bounds = shape_env.var_to_range.get(symbol)
                    hint = shape_env.backed_var_to_val.get(symbol)
                    upper = None if bounds is None or bounds.upper in (int_oo, sympy.oo) else int(bounds.upper)
                    symbols[str(symbol)] = {
                        "hint": None if hint is None else int(hint),
                        "min": 0 if bounds is None else int(bounds.lower),
                        "max": upper,
                    }
    return symbols


def module_path(node: torch.fx.Node) -> str | None:
    """Innermost ``nn.Module`` path Dynamo recorded for a node (``layers.3.mlp.down_proj``).

    Forward nodes carry ``nn_module_stack``; backward nodes that kept it carry
    ``fwd_nn_module_stack``. None when neither is there or the node belongs to the root module.
    """
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path = _DYNAMO_ROOT.sub("", str(list(stack.values())[-1][0]))
    return path.replace("[", ".").replace("]", "").replace("'", "").lstrip(".") or None


def _node_cost(node: torch.fx.Node, ridge_flops_per_byte: float) -> NodeCost:
    if node.op != "call_function":
        return NodeCost(kind="other")
    target = node.target
    if target in _COLLECTIVES:
        return NodeCost(kind="collective", collective=_collective_info(node))
    if target in _WAITS:
        return NodeCost(kind="wait")
    if target in _FREE_OPS or _is_view(target) or not _tensors(node.meta.get("val")):
        return NodeCost(kind="other")
    flops = _flops(node)
    moved = _bytes(node)
    intensity = flops / moved if moved > 0 else float("inf")
    bound: Bound = "compute" if intensity >= ridge_flops_per_byte else "memory"
    return NodeCost(kind="compute", flops=flops, bytes=moved, intensity=intensity, bound=bound)


def _collective_info(node: torch.fx.Node) -> CollectiveInfo:
    kind, buffer_side = _COLLECTIVES[node.target]
    side = _tensors(node.meta.get("val")) if buffer_side == "output" else _input_tensors(node)
    group_name = str(node.args[-1])
    return CollectiveInfo(
        kind=kind,
        bytes=float(sum(_nbytes(t) for t in side)),
        group_name=group_name,
        group_size=_group_size(node, group_name),
    )


def _group_size(node: torch.fx.Node, group_name: str) -> int | None:
    if node.target in (
        c10d.all_gather_into_tensor.default,
        c10d.reduce_scatter_tensor.default,
        c10d.all_gather_into_tensor_coalesced.default,
        c10d.reduce_scatter_tensor_coalesced.default,
    ):
        return int_arg(node, -2)
    try:
        from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

        return _resolve_process_group(GroupName(group_name)).size()
    except Exception:  # noqa: BLE001 - the group is not live in this process (e.g. an offline graph)
        return None


def _flops(node: torch.fx.Node) -> float:
    target = node.target
    out = node.meta.get("val")
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    packet = getattr(target, "overloadpacket", None)
    if packet in flop_registry:
        return float(_concrete(flop_registry[packet](*args, **kwargs, out_val=out)))
    if target is _KAREUS_ATTENTION:
        q, k, v = _hinted_arg_shapes(node, range(3))
        return attention_flops(q, k, v)
    if target is _KAREUS_ATTENTION_BACKWARD:
        q, k, v = _hinted_arg_shapes(node, range(1, 4))
        return attention_backward_flops(q, k, v)
    if target in _CPU_SDPA_FORWARD:
        q, k, v = (_arg_tensor(node, pos).shape for pos in range(3))
        return float(_concrete(sdpa_flop_count(q, k, v)))
    if target in _CPU_SDPA_BACKWARD:
        grad_out, q, k, v = (_arg_tensor(node, pos).shape for pos in range(4))
        return float(_concrete(sdpa_backward_flop_count(grad_out, q, k, v)))
    tensors = _tensors(out) + _input_tensors(node)
    return float(max((_concrete(t.numel()) for t in tensors), default=0))


def _bytes(node: torch.fx.Node) -> float:
    outputs = _tensors(node.meta.get("val"))
    written = sum(_nbytes(t) for t in outputs)
    if node.target in _EMBEDDING:
        return float(2 * written + _nbytes(node_arg(node, 1).meta.get("val")))
    return float(written + sum(_nbytes(t) for t in _input_tensors(node)))


def _arg_tensor(node: torch.fx.Node, pos: int) -> torch.Tensor:
    """The fake tensor that argument ``pos`` of ``node`` holds."""
    return tensor_value(node_arg(node, pos))


def _hinted_arg_shapes(node: torch.fx.Node, positions: Iterable[int]) -> list[torch.Size]:
    """The shapes of the tensors at ``positions`` in ``node``'s arguments, each size concrete
    (:func:`hinted`)."""
    return [torch.Size(hinted(_arg_tensor(node, pos).shape)) for pos in positions]


def _input_tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    """Distinct tensor inputs of a node (a tensor used twice is read once)."""
    seen: dict[torch.fx.Node, None] = {}
    for inp in node.all_input_nodes:
        seen.setdefault(inp)
    return [t for inp in seen for t in _tensors(inp.meta.get("val"))]


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _nbytes(t: Any) -> float:
    if not isinstance(t, torch.Tensor):
        return 0.0
    return float(_concrete(t.numel()) * t.element_size())


def _is_view(target: Any) -> bool:
    return bool(getattr(target, "is_view", False))


def hinted(shape: Any) -> tuple[int, ...]:
    """A shape with each symbolic size evaluated (:func:`_concrete`: at :func:`sizes_at`'s sizes,
    else at its hint, the size of the call being compiled)."""
    return tuple(_concrete(s) for s in shape)


_SIZES: contextvars.ContextVar[Mapping[Any, int] | None] = contextvars.ContextVar("kareus_sizes", default=None)


@contextlib.contextmanager
def sizes_at(sizes: Mapping[Any, int] | None) -> Iterator[None]:
    """Evaluate symbolic sizes at ``sizes`` (shape symbol -> value: a plan bucket's sequence
    length) instead of their hints, for the analysis and records made inside the block."""
    token = _SIZES.set(dict(sizes) if sizes else None)
    try:
        yield
    finally:
        _SIZES.reset(token)


def _concrete(value: Any) -> int:
    """An int from a possibly symbolic size: at :func:`sizes_at`'s sizes where given, otherwise
    at its hint (the size of the call being compiled). Installs no guard.

    A data-dependent (unbacked) size, such as an expert-parallel all-to-all's received tokens,
    has no hint: it is evaluated as Inductor sizes it, at the ShapeEnv's optimization hint with
    Inductor's ``unbacked_symint_fallback`` for symbols it knows nothing about."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    sizes = _SIZES.get()
    node = value.node
    if sizes and node.maybe_as_int() is None:
        hints = {sym: int(val) for sym, val in node.shape_env.backed_var_to_val.items()}
        expr = sympy.sympify(node.expr.xreplace({**hints, **sizes}))  # a lone symbol becomes its int
        if not expr.free_symbols:
            return int(expr)
    if node.hint is not None:
        return int(node.hint)
    return optimization_hint(value, fallback=inductor_config.unbacked_symint_fallback)


def count_kinds(costs: Iterable[NodeCost]) -> dict[str, int]:
    """How many nodes of each kind (collectives also by collective kind)."""
    counts: dict[str, int] = {}
    for cost in costs:
        counts[cost.kind] = counts.get(cost.kind, 0) + 1
        if cost.collective is not None:
            counts[cost.collective.kind] = counts.get(cost.collective.kind, 0) + 1
    return counts
