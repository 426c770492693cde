"""Views and reshapes: ``view``/``reshape``/``flatten``, permutations, ``expand``, ``repeat``,
``cat``/``stack`` and their inverses (``chunk``, ``split``, ``unbind``).

A reshape keeps the batch only if the output still holds it as one ``(p, B, k)`` block
(:func:`_reshape_batch`): merged with dims before it (``p``), or with dims after it (``k``), never
cut apart or interleaved with the other nanobatch's elements. Explicit sizes in the call are
rewritten to each nanobatch's size. Permutations move the batch dim; ``expand`` and ``repeat``
must not grow it; ``cat``/``stack`` and the splits must not work along it (except ``chunk`` of an
all-gathered tensor into its ``p`` copies, each of which holds the whole batch once).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from kareus_fx.passes.batch_dims.node_args import _arg, _norm_dim
from kareus_fx.passes.batch_dims.propagation import (
    BatchAnalysis,
    _int_arg,
    _int_list,
    _node_arg,
    _seq_arg,
    passes_partial,
    register_batch_rule,
    register_partial_rule,
)
from kareus_fx.passes.batch_dims.values import BatchDim, Call, SliceOf, Step

_RESHAPES = (
    "view",
    "reshape",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "view_as",
    "reshape_as",
    "view_as_complex",
    "view_as_real",
)


_PERMUTES = ("transpose", "swapaxes", "swapdims", "t", "permute", "movedim", "moveaxis")


register_partial_rule(*_RESHAPES, *_PERMUTES)(passes_partial)


def _reshape_batch(an: BatchAnalysis, node, in_shape, i: BatchDim, out_shape) -> BatchDim:
    """Where the batch lands after a reshape: the output must keep the ``(P, B, R)`` layout."""
    big_p = math.prod(in_shape[: i.dim]) * i.p
    b = an.batch
    rest = math.prod(in_shape) // (big_p * b)
    for d in range(len(out_shape)):
        pre = math.prod(out_shape[:d])
        if pre > big_p:
            break
        if big_p % pre:
            continue
        p2 = big_p // pre
        if out_shape[d] % (p2 * b):
            continue
        k2 = out_shape[d] // (p2 * b)
        if k2 * math.prod(out_shape[d + 1 :]) == rest:
            if i.order is not None and (k2, p2) != (i.k, i.p):
                break  # a routed dim keeps its entries whole
            return BatchDim(d, k2, p2, i.order)
    raise an._fail(node, f"reshape {in_shape} -> {out_shape} mixes the batch with other dims")


@register_batch_rule(*_RESHAPES)
def _rule_reshape(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        if name in ("view_as", "reshape_as"):
            raise an._fail(node, "batch enters through the shape argument")
        raise an._fail(node, "batch enters through a non-data argument")
    if name == "view" and any(isinstance(a, torch.dtype) for a in node.args[1:]):
        raise an._fail(node, "view as another dtype")
    in_shape, out_shape = an.shape(x), an.shape(node)
    if name in ("view_as_complex", "view_as_real"):  # the last dim becomes / leaves the complex pairs
        if name == "view_as_complex" and i.dim == len(in_shape) - 1:
            raise an._fail(node, "the batch is in the complex pair dim")
        return Step(i, True)
    out = _reshape_batch(an, node, in_shape, i, out_shape)

    if name in ("flatten", "squeeze", "unsqueeze"):
        return Step(out, True)  # dim arguments only

    def call(h: int) -> Call:
        hs = an.half_shape(out_shape, out, h)
        if name in ("view", "reshape"):
            return Call(node.op, node.target, (x, hs), {})
        if name == "unflatten":
            d = _norm_dim(_int_arg(an, node, 1, "dim"), len(in_shape))
            n = len(_seq_arg(an, node, 2, "sizes"))
            return Call(node.op, node.target, (x, d, hs[d : d + n]), {})
        # view_as / reshape_as
        return Call("call_method", "reshape", (x, hs), {})

    return Step(out, True, call)


@register_batch_rule(*_PERMUTES)
def _rule_permute(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    nd = len(an.shape(x))
    perm = list(range(nd))
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = _norm_dim(_int_arg(an, node, 1), nd), _norm_dim(_int_arg(an, node, 2), nd)
        perm[a], perm[b] = perm[b], perm[a]
    elif name == "t":
        perm = perm[::-1]
    elif name == "permute":
        dims: object = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        if node.op == "call_function" or "dims" in node.kwargs:
            dims = _arg(node, 1, "dims")
        perm = [_norm_dim(d, nd) for d in _int_list(an, node, dims)]
    else:  # movedim
        src = [_norm_dim(s, nd) for s in _int_list(an, node, _arg(node, 1, "source"))]
        dst = [_norm_dim(s, nd) for s in _int_list(an, node, _arg(node, 2, "destination"))]
        perm = [-1] * nd
        for s, d in zip(src, dst):
            perm[d] = s
        rest = iter([j for j in range(nd) if j not in src])
        perm = [p if p >= 0 else next(rest) for p in perm]
    return Step(i.moved(perm.index(i.dim)), True)


@register_batch_rule("expand", "expand_as")
def _rule_expand(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through the shape argument")
    out_shape = an.shape(node)
    out = i.moved(i.dim + len(out_shape) - len(an.shape(x)))
    return Step(out, True, lambda h: Call("call_method", "expand", (x, an.half_shape(out_shape, out, h)), {}))


@register_batch_rule("repeat")
def _rule_repeat(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    reps = node.args[1:] if not isinstance(node.args[1], (list, tuple)) else node.args[1]
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    out = i.moved(i.dim + len(reps) - len(an.shape(x)))
    if reps[out.dim] != 1:
        raise an._fail(node, "repeats along the batch dim")
    return Step(out, True)


@register_batch_rule("cat", "concat", "concatenate", "stack")
def _rule_cat(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    inputs = _seq_arg(an, node, 0, "tensors")
    tensors = [t for t in inputs if isinstance(t, fx.Node)]
    if len(tensors) != len(inputs):
        raise an._fail(node, "an input is not a tensor")
    out_shape = an.shape(node)
    nd = len(out_shape)
    stack = name == "stack"
    d = _norm_dim(_int_arg(an, node, 1, "dim", 0), nd)
    out = None
    for t in tensors:
        i = an.info(t)
        if isinstance(i, BatchDim):
            cand = i.moved(i.dim + 1 if stack and i.dim >= d else i.dim)
            if out is not None and cand != out:
                raise an._fail(node, "inputs carry the batch on different dims")
            out = cand
        elif i is not None:
            raise an._fail(node, f"unexpected input kind {i!r}")
    if out is None:
        raise an._fail(node, "no batch-carrying input")
    if out.dim == d:
        raise an._fail(node, f"{name} along the batch dim")
    slices = {}
    for t in tensors:
        if an.info(t) is None:
            s = an.shape(t)
            if s == (0,):  # cat skips a 1-D empty tensor (an empty cache): nothing to slice
                continue
            j = out.dim if not stack or out.dim < d else out.dim - 1
            if out.p != 1 or out.order is not None or s[j] != out_shape[out.dim]:
                raise an._fail(node, f"shared input {t.name} cannot be sliced")
            slices[id(t)] = SliceOf(t, out.moved(j))
    return Step(out, True, an._with_slices(node, slices))


@register_batch_rule("chunk", "split", "tensor_split", "unbind")
def _rule_split_like(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    nd = len(an.shape(x))
    if name == "unbind":
        d = _norm_dim(_int_arg(an, node, 1, "dim", 0), nd)
    else:
        d = _norm_dim(_int_arg(an, node, 2, "dim", 0), nd)
    n_out = len(an.vals[node])
    if d != i.dim:
        out = i if name != "unbind" or d > i.dim else i.moved(i.dim - 1)
        return Step(tuple(out for _ in range(n_out)), True)
    # chunk(p) of an all-gathered tensor: each rank's piece holds the whole batch once.
    if name == "chunk" and i.p > 1 and _arg(node, 1, "chunks") == i.p:
        return Step(tuple(BatchDim(d, i.k, 1, i.order) for _ in range(n_out)), True)
    raise an._fail(node, f"{name} along the batch dim")
