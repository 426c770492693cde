"""Elementwise ops (unary, broadcasting binary and ternary) and conversions of dtype or device.

Every output entry depends only on the entries of its operands at the same (broadcast) index, so
the op commutes with slicing the batch: each nanobatch runs it on its rows. Operands must agree on
where the batch sits after broadcasting; a shared operand that is batch-sized along that dim is
sliced per nanobatch. A conversion (``x.float()``, ``x.to(...)``) keeps its input's batch; the
batch may not enter through its dtype or device argument.

Inside an ``autograd.Function`` backward a part of a batch sum passes through linear ops only:
sums of parts, a part scaled by a shared factor, negation, copies and conversions.
"""

from __future__ import annotations

import torch.fx as fx

from kareus_fx.passes.batch_dims.propagation import (
    BatchAnalysis,
    passes_partial,
    register_batch_rule,
    register_partial_rule,
)
from kareus_fx.passes.batch_dims.values import PARTIAL, BatchDim, Step

_POINTWISE = (
    # unary
    "abs",
    "neg",
    "positive",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "sqrt",
    "rsqrt",
    "sin",
    "cos",
    "tan",
    "tanh",
    "sinh",
    "cosh",
    "asin",
    "acos",
    "atan",
    "sigmoid",
    "relu",
    "gelu",
    "silu",
    "mish",
    "softplus",
    "elu",
    "selu",
    "celu",
    "leaky_relu",
    "hardtanh",
    "relu6",
    "hardswish",
    "hardsigmoid",
    "logsigmoid",
    "softsign",
    "tanhshrink",
    "erf",
    "erfc",
    "erfinv",
    "reciprocal",
    "square",
    "sign",
    "sgn",
    "floor",
    "ceil",
    "round",
    "trunc",
    "frac",
    "logical_not",
    "bitwise_not",
    "isnan",
    "isinf",
    "isfinite",
    "nan_to_num",
    "clamp",
    "clip",
    "clamp_min",
    "clamp_max",
    "threshold",
    "contiguous",
    "clone",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
    "conj",
    "real",
    "imag",
    "angle",
    "xlogy",
    "hypot",
    "heaviside",
    # binary / ternary, broadcasting
    "add",
    "sub",
    "mul",
    "div",
    "true_divide",
    "floor_divide",
    "remainder",
    "fmod",
    "pow",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "logical_and",
    "logical_or",
    "logical_xor",
    "atan2",
    "copysign",
    "rsub",
    "lerp",
    "addcmul",
    "addcdiv",
    "where",
    "masked_fill",
)


# Only the first argument is data; the others give a dtype or device.
_CONVERT = (
    "float",
    "half",
    "bfloat16",
    "double",
    "int",
    "long",
    "short",
    "bool",
    "byte",
    "char",
    "to",
    "type",
    "type_as",
    "detach",
)


@register_batch_rule(*_POINTWISE)
def _rule_pointwise(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    ops = [a for a in node.args if isinstance(a, fx.Node)]
    ops += [a for a in node.kwargs.values() if isinstance(a, fx.Node)]
    return an._pointwise(node, ops)


@register_batch_rule(*_CONVERT)
def _rule_convert(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    src = node.args[0]
    i = an.info(src)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters only through a dtype/device argument")
    return Step(i, True)


register_partial_rule(*_CONVERT, "neg", "positive", "contiguous", "clone")(passes_partial)


@register_partial_rule("add", "sub")
def _partial_sum(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """Parts of batch sums add up to the part of the sum; a shared addend would count twice."""
    tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
    parts = [a for a in tensor_args if an.info(a) is PARTIAL]
    if len(parts) != len(tensor_args):
        raise an._fail(node, "adds a shared tensor to a partial batch sum")
    return Step(PARTIAL, True)


@register_partial_rule("mul", "div", "true_divide")
def _partial_scaled(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """A part of a batch sum times (or over) a shared factor is the part of the scaled sum."""
    tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
    parts = [a for a in tensor_args if an.info(a) is PARTIAL]
    if len(parts) != 1:
        raise an._fail(node, "product of two partial batch sums")
    if name in ("div", "true_divide") and an.info(node.args[0]) is not PARTIAL:
        raise an._fail(node, "divides by a partial batch sum")
    return Step(PARTIAL, True)
