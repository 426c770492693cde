"""Group an analysed aten graph's computation into the kernels Inductor generates, and price them.

A rule that mirrors Inductor's scheduler (``torch/_inductor/scheduler.py``), so it also runs on
the full-size meta-device trace where no code is generated:

- Extern kernels, one kernel per node: matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``),
  convolutions, attention (``kareus::attention`` and its backward, the CPU SDPA kernels), and
  scatter-accumulates (``index_put`` with ``accumulate``); collectives and waits are their own
  kernels and are priced elsewhere (``kind`` collective and wait).
- ``cat`` is Inductor's ``ConcatKernel``, which runs no kernel of its own: each computed
  (fusible) input is stored straight into its slice of the output by its own kernel, and the
  writers of equal-sized slices at one depth fuse (they share the output buffer and usually
  their reads). Inputs that are not computed by a fusible kernel (graph inputs, extern
  outputs) are copied in by a kernel of their own, the ``cat`` node's. A ``cat`` without such
  inputs becomes kind "other" with no bytes, like a view.
- Every other computation (pointwise ops, reductions, copies, casts) is fusible:
  * a pointwise node read only by fusible ops, by one of them or reading at most
    ``REALIZE_READS`` stored tensors itself, is inlined: computed inside its consumers'
    kernels, never stored (Inductor's lazy lowering and ``should_realize_on_reuse``);
  * a node joins the kernel of each stored fusible producer whose loop covers the same number
    of elements (a pointwise op: its output's; a reduction: its output's or its input's):
    vertical fusion of pointwise chains, of a producer into a reduction and of a reduction's
    epilogue (over the reduced or the full shape);
  * fusible kernels over the same number of elements that read one computed tensor join
    (horizontal fusion: Inductor fuses nodes that share reads);
  * two reductions join only when they write the same number of elements (Inductor fuses
    reductions over the same loops only), no join makes a cycle (a kernel that would have to
    run both before and after another), and none joins the two nanobatches' work (labels from
    ``passes/nanobatch_labels.py``).
- Views, aliases and ``getitem`` make no kernel.

Bytes of a kernel: each tensor it reads from outside (a graph input or another kernel's output)
once, plus each output that a node outside the kernel (or the graph's output) uses. Each node's
``NodeCost.bytes`` becomes its share (the outside tensors it is first to read, and its outputs
that leave the kernel), so a kernel's nodes sum to the kernel's bytes; its intensity and bound
are the kernel's. FLOPs are the nodes' own. Kernel ids go to ``node.meta["kareus_kernel"]``
(``None`` for nodes outside any kernel); ids are ``k<i>`` in order of each kernel's first node.

Not mirrored: Inductor's fusion-size and proximity limits, and its loop reordering. An inlined
node's FLOPs are priced once, in its first consumer's kernel, although each consumer recomputes
it; its bytes are what each kernel that recomputes it reads (the stored tensors behind it).
``bench/kernel_fidelity.py`` measures the rule against the kernels Inductor generates.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.fx

from kareus_fx.passes.analysis import META_KEY, hinted
from kareus_fx.passes.nanobatch import NANOBATCH_META

aten = torch.ops.aten
KERNEL_META = "kareus_kernel"
REALIZE_READS = 4
"""Inductor stores a pointwise result that several ops read when its own computation reads more
stored tensors than this (``config.realize_reads_threshold``)."""

_EXTERN_TARGETS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.convolution.default,
    aten.convolution_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    torch.ops.kareus.attention.default,
    torch.ops.kareus.attention_backward.default,
    aten.index_put.default,
    aten._unsafe_index_put.default,
    aten._unsafe_masked_index_put_accumulate.default,
    aten.scatter_add.default,
    aten.sort.default,
    aten.topk.default,
}


@dataclass(frozen=True)
class Kernel:
    """One kernel: its id, its nodes in graph order, what it moves and computes."""

    kernel_id: str
    nodes: tuple[str, ...]
    extern: bool
    bytes: float
    flops: float


def group_kernels(gm: torch.fx.GraphModule, ridge_flops_per_byte: float) -> list[Kernel]:
    """Group ``gm``'s analysed computation into kernels (module docstring); reprices node costs."""
    nodes = list(gm.graph.nodes)
    cost = {n: n.meta.get(META_KEY) for n in nodes}
    compute = [n for n in nodes if cost[n] is not None and cost[n].kind == "compute"]
    parent = {n: n for n in compute}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    iteration = {n: _iteration_numel(n) for n in compute}
    label = {n: n.meta.get(NANOBATCH_META) for n in compute}
    label_of_root = dict(label)
    reduced_of_root = {n: _reduction_output(n) for n in compute}

    def union(a: torch.fx.Node, b: torch.fx.Node) -> None:
        ra, rb = find(a), find(b)
        la, lb = label_of_root[ra], label_of_root[rb]
        ka, kb = reduced_of_root[ra], reduced_of_root[rb]
        if ra is rb or (la is not None and lb is not None and la != lb) or (ka and kb and ka != kb):
            return
        parent[rb] = ra
        label_of_root[ra] = la if la is not None else lb
        reduced_of_root[ra] = ka or kb

    consumers = {n: _consumers(n, cost) for n in compute}
    inlined: set[torch.fx.Node] = set()
    # Depth: kernel boundaries on the longest path from the inputs. An edge is free (weight 0)
    # when both ends are fusible and the producer is inlined or loops over the same elements;
    # every other edge crosses a boundary. Free edges between nodes of equal depth join kernels:
    # every path between two nodes of a kernel then stays inside it, so no kernel has to run
    # both before and after another (Inductor refuses fusions that would make such a cycle).
    depth: dict[torch.fx.Node, int] = {}
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    stored: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # producers, inlined ones expanded
    for node in nodes:
        producers = _producers(node, cost)
        depth[node] = max(
            (depth[p] + (0 if _free_edge(p, node, parent, iteration, inlined) else 1) for p in producers), default=0
        )
        stored[node] = list(dict.fromkeys(q for p in producers for q in (stored[p] if p in inlined else [p])))
        if node in parent and _inlinable(node, consumers[node], parent, iteration, reads=len(stored[node])):
            inlined.add(node)
        if node not in parent or node in inlined or not _fusible(node):
            continue
        for producer in stored[node]:
            if (
                producer in parent
                and _fusible(producer)
                and iteration[producer] & iteration[node]
                and depth[producer] == depth[node]
            ):
                union(producer, node)
        for producer in stored[node]:
            if producer in parent:
                readers.setdefault(producer, []).append(node)
    # Horizontal fusion: fusible kernels at one depth over the same elements that read one
    # computed tensor become one kernel (Inductor fuses nodes that share reads).
    for shared in readers.values():
        by_key: dict[tuple[int, int], torch.fx.Node] = {}
        for reader in shared:
            first = by_key.setdefault((depth[reader], max(iteration[reader])), reader)
            union(first, reader)
    kernel_less = _join_concat_writers(compute, cost, depth, union)
    # An inlined node is computed inside its consumers' kernels: it joins its first consumer's.
    for node in reversed(compute):
        if node in inlined:
            parent[node] = find(consumers[node][0])
    for node in kernel_less:
        node.meta[META_KEY] = dataclasses.replace(
            cost[node], kind="other", flops=0.0, bytes=0.0, intensity=None, bound=None
        )
    return _price(
        nodes,
        [n for n in compute if n not in kernel_less],
        find,
        cost,
        ridge_flops_per_byte,
        {n: stored[n] for n in inlined},
    )


