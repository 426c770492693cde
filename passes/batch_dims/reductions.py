"""Reductions: sums, means, extrema, norms, variances, logical any/all.

A reduction over other dims keeps the batch (moved left by the reduced dims unless ``keepdim``).
One over the batch dim mixes nanobatches: a sum or a mean of the whole batch is recombined from the
two nanobatches' results (the sum of the sums, the size-weighted mean of the means), and only as a
sink (the loss), which the driver checks; any other reduction over the batch is refused.
``torch.max(a, b)`` / ``torch.min(a, b)`` with two tensors are elementwise.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kareus_fx.passes.batch_dims.node_args import _arg, _dims_arg
from kareus_fx.passes.batch_dims.pointwise import _rule_pointwise
from kareus_fx.passes.batch_dims.propagation import BatchAnalysis, _node_arg, register_batch_rule
from kareus_fx.passes.batch_dims.values import BatchDim, Step

_REDUCTIONS = (
    "sum",
    "nansum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "argmin",
    "prod",
    "var",
    "std",
    "logsumexp",
    "all",
    "any",
    "count_nonzero",
    "norm",
)


@register_batch_rule(*_REDUCTIONS)
def _rule_reduction(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    nd = len(an.shape(x))
    if name in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        return _rule_pointwise(an, node, name)  # torch.max(a, b): elementwise
    if name == "norm":
        d, keepdim = _arg(node, 2, "dim"), _arg(node, 3, "keepdim", False)
    elif name in ("var", "std"):  # var(x, dim, unbiased, keepdim) or var(x, unbiased)
        d = _arg(node, 1, "dim")
        keepdim = _arg(node, 3, "keepdim", False)
    elif name == "count_nonzero":
        d, keepdim = _arg(node, 1, "dim"), False
    else:
        d, keepdim = _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False)
    if isinstance(d, (bool, str, torch.dtype)):
        d = None
    dims = _dims_arg(d, nd)
    if dims is None or i.dim in dims:
        if name in ("sum", "nansum"):
            return an._reduction_over_batch(node, "sum")
        if name == "mean":
            return an._reduction_over_batch(node, "mean")
        raise an._fail(node, "reduction over the batch dim (only sums and means are recombined)")
    out_dim = i.dim if keepdim else i.dim - sum(1 for x_ in dims if x_ < i.dim)
    out = i.moved(out_dim)
    v = an.vals.get(node)
    if isinstance(v, (tuple, list)):  # max/min(dim) -> (values, indices)
        return Step(tuple(out for _ in v), True)
    return Step(out, True)
