"""Balanced pipeline stages: the layer split that evens out the stages' step times.

The Kareus paper's testbed partitions its pipelines by hand "such that stages are as balanced as
possible, following Perseus" (section 6.1). An even split is not: the first stage also runs the
embedding and the last one the final norm, the LM head and the loss (a 152k-word vocabulary's
head costs about three decoder layers of Qwen3-1.7B at TP8), so the other stages idle for part of
every step, and Perseus's energy savings at maximum throughput come mostly from slowing into that
idle time. Planning the testbed's workloads on an even split plans a different pipeline than the
one the paper measured.

Cost of a stage: ``fixed_s + layers x per_layer_s``, Megatron-LM's forward plus backward of one
microbatch at the GPU's maximum clock plus the pipeline sends they end with
(``pipeline_sends.py``: a middle stage sends both ways, the first and last stage one way each):
what the plan's Megatron-LM options cost. Each role's two terms come from the planner's slice
traces of that role (``layer_slice.SLICE_LAYERS``: 2 and 3 layers): the third layer's cost is the
per-layer cost, what is left of the 2-layer slice is the role's fixed cost, to which each stage
adds its sends. Times are the simulated GPU's (``cost_models``), whatever profiler tunes the plan:
the split is chosen before anything is measured. A user who runs another split passes it
(``--stage-layers 15,13``); the plan's graphs must match the job's.

The split minimises the slowest stage's time (the pipeline's step time at maximum throughput in
1F1B's steady state); of the splits that do, it takes layers off the slowest remaining stages, the
later one first on a tie (Megatron-LM's even split also gives the last stage the fewer layers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageCost:
    """One stage's time per microbatch as a function of its layer count."""

    fixed_s: float
    """Work that does not grow with the layer count (embedding, LM head, loss), seconds."""
    per_layer_s: float
    """One decoder layer's forward plus backward, seconds."""

    def time_s(self, layers: int) -> float:
        return self.fixed_s + layers * self.per_layer_s


def cost_from_slices(short_s: float, long_s: float, short_layers: int) -> StageCost:
    """A role's :class:`StageCost` from its ``short_layers``- and ``short_layers + 1``-layer slices'
    times (seconds). Raises ValueError when the extra layer does not cost time."""
    per_layer_s = long_s - short_s
    if per_layer_s <= 0.0:
        raise ValueError(
            f"a {short_layers + 1}-layer slice ({long_s:.6g} s) is not slower than the "
            f"{short_layers}-layer one ({short_s:.6g} s); cannot balance stages on it"
        )
    return StageCost(fixed_s=short_s - short_layers * per_layer_s, per_layer_s=per_layer_s)


def balanced_layer_counts(num_layers: int, stage_costs: Sequence[StageCost]) -> tuple[int, ...]:
    """The split of ``num_layers`` layers over the stages (``stage_costs``: one per stage, in order)
    that minimises the slowest stage (module docstring). Every stage gets at least one layer."""
    num_stages = len(stage_costs)
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {num_stages} stages (1..{num_layers})")
    most = num_layers - (num_stages - 1)

    def capacity(bound_s: float) -> list[int]:
        """Per stage, the most layers that keep it within ``bound_s`` (at most ``most``); the
        tolerance keeps a count whose time is the bound itself from rounding one layer down."""
        return [min(most, math.floor((bound_s - c.fixed_s) / c.per_layer_s + 1e-9)) for c in stage_costs]

    # The optimum is some stage's time at some layer count: the least such bound that fits them all.
    bounds = sorted({c.time_s(n) for c in stage_costs for n in range(1, most + 1)})
    counts = capacity(next(b for b in bounds if min(capacity(b)) >= 1 and sum(capacity(b)) >= num_layers))
    while sum(counts) > num_layers:
        slowest = max(
            (i for i in range(num_stages) if counts[i] > 1), key=lambda i: (stage_costs[i].time_s(counts[i]), i)
        )
        counts[slowest] -= 1
    return tuple(counts)