def _join_concat_writers(compute: list[torch.fx.Node], cost: dict, depth: dict, union) -> set[torch.fx.Node]:
    """Per ``cat``: join the kernels at one depth that write its equal-sized slices. Returns the
    ``cat`` nodes left with no kernel: those with no input to copy in (module docstring)."""
    kernel_less = set()
    for cat in (n for n in compute if n.target is aten.cat.default):
        writer_of_size: dict[tuple[int, int], torch.fx.Node] = {}
        copied_sizes: set[int] = set()
        for piece in dict.fromkeys(cat.all_input_nodes):
            size = _numel(piece.meta.get("val"))
            writer = _slice_writer(piece, cost)
            if size == 0:
                continue  # an empty input (a KV cache's first step) is skipped, as ATen skips it
            if writer is None:
                copied_sizes.add(size)
            else:
                union(writer_of_size.setdefault((size, depth[writer]), writer), writer)
        if not copied_sizes:
            kernel_less.add(cat)
    return kernel_less


def _producers(node: torch.fx.Node, cost: dict) -> list[torch.fx.Node]:
    """The nodes whose results ``node`` reads, looking through views, aliases and getitems."""
    seen: dict[torch.fx.Node, None] = {}
    stack = list(node.all_input_nodes)
    while stack:
        inp = stack.pop()
        c = cost.get(inp)
        if inp.op == "call_function" and c is not None and c.kind == "other":
            stack.extend(inp.all_input_nodes)
        else:
            seen.setdefault(inp)
    return list(seen)


