"""Random ops whose draws are elementwise over their first argument: dropouts, ``rand_like`` and
kin, ``bernoulli``, ``normal``, ``poisson``, ``rrelu``.

The driver refuses every random op on batch data unless the caller passes ``allow_rng``: each
nanobatch then draws its own numbers (a valid draw, but not the unsplit graph's). A dropout that
draws nothing (``p=0`` or not training) is the identity on its input, as a conversion is. Random
ops without a rule here (``multinomial``, ``gumbel_softmax``, ``randperm``) are refused even with
``allow_rng``.
"""

from __future__ import annotations

import torch.fx as fx

from kareus_fx.passes.batch_dims.op_names import DROPOUTS, dropout_inactive
from kareus_fx.passes.batch_dims.pointwise import _rule_convert
from kareus_fx.passes.batch_dims.propagation import BatchAnalysis, register_batch_rule
from kareus_fx.passes.batch_dims.values import Step


@register_batch_rule(
    *DROPOUTS, "rand_like", "randn_like", "randint_like", "bernoulli", "normal", "poisson", "rrelu", "native_dropout"
)
def _rule_elementwise_random(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    if dropout_inactive(node, name):
        return _rule_convert(an, node, name)
    return an._pointwise(node, [node.args[0]])
