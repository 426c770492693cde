"""Expert-parallel token exchange by counts: torchtitan's all-to-all token dispatcher.

With ``capture_scalar_outputs`` the dispatcher's Dynamo graph reads, per MoE block::

    routing_map = zeros_like(scores, dtype=bool).scatter_(-1, ids, True)  # ids: top-k expert ids
    counts = routing_map.sum(dim=(0, 1))                                  # tokens per expert
    buffer.add_(counts)                                                    # load-balance statistics
    order = argsort(ids.view(-1)); rows = x[order // K]                    # rows routed by expert
    received = all_to_all_single(counts.view(ep, -1), None, None)          # my experts' counts, every rank
    in_sizes = counts.view(ep, -1).sum(1).tolist()                         # .item(): unbacked symbols
    out_sizes = received.reshape(-1).view(ep, -1).sum(1).tolist()
    got = all_to_all_single(rows, out_sizes, in_sizes)                     # the rows of my experts
    perm = ... repeat_interleave(arange, received counts) ...; got = got[perm]   # expert-major
    y = experts(got)       # row by row; a row's expert from repeat_interleave of the counts
    back = y.new_empty(got.size()); back[perm] = y
    done = all_to_all_single(back, in_sizes, out_sizes)                    # the rows come home
    out = scatter_add(zeros_like(x), (order // K).reshape(-1, 1).expand(-1, D), done * scores)

Split: each nanobatch routes its own tokens with its own copy of the whole chain: its counts, its
count exchange, its ``.item()`` calls (binding its own unbacked symbols), its exchanges of rows
and its permutation. The statistics buffer gets the sum of the two nanobatches' counts, integers
whose sum is exactly the full batch's counts. Every rank runs the same split graph, so nanobatch
``h``'s exchanges meet nanobatch ``h``'s on every other rank, issued in the same order.

Why the result is exact: rows only move (the exchanges, gathers and scatters by positions) or are
transformed row by row (the expert MLP on each row with its expert), and the dispatcher returns
each row's result to its place for any tokens, so for each nanobatch's. Nothing reads a count
except as the sizes, offsets or experts of the rows it counts: there is no capacity limit (which
would make a token's result depend on how many other tokens chose its expert).

What the rules prove and what they trust. Proved: the counts are the per-expert sums of a one-hot
map of the same top-k ids that the routing sort sorts (so they count the rows routed by that sort,
in the sort's expert order); the dispatch exchange sends rows routed by that sort with input sizes
read from those counts and output sizes read from the counts the count exchange received; between
the dispatch and the combine every op is row by row along the received rows, or moves them by
indices derived from the received counts; the combine exchanges the received rows back with the
dispatch's sizes swapped, giving rows in the sort's routed order again, which the sort's positions
scatter-add back to token order. The received rows' indices (:class:`~.values.RowIndex`: a row's
position, or its segment, i.e. its expert) are never data: positions only gather or scatter the
rows, segments only select each row's expert by equality with the experts' ids, so a result that
depends on where a row landed (a capacity on the received rows) is refused. Trusted, as the
program's own invariant: the dispatcher pairs each received row with its own expert (it does for
any tokens). Dynamo's assertions on the sizes are kept per nanobatch where they hold for any
batch (``>= 0``), or rewritten to the nanobatch's number of routed rows where they compare with
the batch's (the counts of ``T`` tokens' ``K`` distinct top-k ids sum to ``T * K``); any other is
refused. Anything else that touches these values is refused and the graph stays unsplit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

# The families whose rules this module refines register first (plain imports: no edge to the package).
import kareus_fx.passes.batch_dims.collectives
import kareus_fx.passes.batch_dims.pointwise
import kareus_fx.passes.batch_dims.reductions
import kareus_fx.passes.batch_dims.routing
import kareus_fx.passes.batch_dims.tensor_metadata
import kareus_fx.passes.batch_dims.views  # noqa: F401
from kareus_fx.passes.batch_dims.node_args import _arg, _norm_dim
from kareus_fx.passes.batch_dims.op_names import is_exchanged, name_target, op_name
from kareus_fx.passes.batch_dims.propagation import (
    BATCH_RULES,
    BatchAnalysis,
    _node_arg,
    register_batch_rule,
    register_inplace_rule,
)
from kareus_fx.passes.batch_dims.routing import _expert_count
from kareus_fx.passes.batch_dims.values import (
    BatchDim,
    Call,
    ExchangeCounts,
    FromHalf,
    Positions,
    RowIndex,
    SplitSizes,
    Step,
    _is_split,
    is_symbolic,
)

# Ops on counts that keep them per-nanobatch counts of the same exchange (shapes are the full batch's).
_COUNT_OPS = ("view", "reshape", "sum", "to", "cumsum", "sub", "add", "t", "getitem")
# Reshapes other than view/reshape whose received rows must stay one dim (their generic rule does
# arithmetic on the full batch's size, which here is a data-dependent expression).
_ROW_RESHAPES = ("flatten", "unflatten", "squeeze", "unsqueeze")
_PREVIOUS = {
    name: BATCH_RULES.rule_to_refine(name)
    for name in (*_COUNT_OPS, *_ROW_RESHAPES, "c10d.all_to_all_single", "new_empty", "expand")
}
_PREVIOUS_COMPARISONS = {name: BATCH_RULES.rule_to_refine(name) for name in ("ge", "le", "eq", "lt", "gt", "ne")}
_PREVIOUS_SETITEM = BATCH_RULES.rule_to_refine("setitem", inplace=True)


def _split_inputs(an: BatchAnalysis, node: fx.Node) -> list[Any]:
    return [an.info(a) for a in node.all_input_nodes if _is_split(an.info(a))]


def _uniform(an: BatchAnalysis, node: fx.Node, kind: type) -> Any:
    """The one ``kind`` info every split input of ``node`` has; None when no input has one;
    Unsupported when they mix it with anything else."""
    infos = _split_inputs(an, node)
    if not any(isinstance(i, kind) for i in infos):
        return None
    if any(i != infos[0] for i in infos):
        raise an._fail(node, f"mixes {kind.__name__} with other per-nanobatch values ({infos})")
    return infos[0]


# ---- the counts --------------------------------------------------------------------------


def _routing_sort(an: BatchAnalysis, routing_map: Any) -> fx.Node | None:
    """The routing sort whose ids ``routing_map`` one-hot encodes: ``routing_map`` is
    ``zeros_like(s, dtype=bool).scatter_(-1, ids, True)``, ``ids`` the top-k indices over the last
    dim of ``s`` (so ``K`` distinct experts per token), and the graph sorts the same ids, flattened,
    ascending. (The sort may come later in the graph: the rows it routes are exchanged only by
    sizes read from these counts, which the dispatch checks.)"""
    if not (
        isinstance(routing_map, fx.Node) and op_name(routing_map) == "scatter_" and routing_map.op == "call_method"
    ):
        return None
    zeros, dim, ids, value = (list(routing_map.args) + [None] * 4)[:4]
    shape = an.shape(routing_map)
    if not (isinstance(zeros, fx.Node) and op_name(zeros) == "zeros_like" and value is True):
        return None
    if not isinstance(dim, int) or _norm_dim(dim, len(shape)) != len(shape) - 1:
        return None
    if _expert_count(an, ids) != shape[-1]:
        return None
    sorts = []
    todo = [ids] if isinstance(ids, fx.Node) else []
    while todo:
        n = todo.pop()
        for user in n.users:
            if op_name(user) in ("view", "reshape", "flatten") and user.args[0] is n:
                todo.append(user)
            elif op_name(user) in ("argsort", "sort") and user.args[0] is n and len(an.shape(n)) == 1:
                if _arg(user, 2, "descending", False) is False:
                    sorts.append(user)
    return sorts[0] if len(sorts) == 1 else None


@register_batch_rule("sum", replace=True)
def _rule_sum(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """Tokens per expert: a one-hot routing map summed over every dim but the experts'."""
    x = _node_arg(an, node, 0)
    info = an.info(x)
    if isinstance(info, BatchDim) and info.order is None:
        sort = _routing_sort(an, x)
        dims = _arg(node, 1, "dim")
        nd = len(an.shape(x))
        if (
            sort is not None
            and isinstance(dims, (list, tuple))
            and {_norm_dim(d, nd) for d in dims} == set(range(nd - 1))
        ):
            if _arg(node, 2, "keepdim", False) is not False or _arg(node, 3, "dtype") is not None:
                raise an._fail(node, "token counts kept with extra dims or another dtype")
            return Step(ExchangeCounts(sort, None), True)
    return _counts_or(an, node, name)