def _free_edge(producer: torch.fx.Node, node: torch.fx.Node, compute: dict, iteration: dict, inlined: set) -> bool:
    return (
        producer in compute
        and node in compute
        and _fusible(producer)
        and _fusible(node)
        and (producer in inlined or bool(iteration[producer] & iteration[node]))
    )


def _consumers(node: torch.fx.Node, cost: dict) -> list[torch.fx.Node]:
    """The nodes that read ``node``'s result, looking through views (the output node included)."""
    found: dict[torch.fx.Node, None] = {}
    stack = list(node.users)
    while stack:
        user = stack.pop(0)
        c = cost.get(user)
        if user.op == "call_function" and c is not None and c.kind == "other":
            stack.extend(user.users)
        else:
            found.setdefault(user)
    return list(found)


def _inlinable(
    node: torch.fx.Node, consumers: list[torch.fx.Node], compute: dict, iteration: dict, *, reads: int
) -> bool:
    """Whether Inductor computes a pointwise node inside its consumers instead of storing it: a
    fusible op whose loop is its output (not a reduction), read only by fusible ops, and either
    read by one of them or reading at most ``REALIZE_READS`` stored tensors itself (counting
    through the nodes inlined into it; Inductor's ``should_realize_on_reuse``)."""
    return (
        _fusible(node)
        and iteration[node] == {_numel(node.meta.get("val"))}
        and bool(consumers)
        and all(c in compute and _fusible(c) for c in consumers)
        and (len(consumers) == 1 or reads <= REALIZE_READS)
    )


def _slice_writer(piece: torch.fx.Node, cost: dict) -> torch.fx.Node | None:
    """The fusible computation that can store a ``cat`` input straight into its slice: the
    input itself, or the one computation behind a view of it; None if it must be copied."""
    producers = _producers(piece, cost) if _kind(piece, cost) == "other" and piece.op == "call_function" else [piece]
    if len(producers) == 1 and _kind(producers[0], cost) == "compute" and _fusible(producers[0]):
        return producers[0]
    return None


def _kind(node: torch.fx.Node, cost: dict) -> str | None:
    return None if cost.get(node) is None else cost[node].kind


def _fusible(node: torch.fx.Node) -> bool:
    """Whether a node's work may fuse with its neighbours' (not an extern kernel, not a ``cat``,
    whose pieces :func:`_join_concat_writers` places)."""
    return node.target not in _EXTERN_TARGETS and node.target is not aten.cat.default


