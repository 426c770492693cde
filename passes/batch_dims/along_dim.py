"""Ops that work along named dims: softmax, scans, sorts and top-k, flips, ``tril``/``triu``, ``pad``.

Each output entry mixes entries only along the dims the op names (the softmax dim, the last two
for ``tril``, the padded trailing dims), so the op is exact per nanobatch when the batch is not one
of them; along the batch dim it would mix nanobatches, and it is refused. An implicit dim (the
deprecated ``softmax(x)``) is refused too: which dim it picks depends on the rank.
"""

from __future__ import annotations

import torch.fx as fx

from kareus_fx.passes.batch_dims.node_args import _arg, _dims_arg
from kareus_fx.passes.batch_dims.propagation import BatchAnalysis, _node_arg, _seq_arg, register_batch_rule
from kareus_fx.passes.batch_dims.values import BatchDim, Step

# (position, keyword, default) of the dim an op works along; the batch must not be that dim.
_ALONG_DIM = {
    "softmax": (1, "dim", None),
    "log_softmax": (1, "dim", None),
    "cumsum": (1, "dim", None),
    "cumprod": (1, "dim", None),
    "logcumsumexp": (1, "dim", None),
    "normalize": (2, "dim", 1),
    "glu": (1, "dim", -1),
    "argsort": (1, "dim", -1),
    "sort": (1, "dim", -1),
    "topk": (2, "dim", -1),
    "diff": (2, "dim", -1),
    "flip": (1, "dims", None),
    "cummax": (1, "dim", None),
    "cummin": (1, "dim", None),
}


@register_batch_rule(*_ALONG_DIM)
def _rule_along_dim(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    pos, kw, default = _ALONG_DIM[name]
    d = _arg(node, pos, kw, default)
    if d is None:
        raise an._fail(node, "implicit dim")
    dims = _dims_arg(d, len(an.shape(x)))
    if dims is None or i.dim in dims:  # None: an empty dim list, read as every dim
        raise an._fail(node, "works along the batch dim")
    out = an.vals.get(node)
    if isinstance(out, (tuple, list)):
        return Step(tuple(i for _ in out), True)
    return Step(i, True)


@register_batch_rule("tril", "triu")
def _rule_last_two(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim) or i.dim >= len(an.shape(x)) - 2:
        raise an._fail(node, "batch in the last two dims")
    return Step(i, True)


@register_batch_rule("pad")
def _rule_pad(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, pad = _node_arg(an, node, 0), _seq_arg(an, node, 1, "pad")
    i = an.info(x)
    if not isinstance(i, BatchDim) or i.dim >= len(an.shape(x)) - len(pad) // 2:
        raise an._fail(node, "pads the batch dim")
    return Step(i, True)
