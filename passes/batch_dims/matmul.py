"""Contractions: ``linear``, ``matmul`` and its forms (``mm``, ``bmm``, ``addmm``, ``baddbmm``),
and convolutions.

A contraction is exact per nanobatch when the batch is a row dim of one operand or a leading
(broadcast) dim; a shared operand that is batch-sized along a leading dim is sliced. Contracting
over the batch dim sums over it: refused in the main graph, and inside an ``autograd.Function``
backward it is a weight gradient, a nanobatch's part of a batch sum that autograd adds up. A
convolution needs the batch on dim 0 of an input of rank ``n + 2`` and a shared weight.
"""

from __future__ import annotations

import torch.fx as fx

from kareus_fx.passes.batch_dims.node_args import _arg
from kareus_fx.passes.batch_dims.propagation import BatchAnalysis, _node_arg, register_batch_rule
from kareus_fx.passes.batch_dims.values import PARTIAL, BatchDim, Step


@register_batch_rule("linear")
def _rule_linear(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, w, b = _node_arg(an, node, 0), _arg(node, 1, "weight"), _arg(node, 2, "bias")
    if an.info(w) is not None or an.info(b) is not None:
        raise an._fail(node, "batch-carrying weight or bias")
    i = an.info(x)
    nd = len(an.shape(x))
    if i.dim == nd - 1:
        raise an._fail(node, "contracts over the batch dim")
    return Step(i, True)


@register_batch_rule("matmul", "mm", "bmm", "addmm", "baddbmm")
def _rule_matmul(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    bias: fx.Node | None = None
    if name in ("addmm", "baddbmm"):
        bias, a, b = _node_arg(an, node, 0), _node_arg(an, node, 1), _node_arg(an, node, 2)
    else:
        a, b = _node_arg(an, node, 0), _node_arg(an, node, 1)
    sa, sb = an.shape(a), an.shape(b)
    out_shape = an.shape(node)
    no = len(out_shape)
    if len(sa) < 2 or len(sb) < 2:
        # vectors: out = a @ b with the 1-D side contracted away.
        if len(sa) == 1 and len(sb) == 1:
            raise an._fail(node, "dot product over the batch")
        vec, mat = (a, b) if len(sa) == 1 else (b, a)
        if an.info(vec) is not None:
            raise an._fail(node, "batch-carrying vector operand")
        i = an.info(mat)
        nm = len(an.shape(mat))
        contracted = nm - 2 if vec is a else nm - 1
        if i.dim == contracted:
            return _contraction(an, node)
        out = i.moved(i.dim if i.dim < contracted else i.dim - 1)
        return Step(out, True)
    outs = []
    slices = {}
    for operand, s, row_dim, contracted in ((a, sa, len(sa) - 2, len(sa) - 1), (b, sb, len(sb) - 1, len(sb) - 2)):
        i = an.info(operand)
        if isinstance(i, BatchDim):
            if i.dim == contracted:
                return _contraction(an, node)
            if i.dim == row_dim:
                outs.append(i.moved(no - 2 if operand is a else no - 1))
            else:
                outs.append(i.moved(i.dim + no - len(s)))
    if len(outs) == 2 and outs[0] != outs[1]:
        raise an._fail(node, "batch on different dims of the two operands")
    out = outs[0]
    if out.dim < no - 2:  # a leading (broadcast) dim: shared operands may need slicing
        slices = an._shared_slices(node, [a, b], out, out_shape)
    if bias is not None:
        an._pointwise(node, [bias] + ([a] if isinstance(an.info(a), BatchDim) else [b]), out_shape)
        slices.update(an._shared_slices(node, [bias], out, out_shape))
    return Step(out, True, an._with_slices(node, slices))


def _contraction(an: BatchAnalysis, node: fx.Node) -> Step:
    """A matmul summing over the batch: a weight gradient inside an autograd.Function backward."""
    if an.mode != "body":
        raise an._fail(node, "contracts over the batch dim")
    infos = [an.info(a) for a in node.args if isinstance(a, fx.Node)]
    if sum(isinstance(i, BatchDim) for i in infos) != 2:
        raise an._fail(node, "contracts a batch-carrying operand with a shared one")
    return Step(PARTIAL, True)


@register_batch_rule("conv1d", "conv2d", "conv3d")
def _rule_conv(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    n = int(name[-2])
    if not isinstance(i, BatchDim) or len(an.shape(x)) != n + 2 or i.dim != 0 or i.p != 1 or i.k != 1:
        raise an._fail(node, "batch not on dim 0 of a batched convolution input")
    if any(an.info(a) is not None for a in node.all_input_nodes if a is not x):
        raise an._fail(node, "batch-carrying weight")
    return Step(i, True)