def _numel(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return math.prod(hinted(val.shape))
    if isinstance(val, (tuple, list)):
        return max((_numel(v) for v in val), default=0)
    return 0


def _iteration_numel(node: torch.fx.Node) -> frozenset[int]:
    """Elements of the loops a node can share: its output's, and a reduction's input's too (the
    largest input, when larger than the output)."""
    out = _numel(node.meta.get("val"))
    largest = max([out] + [_numel(i.meta.get("val")) for i in node.all_input_nodes])
    return frozenset({out, largest})


def _reduction_output(node: torch.fx.Node) -> frozenset[int]:
    """A reduction's output size (its loop reads more elements than it writes); empty otherwise.
    Inductor fuses two reductions only over the same (output, reduced) loops."""
    out = _numel(node.meta.get("val"))
    return frozenset({out}) if max(_iteration_numel(node)) > out else frozenset()


def _tensor_bytes(val: object) -> float:
    if isinstance(val, torch.Tensor):
        return float(math.prod(hinted(val.shape)) * val.element_size())
    if isinstance(val, (tuple, list)):
        return sum(_tensor_bytes(v) for v in val)
    return 0.0


def _price(nodes, compute, find, cost, ridge, recomputed: dict[torch.fx.Node, list[torch.fx.Node]]) -> list[Kernel]:
    """Kernels with their bytes. ``recomputed`` maps each inlined node to the stored tensors it
    reads: a kernel that reads an inlined node of another kernel recomputes it from those (a
    bf16 -> fp32 cast read by a norm's reduction and its normalisation reads the bf16 tensor
    twice, it never stores the fp32 one), and an inlined node escapes its kernel only as a
    graph output."""
    members: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in compute:
        members.setdefault(find(node), []).append(node)
    kernel_of = {n: root for root, group in members.items() for n in group}
    kernels: list[Kernel] = []
    for index, (root, group) in enumerate(members.items()):
        read: set[torch.fx.Node] = set()
        shares: dict[torch.fx.Node, float] = {}
        for node in group:
            if node.target is aten.cat.default:
                # Computed inputs were written into the output's slices by their kernels; the
                # others are copied in (each slice read and written).
                pieces = dict.fromkeys(node.all_input_nodes)
                shares[node] = sum(
                    2 * _tensor_bytes(p.meta.get("val")) for p in pieces if _slice_writer(p, cost) is None
                )
                continue
            share = 0.0
            for inp in _read_tensors(node, cost):
                for tensor in recomputed[inp] if inp in recomputed and kernel_of.get(inp) is not root else [inp]:
                    if kernel_of.get(tensor) is root or tensor in read:
                        continue
                    read.add(tensor)
                    share += _tensor_bytes(tensor.meta.get("val"))
            if _escapes(node, root, kernel_of, cost, only_as_output=node in recomputed):
                share += _tensor_bytes(node.meta.get("val"))
            shares[node] = share
        total_bytes = sum(shares.values())
        total_flops = sum(cost[n].flops for n in group)
        intensity = total_flops / total_bytes if total_bytes > 0 else float("inf")
        bound = "compute" if intensity >= ridge else "memory"
        kernel_id = f"k{index}"
        for node in group:
            node.meta[KERNEL_META] = kernel_id
            node.meta[META_KEY] = dataclasses.replace(cost[node], bytes=shares[node], intensity=intensity, bound=bound)
        kernels.append(
            Kernel(kernel_id, tuple(n.name for n in group), root.target in _EXTERN_TARGETS, total_bytes, total_flops)
        )
    for node in nodes:
        node.meta.setdefault(KERNEL_META, None)
    return kernels


def _read_tensors(node: torch.fx.Node, cost: dict) -> list[torch.fx.Node]:
    """What a node reads: the producers behind its views (a view reads its base's bytes only
    as far as the view reaches, so a view of a graph input counts as the view's size)."""
    result = []
    for inp in dict.fromkeys(node.all_input_nodes):
        c = cost.get(inp)
        if inp.op == "call_function" and c is not None and c.kind == "other":
            base = _producers(inp, cost)
            if len(base) == 1 and cost.get(base[0]) is not None and cost[base[0]].kind == "compute":
                result.append(base[0])
                continue
        result.append(inp)
    return result


def _escapes(node: torch.fx.Node, root, kernel_of, cost, only_as_output: bool = False) -> bool:
    """Whether a node's result is used outside its kernel (through views), or is a graph output
    (``only_as_output``: the latter only, for an inlined node, which other kernels recompute)."""
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user.op == "output":
            return True
        c = cost.get(user)
        if user.op == "call_function" and c is not None and c.kind == "other":
            stack.extend(user.users)
        elif kernel_of.get(user) is not root and not only_as_output:
            return True
    return False


def count_kernels(kernels: list[Kernel]) -> dict[str, int]:
    """Kernels by kind: ``fused`` (generated) and ``extern`` (library calls)."""
    extern = sum(1 for k in kernels if k.extern)
    return {"fused": len(kernels) - extern, "extern": extern}


__all__ = ["KERNEL_META", "Kernel", "count_kernels", "group_kernels"]
