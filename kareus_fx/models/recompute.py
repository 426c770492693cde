"""Activation checkpointing (recompute) of the reference models: which policy each mode means.

- ``"none"``: every activation the backward needs is saved (no recompute).
- ``"full"``: Megatron-LM's full recompute (``--recompute-granularity full --recompute-method
  uniform --recompute-num-layers 1``): each decoder layer is one checkpointed region
  (``torch.utils.checkpoint``, non-reentrant); the forward saves only each layer's input and the
  backward runs every layer's forward again (its TP collectives included) before its gradient.
  The Kareus paper's testbed ran with activation checkpointing ("We use activation checkpointing
  to reduce memory pressure", section 6.1) on Megatron-LM, whose checkpointing is this one, so
  the presets plan with it.
- ``"selective"``: Megatron-LM's selective recompute (``--recompute-granularity selective``,
  Korthikanti et al. 2022): only the core attention (scores, softmax, weighted values: the
  ``kareus::attention`` op, or SDPA) is checkpointed; projections, norms and collectives are saved.

Under ``torch.compile`` a checkpointed region is one ``tag_activation_checkpoint`` node in
Dynamo's graph; the nanobatch split copies it per nanobatch (``passes/batch_dims/higher_order.py``) and
aot_autograd's min-cut partitioner puts the recomputed forward into the backward graph, so
partitions and their types come out of the traced backward as for any other graph.
"""

from __future__ import annotations

from torch import fx

from kareus_fx.errors import OptionsError

RECOMPUTE_MODES = ("none", "full", "selective")
LIVE_CHECKPOINTED = "checkpointed"
"""``recompute`` of a plan of a live graph with checkpointed regions (compile-time tuning): the
policy is the user's, the plan records only that there is one."""
CHECKPOINT_OP = "tag_activation_checkpoint"
"""Name of the higher-order op Dynamo records for a ``torch.utils.checkpoint`` region."""


def check_recompute(mode: str) -> str:
    """``mode`` if it is one of :data:`RECOMPUTE_MODES`, else an error naming them."""
    if mode not in RECOMPUTE_MODES:
        raise OptionsError(f"--recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    return mode


def live_recompute(gm: fx.GraphModule) -> str:
    """The ``recompute`` a plan of the live Dynamo graph ``gm`` records."""
    return LIVE_CHECKPOINTED if checkpoint_regions(gm) else "none"


def checkpoint_regions(gm: fx.GraphModule) -> int:
    """How many activation-checkpointed regions Dynamo's graph ``gm`` holds."""
    return sum(
        1
        for node in gm.graph.nodes
        if node.op == "call_function" and getattr(node.target, "__name__", "") == CHECKPOINT_OP
    )
