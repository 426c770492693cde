"""The memory traffic of Megatron-core's hidden dropout, which the traced model does not run.

The paper's testbed trains with ``hidden_dropout: 0.1`` and ``bias_dropout_add_fusion: true``
(``megatron_settings.py``): after attention and after the MLP, each decoder layer computes
``residual + dropout(x)`` in one fused kernel (Megatron-core's ``bias_dropout_add_fused_train``,
a TorchScript function of ``torch.nn.functional.dropout`` and the add). The traced HF-style model
has the plain residual add, already priced; dropout adds, per element of the layer's hidden
states (``mbs x seq / cp x hidden`` on every TP rank: no sequence parallelism on the testbed):

- forward: the fused kernel also writes the dropout mask it saves for the backward, one byte per
  element (``torch.bool``); the random numbers come from Philox in registers (not priced);
- backward: ``grad_x = grad_out * mask / (1 - p)``, a kernel of its own reading the bf16 gradient
  (2 bytes) and the mask (1) and writing the bf16 gradient (2); the residual branch's gradient
  passes through (no kernel, as without dropout);
- with full recompute, the recomputed forward in the backward writes the mask again (Megatron
  restores the RNG state, so it is the same mask).

Assumptions: bf16 activations, no sequence parallelism, two fused adds per decoder layer, the
mask's bytes as one ``bool`` each (the saved mask of ``native_dropout``). Priced as memory-bound
ops on the simulated GPU, appended to the stage's forward and backward graphs (sequential and,
for Kareus, the work outside the partitions: ``graph_workload.with_extra_ops``). The forward's mask writes join kernels that already
run, so they are one op per graph (no launches of their own); the backward's are one per add.
"""

from __future__ import annotations

import dataclasses

from kareus_fx.workload import GraphName, OpCost

__all__ = ["DROPOUT_ADDS_PER_LAYER", "dropout_ops"]

DROPOUT_ADDS_PER_LAYER = 2
"""The fused bias-dropout-adds of a pre-LN decoder layer: after attention and after the MLP."""
MASK_BYTES = 1
"""One ``torch.bool`` per element."""
ACTIVATION_BYTES = 2
"""bf16."""


def dropout_ops(graph: GraphName, layers: int, elements: float, recompute: str) -> tuple[OpCost, ...]:
    """The ops dropout adds to ``graph`` of a stage of ``layers`` decoder layers, ``elements`` the
    hidden states' size per GPU; ``recompute``: the stage's activation checkpointing
    (``"full"`` rewrites the mask in the backward)."""
    adds = DROPOUT_ADDS_PER_LAYER * layers
    if adds <= 0 or elements <= 0:
        return ()
    masks = OpCost("dropout_mask_write", "dropout", 0.0, adds * elements * MASK_BYTES, bound="memory")
    if graph == "forward":
        return (masks,)
    grad_bytes = elements * (2 * ACTIVATION_BYTES + MASK_BYTES)
    backward = tuple(
        OpCost(f"dropout_backward_{i}", "dropout_backward", 0.0, grad_bytes, bound="memory") for i in range(adds)
    )
    return ((dataclasses.replace(masks, name="dropout_mask_rewrite"),) if recompute == "full" else ()) + backward
