"""Normalisation layers: ``layer_norm``, ``rms_norm``, ``batch_norm``.

``layer_norm`` and ``rms_norm`` normalise over trailing dims with shared weights: exact per
nanobatch when the batch is not among them. ``batch_norm`` is exact only with running statistics
(not training: training averages over the batch) and the batch off the channel dim.
"""

from __future__ import annotations

import torch.fx as fx

from kareus_fx.passes.batch_dims.node_args import _arg
from kareus_fx.passes.batch_dims.propagation import BatchAnalysis, _node_arg, _seq_arg, register_batch_rule
from kareus_fx.passes.batch_dims.values import BatchDim, Step


@register_batch_rule("layer_norm", "rms_norm")
def _rule_norm(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    extra = [a for a in node.all_input_nodes if a is not x]
    if not isinstance(i, BatchDim) or any(an.info(a) is not None for a in extra):
        raise an._fail(node, "batch-carrying weight or bias")
    n = len(_seq_arg(an, node, 1, "normalized_shape"))
    if i.dim >= len(an.shape(x)) - n:
        raise an._fail(node, "normalises over the batch dim")
    return Step(i, True)


@register_batch_rule("batch_norm")
def _rule_batch_norm(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if _arg(node, 5, "training", False):
        raise an._fail(node, "batch_norm in training mode averages over the batch")
    if (
        not isinstance(i, BatchDim)
        or i.dim == 1
        or any(an.info(a) is not None for a in node.all_input_nodes if a is not x)
    ):
        raise an._fail(node, "batch on the channel dim")
    return Step(i, True)