def _counts_or(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """Arithmetic and views on counts give counts of the same exchange; anything else: the rule
    this module refines."""
    counts = _uniform(an, node, ExchangeCounts)
    if counts is None:
        return _PREVIOUS[name](an, node, name)
    return Step(counts, True)


for _name in ("to", "cumsum", "t"):
    register_batch_rule(_name, replace=True)(_counts_or)


@register_inplace_rule("add_")
def _rule_count_statistics(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``buffer.add_(counts)`` (load-balance statistics): one shared add of the two nanobatches'
    integer counts, which sum exactly to the full batch's."""
    buffer, counts = node.args[0], _node_arg(an, node, 1)
    info = an.info(counts)
    v = an.vals.get(counts)
    if (
        node.kwargs
        or an.info(buffer) is not None
        or not isinstance(info, ExchangeCounts)
        or info.exchange is not None
        or not isinstance(v, torch.Tensor)
        or v.dtype.is_floating_point
    ):
        raise an._fail(node, "in-place op on a batch-carrying tensor")
    return Step(
        None,
        False,
        lambda h: Call("call_function", add_counts_, (buffer, FromHalf(counts, 0), FromHalf(counts, 1)), {}),
    )


def add_counts_(buffer: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``buffer.add_(a + b)``: the statistics update with both nanobatches' counts."""
    return buffer.add_(a + b)


@register_batch_rule("item")
def _rule_item(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``.item()`` of one count (``.tolist()`` in the program): a size bound per nanobatch."""
    x = _node_arg(an, node, 0)
    info = an.info(x)
    if not isinstance(info, ExchangeCounts) or an.shape(x) != ():
        raise an._fail(node, "reads a batch-dependent value as a Python number")
    return Step(SplitSizes(info.order, info.exchange), True)


# ---- the sizes ---------------------------------------------------------------------------


def _routed_rows(an: BatchAnalysis, node: fx.Node, sort: fx.Node, b: int) -> int:
    """The number of rows ``sort`` routes for ``b`` batch elements."""
    info = an.info(sort)
    positions = info[1] if isinstance(info, tuple) else info
    if not isinstance(positions, Positions):
        raise an._fail(node, f"compares split sizes with a number of rows before {sort.name} routes them")
    return positions.layout.size(b)


def _rule_comparison(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """A comparison Dynamo asserts on sizes: ``>= 0``, kept; ``<=`` or ``==`` the number of routed
    rows (an upper bound of a nanobatch's input size, and their sum), that nanobatch's number; any
    other (which may hold for the batch and not for a nanobatch) is refused. Received
    rows' segments equal to the shared expert ids: each row's one-hot expert (the dispatcher pairs
    a row with its own expert); any other comparison of row indices (a position against a
    capacity) is refused."""
    if any(isinstance(i, RowIndex) for i in _split_inputs(an, node)):
        return _row_expert_mask(an, node, name)
    sizes = _uniform(an, node, SplitSizes)
    if sizes is None:
        return _PREVIOUS_COMPARISONS[name](an, node, name)
    a, c = (list(node.args) + [None])[:2]
    if node.kwargs or not isinstance(c, int) or an.info(a) != sizes:
        raise an._fail(node, "compares split sizes with something other than a constant")
    if name == "ge" and c == 0:  # a size, in every nanobatch
        return Step(sizes, True)
    if name in ("le", "eq") and sizes.exchange is None and c == _routed_rows(an, node, sizes.order, an.batch):
        return Step(
            sizes,
            True,
            lambda h: Call(node.op, node.target, (a, _routed_rows(an, node, sizes.order, an.halves[h])), {}),
        )
    raise an._fail(node, f"asserts split sizes {name} {c}, which need not hold for a nanobatch")


for _name in _PREVIOUS_COMPARISONS:
    register_batch_rule(_name, replace=True)(_rule_comparison)


def _row_expert_mask(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    segments, experts = _node_arg(an, node, 0), _arg(node, 1, "other")
    info = an.info(segments)
    v = an.vals.get(experts) if isinstance(experts, fx.Node) else None
    if (
        name != "eq"
        or node.kwargs
        or not isinstance(info, RowIndex)
        or info.kind != "segment"
        or an.info(experts) is not None
        or not isinstance(v, torch.Tensor)
        or v.dtype.is_floating_point
    ):
        raise an._fail(node, "compares received rows' indices other than their segments with the experts' ids")
    return Step(info.layout.moved(len(an.shape(node)) - len(an.shape(segments))), True)


@register_batch_rule("aten._assert_scalar", "sym_sum")
def _rule_sizes(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """An assertion on split sizes, or their sum: per nanobatch."""
    sizes = _uniform(an, node, SplitSizes)
    if sizes is None:
        raise an._fail(node, "reads batch-carrying values")
    return Step(sizes, True)


name_target(torch.sym_sum, "sym_sum")


@register_batch_rule("size")
def _rule_size(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``x.size()`` of received rows: that nanobatch's sizes."""
    x = node.args[0]
    info = an.info(x)
    if len(node.args) != 1 or node.kwargs or not is_exchanged(info):
        raise an._fail(node, "reads the size of a batch-carrying tensor")
    counts = an.info(info.order)
    return Step(SplitSizes(counts.order, info.order), True)


# ---- the exchanges -----------------------------------------------------------------------


def _group_size(an: BatchAnalysis, node: fx.Node) -> int:
    group = node.args[3] if len(node.args) > 3 else None
    if not isinstance(group, str):
        raise an._fail(node, f"group {group!r} is not a group name")
    return _resolve_process_group(GroupName(group)).size()


def _sizes_of(an: BatchAnalysis, splits: Any, n: int) -> SplitSizes | None:
    """The common info of a list of ``n`` size nodes, each a :class:`SplitSizes`; else None."""
    if not isinstance(splits, (list, tuple)) or len(splits) != n:
        return None
    infos = {an.info(s) if isinstance(s, fx.Node) else None for s in splits}
    only = infos.pop() if len(infos) == 1 else None
    return only if isinstance(only, SplitSizes) else None


@register_batch_rule("c10d.all_to_all_single", replace=True)
def _rule_exchange(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """The count exchange (equal splits of a nanobatch's counts), the dispatch (rows routed by the
    sort, by sizes read from its counts and from the counts received), the combine (received rows
    back with the dispatch's sizes swapped); any other all-to-all: the collectives rule."""
    x = _node_arg(an, node, 0)
    info = an.info(x)
    out_splits: Any = node.args[1]
    in_splits: Any = node.args[2]
    if isinstance(info, ExchangeCounts):
        rows = an.shape(x)[0]
        group = _group_size(an, node)
        for splits in (out_splits, in_splits):
            if splits is not None and list(splits) != [rows // group] * group:
                raise an._fail(node, "exchanges token counts by uneven split sizes")
        if info.exchange is not None or rows % group:
            raise an._fail(node, "exchanges received counts or counts not divisible among the ranks")
        return Step(ExchangeCounts(info.order, node), True)
    if not any(isinstance(s, fx.Node) for splits in (out_splits, in_splits) for s in (splits or ())):
        return _PREVIOUS[name](an, node, name)
    group = _group_size(an, node)
    outs, ins = _sizes_of(an, out_splits, group), _sizes_of(an, in_splits, group)
    if isinstance(info, BatchDim) and info.dim == 0 and info.order is not None and not is_exchanged(info):
        if (
            outs is None
            or ins is None
            or outs.order is not info.order
            or ins.order is not info.order
            or outs.exchange is None
            or ins.exchange is not None
        ):
            raise an._fail(node, "exchanges routed rows by sizes that are not read from their counts")
        return Step(BatchDim(0, 1, 1, outs.exchange), True)
    if is_exchanged(info) and info.dim == 0:
        for dispatch, step in an.steps.items():
            if (
                op_name(dispatch) == name
                and step.info == info
                and dispatch.args[1] == in_splits
                and dispatch.args[2] == out_splits
            ):
                return Step(an.info(dispatch.args[0]), True)
        raise an._fail(node, "returns received rows by sizes other than their dispatch's, swapped")
    raise an._fail(node, "exchanges batch data by data-dependent split sizes")


# ---- the received rows -------------------------------------------------------------------


@register_batch_rule("repeat_interleave")
def _rule_rows_of_counts(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``arange(n).repeat_interleave(received counts, output_size=received rows)``: one entry per
    received row (its expert, its segment)."""
    src, repeats = _node_arg(an, node, 0), _arg(node, 1, "repeats")
    size = node.kwargs.get("output_size")
    counts, sizes = an.info(repeats), an.info(size)
    if (
        an.info(src) is not None
        or len(an.shape(src)) != 1
        or not isinstance(counts, ExchangeCounts)
        or counts.exchange is None
        or sizes != SplitSizes(counts.order, counts.exchange)
        or _arg(node, 2, "dim") is not None
    ):
        raise an._fail(node, "repeats by counts other than the received ones")
    return Step(RowIndex(BatchDim(0, 1, 1, counts.exchange), "segment"), True)


@register_batch_rule("arange")
def _rule_arange_rows(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``arange(received rows)``: one entry per received row."""
    sizes = an.info(node.args[0]) if len(node.args) == 1 else None
    if not isinstance(sizes, SplitSizes) or sizes.exchange is None or set(node.kwargs) - {"device", "dtype"}:
        raise an._fail(node, "a range whose length is not a number of received rows")
    return Step(RowIndex(BatchDim(0, 1, 1, sizes.exchange), "position"), True)


@register_batch_rule("add", "sub", replace=True)
def _rule_index_arithmetic(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """Sums and differences of received rows' positions (a segment's offset plus a row's place):
    positions; of counts: counts."""
    infos = _split_inputs(an, node)
    if not any(isinstance(i, RowIndex) for i in infos):
        return _counts_or(an, node, name)
    if any(not (isinstance(i, RowIndex) and i.kind == "position" and i.layout == infos[0].layout) for i in infos):
        raise an._fail(node, f"arithmetic on received rows' indices other than positions ({infos})")
    return Step(infos[0], True)


@register_batch_rule("getitem", replace=True)
def _rule_getitem(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """A count by an int; a segment's offset by the segment of each received row; received rows
    permuted by positions; a trailing size-1 dim added to a row index. Anything else that indexes
    with or into counts or row indices is refused."""
    src, idx = _node_arg(an, node, 0), node.args[1]
    info = an.info(src)
    if isinstance(info, ExchangeCounts) and isinstance(idx, int):
        return Step(info, True)
    items = idx if isinstance(idx, tuple) else (idx,)
    index = items[0]
    by: Any = an.info(index) if isinstance(index, fx.Node) else None
    if isinstance(info, RowIndex):
        if index == slice(None) and all(a is None for a in items[1:]):
            return Step(info, True)  # expert_of_row[:, None]
        raise an._fail(node, "indexes received rows' indices other than by adding trailing dims")
    if not isinstance(index, fx.Node) or not isinstance(by, RowIndex):
        if isinstance(info, ExchangeCounts) or any(isinstance(an.info(a), (ExchangeCounts, RowIndex)) for a in items):
            raise an._fail(node, "indexes with or into token counts")
        return _PREVIOUS[name](an, node, name)
    if len(an.shape(index)) != 1 or any(a != slice(None) for a in items[1:]):
        raise an._fail(node, "indexes by received rows' indices other than one per row")
    if by.kind == "segment" and isinstance(info, ExchangeCounts) and info.exchange is by.layout.order:
        if len(items) == 1 and len(an.shape(src)) == 1:
            return Step(RowIndex(by.layout, "position"), True)  # the offset of each row's segment
    if by.kind == "position" and info == by.layout:
        return Step(info, True)  # received rows permuted
    raise an._fail(node, f"gathers {info} by received rows' {by.kind}s")


@register_batch_rule("new_empty", replace=True)
def _rule_new_empty(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``y.new_empty(got.size())``: a buffer for received rows."""
    size = node.args[1] if len(node.args) == 2 else None
    info = an.info(size) if isinstance(size, fx.Node) else None
    if not isinstance(info, SplitSizes):
        return _PREVIOUS[name](an, node, name)
    rows = an.info(node.args[0])
    if node.kwargs or not is_exchanged(rows) or rows.order is not info.exchange:
        raise an._fail(node, "an empty tensor shaped like received rows of another exchange")
    return Step(BatchDim(0, 1, 1, info.exchange), True)


@register_inplace_rule("setitem", replace=True)
def _rule_scatter_rows(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``back[perm] = y`` into a fresh ``new_empty`` buffer of received rows."""
    target, idx, value = node.args
    info = an.info(target)
    if not is_exchanged(info):
        return _PREVIOUS_SETITEM(an, node, name)
    items = idx if isinstance(idx, tuple) else (idx,)
    order = {n: k for k, n in enumerate(node.graph.nodes)}
    if (
        not isinstance(target, fx.Node)
        or op_name(target) != "new_empty"
        or any(order[u] < order[node] for u in target.users if u is not node)
        or not isinstance(items[0], fx.Node)
        or an.info(items[0]) != RowIndex(info, "position")
        or len(an.shape(items[0])) != 1
        or any(a != slice(None) for a in items[1:])
        or an.info(value) != info
    ):
        raise an._fail(node, "in-place op on received rows other than filling a fresh buffer by row indices")
    return Step(None, True)


def _rule_reshape_rows(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """A view of received rows that keeps them one dim, its other dims reshaped alone."""
    x = _node_arg(an, node, 0)
    info = an.info(x)
    if isinstance(info, ExchangeCounts) or not is_exchanged(info):
        return _counts_or(an, node, name)
    in_shape, out_shape = an.shape(x), an.shape(node)
    rows = in_shape[info.dim]
    if any(isinstance(a, fx.Node) and an.info(a) is None for a in node.args[1:]):
        raise an._fail(node, "a view of received rows to a shared symbolic size")
    for d, size in enumerate(out_shape):
        if is_symbolic(size) and size == rows:
            before_in, after_in = in_shape[: info.dim], in_shape[info.dim + 1 :]
            before_out, after_out = out_shape[:d], out_shape[d + 1 :]
            fixed = all(not is_symbolic(s) for s in (*before_in, *after_in, *before_out, *after_out))
            if fixed and _prod(before_in) == _prod(before_out) and _prod(after_in) == _prod(after_out):
                return Step(info.moved(d), True)
    raise an._fail(node, f"reshape {in_shape} -> {out_shape} mixes received rows with other dims")


for _name in _ROW_RESHAPES:
    register_batch_rule(_name, replace=True)(_rule_reshape_rows)


def _prod(sizes: Any) -> int:
    out = 1
    for s in sizes:
        out *= s
    return out


# ---- back in token order -----------------------------------------------------------------


def _rule_positions_column(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``positions.reshape(-1, 1).expand(-1, D)``: each row's position repeated along a new last
    dim (the index of a row-wise scatter)."""
    x = _node_arg(an, node, 0)
    info = an.info(x)
    if not isinstance(info, Positions):
        return _rule_reshape_rows(an, node, name) if name != "expand" else _PREVIOUS[name](an, node, name)
    in_shape, out_shape = an.shape(x), an.shape(node)
    if name == "expand":
        ok = len(in_shape) == 2 and in_shape[1] == 1 and len(out_shape) == 2 and out_shape[0] == in_shape[0]
        ok = ok and isinstance(node.args[1], int) and node.args[1] == -1
    else:
        ok = len(in_shape) == 1 and out_shape == (in_shape[0], 1) and tuple(node.args[1:]) == (-1, 1)
    if not ok or info.layout.dim != 0:
        raise an._fail(node, f"{name} of positions {in_shape} -> {out_shape}")
    return Step(info, True)


for _name in ("view", "reshape", "expand"):
    register_batch_rule(_name, replace=True)(_rule_positions_column)


def _rule_scatter_add(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``out.scatter_add(0, positions, rows)``: rows routed by a sort added into token order at
    their positions (each nanobatch's positions are its own)."""
    if name == "scatter_add":
        out, dim, index, src = (
            _node_arg(an, node, 0),
            _arg(node, 1, "dim"),
            _node_arg(an, node, 2),
            _node_arg(an, node, 3),
        )
    else:  # torchtitan's op: (out, index, src) along dim 0
        out, dim, index, src = _node_arg(an, node, 0), 0, _node_arg(an, node, 1), _node_arg(an, node, 2)
    o, p, s = an.info(out), an.info(index), an.info(src)
    if (
        dim != 0
        or not isinstance(o, BatchDim)
        or o.dim != 0
        or o.order is not None
        or not isinstance(p, Positions)
        or p.space != o
        or s != p.layout
        or an.shape(index)[1:] != an.shape(src)[1:]  # the rows' count may be an exchange's symbols
    ):
        raise an._fail(node, "a scatter-add whose rows, positions and output are not one routing's")
    return Step(o, True)


register_batch_rule("scatter_add", "torchtitan.deterministic_scatter_add")(_rule_scatter_add)


@register_inplace_rule("scatter_")
def _rule_routing_map(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``zeros_like(s, dtype=bool).scatter_(-1, ids, True)``: the one-hot routing map, built on
    a fresh tensor no other op reads, along a dim that is not the batch's."""
    target, dim, index, value = (list(node.args) + [None] * 4)[:4]
    info = an.info(target)
    if (
        not isinstance(target, fx.Node)
        or op_name(target) != "zeros_like"
        or list(target.users) != [node]
        or not isinstance(info, BatchDim)
        or info.order is not None
        or an.info(index) != info
        or not isinstance(dim, int)
        or _norm_dim(dim, len(an.shape(target))) == info.dim
        or isinstance(value, fx.Node)
        or node.kwargs
    ):
        raise an._fail(node, "in-place op on a batch-carrying tensor")
    return Step(info, True)
