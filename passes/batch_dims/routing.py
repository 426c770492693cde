"""Mixture-of-experts routing: tokens sorted by expert, counted per expert, multiplied by their
experts' weights in groups, and put back in token order.

The Hugging Face MoE blocks (Mixtral, Qwen3-MoE: ``transformers.integrations.moe``) route the
flattened top-k choices of the tokens::

    ids = topk(probs, K).indices.reshape(-1)        # expert ids in [0, E)
    ids_sorted, perm = sort(ids)                     # routed order
    rows = x[perm // K]                              # the tokens, routed
    counts = histc(ids_sorted.float(), bins=E, min=0, max=E - 1)
    y = grouped_mm(rows, w, offs=cumsum(counts))     # row r times expert ids_sorted[r]
    inv = empty_like(perm); inv[perm] = arange(len(perm))
    out = y[inv]                                     # back in token order

Each nanobatch routes its own tokens: its sort, counts and offsets differ from the full batch's,
but every routed row is computed from its own token alone (the grouped GEMM multiplies each row by
its own expert's weight; there is no capacity limit), so back in token order a nanobatch's rows
equal the full batch's rows of its tokens. The rules prove that chain:

* ``sort``/``argsort`` of a 1-D batch-carrying tensor gives values in routed order (a
  :class:`~.values.BatchDim` with ``order``) and :class:`~.values.Positions` (routed layout,
  batch-order space);
* ``positions // c`` maps positions of a ``(B, k)`` layout to its ``(B, k / c)`` layout (top-k
  slot to token);
* ``x[positions]``, ``x`` laid out as the positions' space: ``x``'s rows in the positions' layout
  (gathered by the sort: routed; by its inverse: in batch order again);
* ``histc`` of the sort's ids with one bin per expert over ``[0, E - 1]`` (``bincount`` with
  ``minlength=E``), the ids provably top-k indices over a last dim of size ``E`` and the sort
  ascending: :class:`~.values.ExpertCounts`; their ``cumsum``: the group offsets;
* a grouped GEMM of rows routed by a sort with that sort's offsets and shared weights: rows in
  the same routed order;
* ``inv = empty_like(perm); inv[perm] = arange(n)``: the inverse positions (each nanobatch
  scatters its own ``arange``);
* ``a /= s`` (and ``+=``, ``-=``, ``*=``) on a tensor a fresh op made, whose other users ran
  before and made no view of it: the top-k weights' normalisation.

Everything else that touches these values is refused by the generic rules (a routed dim meets only
values routed by the same sort, is never sliced, reshaped across, nor returned; positions and
counts are no operand of other ops), so the graph stays unsplit with a warning naming the op. A
capacity limit, which drops tokens once an expert is full and so makes a token's result depend on
the other tokens of its batch, needs counts read as something other than grouped-GEMM offsets or
routed rows sliced or masked by them: no rule accepts either.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

# The families whose rules this module refines register first (plain imports: no edge to the package).
import kareus_fx.passes.batch_dims.along_dim
import kareus_fx.passes.batch_dims.indexing
import kareus_fx.passes.batch_dims.pointwise  # noqa: F401
from kareus_fx.passes.batch_dims.node_args import _arg
from kareus_fx.passes.batch_dims.op_names import name_target, op_name
from kareus_fx.passes.batch_dims.propagation import (
    BATCH_RULES,
    BatchAnalysis,
    _node_arg,
    register_batch_rule,
    register_inplace_rule,
)
from kareus_fx.passes.batch_dims.values import BatchDim, Call, ExpertCounts, Positions, Step

for _target, _name in (
    (operator.setitem, "setitem"),
    (operator.iadd, "iadd"),
    (operator.isub, "isub"),
    (operator.imul, "imul"),
    (operator.itruediv, "itruediv"),
):
    name_target(_target, _name)


_SORT_RULE = BATCH_RULES.rule_to_refine("sort")
_FLOOR_DIVIDE_RULE = BATCH_RULES.rule_to_refine("floor_divide")
_GETITEM_RULE = BATCH_RULES.rule_to_refine("getitem")
_CUMSUM_RULE = BATCH_RULES.rule_to_refine("cumsum")
_EMPTY_LIKE_RULE = BATCH_RULES.rule_to_refine("empty_like")

# Ops whose result never aliases an input (a fresh tensor a later in-place op may mutate alone).
_FRESH = {"softmax", "log_softmax", "sigmoid", "linear", "matmul", "mm", "sum", "add", "sub", "mul", "div", "exp"}
# Multi-output ops whose outputs are fresh tensors.
_FRESH_TUPLES = {"topk", "sort", "max", "min"}
# Conversions and views the expert ids pass through between the top-k and the sort or count.
_ID_PASSTHROUGH = {"reshape", "view", "flatten", "contiguous", "float", "to", "long", "int"}


@register_batch_rule("sort", "argsort", replace=True)
def _rule_sort(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if (
        not isinstance(i, BatchDim)
        or len(an.shape(x)) != 1
        or i.p != 1
        or i.order is not None
        or _arg(node, 1, "dim", -1) not in (0, -1)
    ):
        return _SORT_RULE(an, node, name)
    routed = BatchDim(0, i.k, 1, node)
    positions = Positions(routed, i)
    return Step((routed, positions) if name == "sort" else positions, True)


@register_batch_rule("floor_divide", replace=True)
def _rule_floor_divide(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    pos, c = node.args[0], node.args[1] if len(node.args) > 1 else None
    i = an.info(pos)
    if not isinstance(i, Positions):
        return _FLOOR_DIVIDE_RULE(an, node, name)
    space = i.space
    if not isinstance(c, int) or c <= 0 or space.p != 1 or space.order is not None or space.k % c:
        raise an._fail(node, f"divides positions laid out as {space} by {c!r}")
    return Step(Positions(i.layout, BatchDim(space.dim, space.k // c)), True)


@register_batch_rule("getitem", replace=True)
def _rule_getitem(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    src, idx = node.args
    index = idx[0] if isinstance(idx, tuple) and len(idx) == 1 else idx
    i = an.info(index)
    if not isinstance(i, Positions):
        return _GETITEM_RULE(an, node, name)
    if an.info(src) != i.space or i.space.dim != 0:
        raise an._fail(node, f"gathers rows laid out as {an.info(src)} by positions along {i.space}")
    return Step(i.layout, True)


def _expert_count(an: BatchAnalysis, ids: Any) -> int | None:
    """``E`` when ``ids`` are, through views and conversions, the indices of a top-k over a last
    dim of size ``E`` (so every id is in ``[0, E)``); else None."""
    while isinstance(ids, fx.Node) and op_name(ids) in _ID_PASSTHROUGH:
        ids = ids.args[0]
    if not (isinstance(ids, fx.Node) and op_name(ids) == "getitem" and ids.args[1] == 1):
        return None
    topk = ids.args[0]
    if not isinstance(topk, fx.Node) or op_name(topk) != "topk":
        return None
    scores = _node_arg(an, topk, 0)
    shape = an.shape(scores)
    if _arg(topk, 2, "dim", -1) not in (-1, len(shape) - 1) or not isinstance(shape[-1], int):
        return None
    return shape[-1]


def _counted_sort(an: BatchAnalysis, node: fx.Node, counted: Any) -> tuple[fx.Node, int]:
    """The ascending sort whose values ``counted`` are (through conversions), and the number of
    experts its ids range over; Unsupported otherwise."""
    while isinstance(counted, fx.Node) and op_name(counted) in _ID_PASSTHROUGH:
        counted = counted.args[0]
    sort = counted.args[0] if isinstance(counted, fx.Node) and op_name(counted) == "getitem" else None
    if not (isinstance(sort, fx.Node) and op_name(sort) == "sort" and counted.args[1] == 0):
        raise an._fail(node, "counts values that are not the ids of a routing sort")
    if _arg(sort, 2, "descending", False) is not False:
        raise an._fail(node, "the routing sort is descending: its groups are not in expert order")
    experts = _expert_count(an, sort.args[0])
    if experts is None:
        raise an._fail(node, "cannot prove the counted ids are top-k expert indices")
    return sort, experts


@register_batch_rule("histc")
def _rule_histc(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    sort, experts = _counted_sort(an, node, node.args[0])
    bins, low, high = _arg(node, 1, "bins", 100), _arg(node, 2, "min", 0), _arg(node, 3, "max", 0)
    if (bins, low, high) != (experts, 0, experts - 1):
        raise an._fail(node, f"histc(bins={bins}, min={low}, max={high}) is not one bin per expert of {experts}")
    return Step(ExpertCounts(sort, cumulative=False), True)


@register_batch_rule("bincount")
def _rule_bincount(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    sort, experts = _counted_sort(an, node, node.args[0])
    if _arg(node, 1, "weights") is not None or _arg(node, 2, "minlength", 0) != experts:
        raise an._fail(node, f"bincount is not one unweighted count per expert of {experts}")
    return Step(ExpertCounts(sort, cumulative=False), True)


@register_batch_rule("cumsum", replace=True)
def _rule_cumsum(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    i = an.info(node.args[0])
    if not isinstance(i, ExpertCounts):
        return _CUMSUM_RULE(an, node, name)
    if i.cumulative or _arg(node, 1, "dim") not in (0, -1):
        raise an._fail(node, "a running sum of expert counts that is not their offsets")
    return Step(ExpertCounts(i.order, cumulative=True), True)


def _rule_grouped_mm(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, w, offs = _node_arg(an, node, 0), node.args[1], _arg(node, 2, "offs")
    i, counts = an.info(x), an.info(offs)
    if (
        not isinstance(i, BatchDim)
        or i.order is None
        or i.dim != 0
        or len(an.shape(x)) != 2
        or an.info(w) is not None
        or counts != ExpertCounts(i.order, cumulative=True)
        or any(an.info(a) is not None for a in list(node.args[3:]) + list(node.kwargs.values()) if a is not offs)
    ):
        raise an._fail(node, "a grouped GEMM whose rows, weights or offsets are not one routing's")
    return Step(i, True)


register_batch_rule("_grouped_mm", "grouped_mm", "transformers.grouped_mm_fallback")(_rule_grouped_mm)


@register_batch_rule("empty_like", replace=True)
def _rule_empty_like(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    perm = node.args[0]
    i = an.info(perm)
    if not isinstance(i, Positions):
        return _EMPTY_LIKE_RULE(an, node, name)
    if not any(_inverts(an, user, node, perm) for user in node.users):
        raise an._fail(node, "an empty tensor like positions that is not filled with their inverse")
    return Step(Positions(i.space, i.layout), True)


def _is_arange(value: Any, n: int) -> bool:
    if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target is torch.arange):
        return False
    return list(value.args) in ([n], [0, n], [0, n, 1]) and not set(value.kwargs) - {"device", "dtype"}


def _inverts(an: BatchAnalysis, user: fx.Node, target: fx.Node, perm: Any) -> bool:
    """Whether ``user`` is ``target[perm] = arange(len(perm))``."""
    if not (user.op == "call_function" and user.target is operator.setitem):
        return False
    t, index, value = user.args
    return t is target and isinstance(perm, fx.Node) and index is perm and _is_arange(value, an.shape(perm)[0])


def scatter_inverse(target: torch.Tensor, perm: torch.Tensor) -> None:
    """``target[perm] = arange(len(perm))``: one nanobatch's inverse of its own permutation."""
    target[perm] = torch.arange(perm.shape[0], device=perm.device, dtype=target.dtype)


