"""Indexing and lookups: ``x[...]``, ``narrow``/``select``, ``index_select``, ``gather``, ``embedding``.

Basic indexing (ints, slices, ``None``, ``...``) is exact per nanobatch when it takes the batch dim
whole; an integer or a partial slice of the batch dim would pick elements of one nanobatch and is
refused. Advanced indexing by integer tensors is exact when every index tensor is shared (each batch
element is indexed alike), or when the batch dim is indexed by a batch ``arange`` (HF's mask
builder): each nanobatch then gets its own ``arange``. A shared table indexed by a batch-carrying
integer tensor is a lookup (RoPE's cos/sin by position ids, ``embedding``): the result carries the
index's batch. An element of a multi-output value (``chunk(...)[0]``) carries that element's batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from kareus_fx.passes.batch_dims.node_args import _arg, _norm_dim
from kareus_fx.passes.batch_dims.op_names import op_name
from kareus_fx.passes.batch_dims.propagation import (
    BatchAnalysis,
    _int_arg,
    _node_arg,
    passes_partial,
    register_batch_rule,
    register_partial_rule,
)
from kareus_fx.passes.batch_dims.values import BatchDim, Call, Step, _is_split, _shape

register_partial_rule("getitem")(passes_partial)


@register_batch_rule("getitem")
def _rule_getitem(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    src, idx = node.args
    info = an.info(src)
    if isinstance(info, tuple):  # element of a multi-output value
        if not isinstance(idx, int):
            raise an._fail(node, "non-constant index into a tuple")
        return Step(info[idx], _is_split(info[idx]))
    items = idx if isinstance(idx, tuple) else (idx,)
    tensors = [a for a in items if isinstance(a, fx.Node)]
    if tensors or any(isinstance(a, (list, torch.Tensor)) for a in items):
        # shared_table[batch_index]: an embedding lookup (RoPE cos/sin by position ids).
        if info is None and len(items) == 1 and isinstance(items[0], fx.Node):
            j = an.info(items[0])
            v = an.vals.get(items[0])
            if (
                isinstance(j, BatchDim)
                and isinstance(v, torch.Tensor)
                and not v.dtype.is_floating_point
                and v.dtype != torch.bool
            ):
                return Step(j, True)
        if isinstance(info, BatchDim):
            return _advanced_getitem(an, node, _node_arg(an, node, 0), info, items)
        raise an._fail(node, "advanced (tensor) indexing involving the batch")
    if not isinstance(info, BatchDim):
        raise an._fail(node, "unexpected input kind")
    shape = an.shape(_node_arg(an, node, 0))
    nd = len(shape)
    consuming = sum(1 for a in items if a is not None and a is not Ellipsis)
    i_dim = o_dim = 0
    out_dim = None
    new_items: list[object] = []
    for a in items:
        if a is None:
            o_dim += 1
        elif a is Ellipsis:
            for _ in range(nd - consuming):
                if i_dim == info.dim:
                    out_dim = o_dim
                i_dim += 1
                o_dim += 1
        elif isinstance(a, int):
            if i_dim == info.dim:
                raise an._fail(node, "integer index into the batch dim")
            i_dim += 1
        elif isinstance(a, slice):
            if i_dim == info.dim:
                full = (
                    a.start in (None, 0)
                    and a.step in (None, 1)
                    and (a.stop is None or (isinstance(a.stop, int) and a.stop >= shape[i_dim]))
                )
                if not full:
                    raise an._fail(node, "slices the batch dim")
                out_dim = o_dim
                new_items.append(slice(None))
            else:
                new_items.append(a)
            i_dim += 1
            o_dim += 1
            continue
        else:
            raise an._fail(node, f"unsupported index {a!r}")
        new_items.append(a)
    if out_dim is None:
        out_dim = o_dim + (info.dim - i_dim)
    new_idx = tuple(new_items) if isinstance(idx, tuple) else new_items[0]
    return Step(info.moved(out_dim), True, lambda h: Call(node.op, node.target, (src, new_idx), {}))


_INDEX_PASSTHROUGH = {"to", "long", "int", "contiguous", "clone", "unsqueeze"}


def _batch_arange_dim(an: BatchAnalysis, node: Any) -> int | None:
    """The dim along which the shared integer tensor ``node`` is ``arange(B)`` (every other dim
    of size 1), or ``None`` when that is not provable from how the graph builds it.

    Follows ``torch.arange(B)`` (start 0, step 1, integer dtype) through ``+ 0`` / ``- 0``,
    integer conversions and indexing or ``unsqueeze``/``view``/``reshape`` that only add or drop
    size-1 dims: HF's mask builder's ``batch_arange[:, None, None, None]``.
    """
    if not isinstance(node, fx.Node) or an.info(node) is not None:
        return None
    v = an.vals.get(node)
    if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dtype == torch.bool:
        return None
    shape = _shape(v)
    big = [d for d, s in enumerate(shape) if s != 1]
    if len(big) != 1 or shape[big[0]] != an.batch:
        return None
    name = op_name(node)
    if node.op == "call_function" and node.target is torch.arange:
        args = list(node.args)
        ok = (
            args in ([an.batch], [0, an.batch], [0, an.batch, 1])
            and node.kwargs.get("start", 0) == 0
            and node.kwargs.get("step", 1) == 1
            and "end" not in node.kwargs
            and "out" not in node.kwargs
        )
        return big[0] if ok else None
    if name in ("add", "sub") and len(node.args) == 2 and node.args[1] == 0 and not node.kwargs:
        src = node.args[0]
    elif name in _INDEX_PASSTHROUGH or name in ("view", "reshape", "getitem"):
        src = node.args[0]
        if name == "getitem":
            items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if not all(a is None or a is Ellipsis or a == slice(None) for a in items):
                return None
        if name in ("to", "long", "int") and any(
            isinstance(a, fx.Node) for a in list(node.args[1:]) + list(node.kwargs.values())
        ):
            return None
    else:
        return None
    return big[0] if _batch_arange_dim(an, src) is not None else None


def getitem_with_batch_arange(src: torch.Tensor, items: tuple, slot: int, index_shape: tuple[int, ...]) -> torch.Tensor:
    """``src[items]`` with ``items[slot]`` replaced by ``arange(n)`` laid out as ``index_shape``
    (``n`` = its one non-1 size): one nanobatch's copy of an index by a batch ``arange``."""
    index = torch.arange(math.prod(index_shape), device=src.device).view(index_shape)
    return src[items[:slot] + (index,) + items[slot + 1 :]]


