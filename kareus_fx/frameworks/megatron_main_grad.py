"""The per-microbatch gradient accumulation of Megatron-core without ``gradient_accumulation_fusion``.

The paper's testbed sets ``gradient_accumulation_fusion: false`` (``megatron_settings.py``). With it
off, Megatron-core's linear layers compute each weight gradient in the parameters' dtype (bf16,
``megatron_amp_O2``), and the distributed data-parallel wrapper's hook adds it into the fp32
``main_grad`` buffer after every microbatch's backward (``param.main_grad.add_(param.grad)``):
per parameter, a read of the bf16 gradient (2 bytes), a read and a write of the fp32 one (4 + 4).
(With the fusion on, the weight-gradient GEMM accumulates into ``main_grad`` in its epilogue:
priced with the GEMM, not here.) The traced model's backward writes its weight gradients and
stops; the accumulation is outside it.

Assumptions: every parameter of the stage on the GPU gets a gradient every microbatch (the
stage's decoder layers, and the embedding or output layer where the stage holds them); the adds
are priced as one memory-bound op in the backward (the per-tensor launches are issued while the
GPU runs the backward's kernels, as a check of Megatron-LM's host launches found).
"""

from __future__ import annotations

from kareus_fx.workload import OpCost

__all__ = ["MAIN_GRAD_ADD_BYTES_PER_PARAM", "main_grad_ops"]

MAIN_GRAD_ADD_BYTES_PER_PARAM = 2 + 4 + 4
"""Read the bf16 gradient, read and write the fp32 ``main_grad``."""


def main_grad_ops(parameters: float) -> tuple[OpCost, ...]:
    """The backward's accumulation of ``parameters`` (one GPU's, of its stage) into ``main_grad``."""
    if parameters <= 0:
        return ()
    return (
        OpCost(
            "main_grad_accumulate", "main_grad_add", 0.0, parameters * MAIN_GRAD_ADD_BYTES_PER_PARAM, bound="memory"
        ),
    )