@register_inplace_rule("setitem")
def _rule_setitem(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    target, perm, _value = node.args
    if not (
        isinstance(target, fx.Node) and isinstance(an.info(target), Positions) and _inverts(an, node, target, perm)
    ):
        raise an._fail(node, "in-place op on a batch-carrying tensor")
    return Step(None, True, lambda h: Call("call_function", scatter_inverse, (target, perm), {}))


@register_inplace_rule("iadd", "isub", "imul", "itruediv")
def _rule_inplace_arithmetic(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    a, b = node.args
    if not (isinstance(a, fx.Node) and _fresh(a)):
        raise an._fail(node, "in-place op on a batch-carrying tensor that may alias another")
    order = {n: k for k, n in enumerate(node.graph.nodes)}
    for user in a.users:
        if user is not node and (order[user] > order[node] or not _fresh(user)):
            raise an._fail(node, f"in-place op on a tensor {user.name} also reads or views")
    return an._pointwise(node, [a, b])


def _fresh(node: fx.Node) -> bool:
    """Whether ``node``'s result is a new tensor, aliasing none of its inputs."""
    name = op_name(node)
    if name == "getitem":
        src = node.args[0]
        return isinstance(src, fx.Node) and op_name(src) in _FRESH_TUPLES and isinstance(node.args[1], int)
    return name in _FRESH