def _advanced_getitem(an: BatchAnalysis, node: fx.Node, src: fx.Node, info: BatchDim, items: tuple) -> Step:
    """``src[i0, i1, ...]`` with integer index tensors and full slices, ``src`` batch-carrying.

    Exact per nanobatch in two cases: the batch dim is a full slice and every index tensor is
    shared (each batch element is indexed the same way); or the batch dim is indexed by a batch
    ``arange`` (:func:`_batch_arange_dim`) and every other index tensor is shared with size 1
    along the broadcast dim that ``arange`` occupies (element ``b`` of the result reads only
    ``src[b]``). In the second case each nanobatch gets its own ``arange``.
    """
    src_shape = an.shape(src)
    if len(items) > len(src_shape):
        raise an._fail(node, "advanced indexing with more indices than dims")
    adv = [pos for pos, a in enumerate(items) if isinstance(a, fx.Node)]
    for pos, a in enumerate(items):
        if pos in adv:
            v = an.vals.get(a)
            if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dtype == torch.bool:
                raise an._fail(node, "advanced indexing by a non-integer index tensor")
            if an.info(a) is not None:
                raise an._fail(node, "advanced indexing by a batch-carrying index into batch data")
        elif a != slice(None):
            raise an._fail(node, f"advanced indexing mixed with index {a!r}")
    index_shapes = [an.shape(items[pos]) for pos in adv]
    bcast = tuple(torch.broadcast_shapes(*index_shapes))
    contiguous = adv == list(range(adv[0], adv[-1] + 1))
    block_start = adv[0] if contiguous else 0
    if info.dim not in adv:
        if info.dim < len(items):
            before = sum(1 for d in range(info.dim) if d not in adv)
            out_dim = before + (len(bcast) if not contiguous or info.dim > adv[-1] else 0)
        else:  # an unindexed trailing dim
            out_dim = info.dim - len(adv) + len(bcast)
        return Step(info.moved(out_dim), True)
    index = items[info.dim]
    d = _batch_arange_dim(an, index)
    if d is None or info.p != 1 or info.k != 1 or info.order is not None:
        raise an._fail(node, "advanced (tensor) indexing of the batch dim by an index that is not a batch arange")
    own_shape = an.shape(index)
    d_b = d + len(bcast) - len(own_shape)
    slot = info.dim
    for pos, shape in zip(adv, index_shapes):
        j = d_b - (len(bcast) - len(shape))
        if pos != slot and j >= 0 and shape[j] != 1:
            raise an._fail(node, "another index tensor varies along the batch arange's dim")
    out = BatchDim(block_start + d_b)
    others = tuple(items[:slot]) + (None,) + tuple(items[slot + 1 :])  # the slot is filled per nanobatch

    def call(h: int) -> Call:
        shape_h = list(own_shape)
        shape_h[d] = an.halves[h]
        return Call("call_function", getitem_with_batch_arange, (src, others, slot, tuple(shape_h)), {})

    return Step(out, True, call)


@register_batch_rule("narrow", "select")
def _rule_narrow_select(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim) or any(isinstance(a, fx.Node) for a in node.args[1:]):
        raise an._fail(node, "batch enters through an index argument")
    d = _norm_dim(_int_arg(an, node, 1, "dim"), len(an.shape(x)))
    if d == i.dim:
        raise an._fail(node, f"{name} along the batch dim")
    if name == "select" and d < i.dim:
        return Step(i.moved(i.dim - 1), True)
    return Step(i, True)


@register_batch_rule("index_select")
def _rule_index_select(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, d, idx = _node_arg(an, node, 0), _int_arg(an, node, 1, "dim"), _arg(node, 2, "index")
    i = an.info(x)
    if not isinstance(i, BatchDim) or an.info(idx) is not None:
        raise an._fail(node, "batch-carrying index")
    if _norm_dim(d, len(an.shape(x))) == i.dim:
        raise an._fail(node, "index_select along the batch dim")
    return Step(i, True)


@register_batch_rule("gather")
def _rule_gather(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, d, idx = node.args[0], _int_arg(an, node, 1, "dim"), _arg(node, 2, "index")
    step = an._pointwise(node, [x, idx])
    if _norm_dim(d, len(an.shape(node))) == step.info.dim:
        raise an._fail(node, "gather along the batch dim")
    return step


@register_batch_rule("embedding")
def _rule_embedding(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    ids, w = node.args[0], _arg(node, 1, "weight")
    if an.info(w) is not None:
        raise an._fail(node, "batch-carrying embedding table")
    if _arg(node, 3, "max_norm") is not None:
        raise an._fail(node, "max_norm renormalises the table in place")
    if _arg(node, 5, "scale_grad_by_freq", False):
        raise an._fail(node, "scale_grad_by_freq counts tokens over the whole batch")
    return Step(an.info(ids), True)
