"""Import torchtitan 0.3.0 on a machine without Triton (CPU CI; docs/design.md: no Triton there).

Every torchtitan model imports ``torchtitan.distributed.minimal_async_ep.kernels`` (Triton kernels
for MoE expert parallelism) at import time. The dense llama3 model never calls them. Without
Triton, :func:`import_torchtitan` registers a placeholder for exactly that module whose kernels
raise when called, then imports what the tests use. Test-only: kareus itself never imports it.
"""

from __future__ import annotations

import importlib.util
import sys
import types

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def _needs_triton(*_args, **_kwargs):
    raise RuntimeError("torchtitan's MoE expert-parallel kernels need Triton, which this test machine has not")


def import_torchtitan() -> types.ModuleType:
    """``torchtitan.models.llama3``, importable without Triton."""
    if importlib.util.find_spec("triton") is None and _KERNELS not in sys.modules:
        placeholder = types.ModuleType(_KERNELS)
        for name in _NAMES:
            setattr(placeholder, name, _needs_triton)
        sys.modules[_KERNELS] = placeholder
    import torchtitan.models.llama3 as llama3

    return llama3
