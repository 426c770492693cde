"""Batch-dimension propagation over a Dynamo-level FX graph (the analysis half of the nanobatch split).

Given which graph inputs carry the batch (and along which dim), decide for every node whether its
value carries the batch and where, so that the graph can be run as two independent copies on the
two halves of the batch (:mod:`kareus_fx.passes.nanobatch` does the rewriting).

The graph is the one a ``torch.compile`` backend receives: torch-level calls (``call_function`` on
``torch.*`` / ``torch.nn.functional.*`` / ``operator.*``, ``call_method`` on tensors), functional
collectives (``torch.ops._c10d_functional.*``) and higher-order ops (``autograd_function_apply``
for a custom ``torch.autograd.Function``, activation checkpoints, ``flex_attention``).

Layout: a core and one module per op family.

* :mod:`~.values`: what a value can be (shared, :class:`BatchDim`, :data:`PARTIAL`) and a rule's
  decision (:class:`Step`, :class:`Call` and its argument markers).
* :mod:`~.op_names`: canonical op names (:func:`op_name`) and barriers (:func:`is_barrier`).
* :mod:`~.propagation`: the driver (:class:`BatchAnalysis`) and the rule registry
  (:func:`register_batch_rule`, :func:`register_partial_rule`).
* the families, each registering its rules when imported: pointwise, along_dim, reductions, views,
  indexing, matmul, attention, normalization, losses, collectives, higher_order,
  tensor_metadata, random_ops, routing (which refines sort, floor_divide, getitem, cumsum and
  empty_like for mixture-of-experts routing), exchange (which refines the all-to-all, views,
  sums, comparisons and indexing for an expert-parallel exchange by token counts).

A rule either returns a :class:`Step` or raises :class:`Unsupported` naming the op; the caller then
falls back to the unsplit graph. A new family is one module that registers its rules, plus its
import and its entry in :data:`RULE_FAMILIES` below.
"""

from __future__ import annotations

from types import ModuleType

from kareus_fx.passes.batch_dims import (
    along_dim,
    attention,
    collectives,
    exchange,
    higher_order,
    indexing,
    losses,
    matmul,
    normalization,
    pointwise,
    random_ops,
    reductions,
    routing,
    tensor_metadata,
    views,
)
from kareus_fx.passes.batch_dims.op_names import is_barrier, is_inplace, op_name
from kareus_fx.passes.batch_dims.propagation import (
    BATCH_RULES,
    BatchAnalysis,
    BatchRule,
    BatchRuleRegistry,
    Body,
    register_batch_rule,
    register_inplace_rule,
    register_partial_rule,
)
from kareus_fx.passes.batch_dims.values import (
    PARTIAL,
    BatchDim,
    Call,
    FromHalf,
    IndexOffsetBody,
    Info,
    Size,
    SliceOf,
    Step,
    Unsupported,
    Whole,
    is_symbolic,
)

__all__ = [
    "BATCH_RULES",
    "PARTIAL",
    "RULE_FAMILIES",
    "BatchAnalysis",
    "BatchDim",
    "BatchRule",
    "BatchRuleRegistry",
    "Body",
    "Call",
    "FromHalf",
    "IndexOffsetBody",
    "Info",
    "Size",
    "SliceOf",
    "Step",
    "Unsupported",
    "Whole",
    "is_barrier",
    "is_inplace",
    "is_symbolic",
    "op_name",
    "register_batch_rule",
    "register_inplace_rule",
    "register_partial_rule",
]

RULE_FAMILIES: tuple[ModuleType, ...] = (
    pointwise,
    along_dim,
    reductions,
    views,
    indexing,
    matmul,
    attention,
    normalization,
    losses,
    collectives,
    higher_order,
    tensor_metadata,
    random_ops,
    routing,
    exchange,
)
"""The op-family modules; importing them registered their rules in :data:`BATCH_RULES`."""
