"""torchtitan with FSDP2 and tensor parallelism: its step tail.

torchtitan (``torchtitan/train.py``, ``parallelize_llama``) shards every parameter, its gradient and
its optimizer state with FSDP2 (``fully_shard``) over the data-parallel shard mesh, which holds the
context-parallel ranks too (``dp_shard_cp``), and tensor-parallelises the linears with DTensor.
After the last microbatch's backward (gradient synchronisation is on for that microbatch only
under pipeline parallelism), it does, on every GPU:

1. the reduce-scatter of each gradient over the ``cp x dp`` group, in fp32
   (``mixed_precision_reduce = "float32"``), leaving each rank the ``1/(cp x dp)`` it owns;
2. ``clip_grad_norm_``: a read of that gradient shard and an all-reduce of one number (a latency);
3. AdamW (``foreach``) over the fp32 parameter shard: reads of gradient, parameter and both moments,
   writes of parameter and moments (28 bytes per parameter); ``zero_grad(set_to_none=True)`` frees
   the gradients (no pass).

Assumptions: the reduce-scatter is priced exposed after the last backward (FSDP2 issues it per
layer during that backward, so part of it hides under the backward's compute: an upper bound);
the next step's parameter all-gather is prefetched under the forward (FSDP2's prefetching) and
not priced; no embedding is tied across pipeline stages; the model's other costs are the traced
order's (``traced_order.py``). The same helpers price the collectives and passes as Megatron-LM's
tail (``step_tail.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.frameworks.base import JobRequest
from kareus_fx.frameworks.step_tail import GRAD_BYTES_PER_PARAM, StepTail, collective_cost, rank_parameters
from kareus_fx.frameworks.traced_order import TracedOrder
from kareus_fx.workload import CollectiveKind, OpCost

__all__ = ["FSDP_STEP_BYTES_PER_PARAM", "TorchtitanFSDP"]

FSDP_STEP_BYTES_PER_PARAM: Mapping[str, int] = {"grad_norm": 4, "adamw": 28}
"""HBM bytes per parameter of the shard of each memory-bound pass of the step (module docstring)."""


class TorchtitanFSDP(TracedOrder):
    """torchtitan's FSDP2 + TP step (module docstring); the microbatches as the traced order."""

    name = "torchtitan-fsdp"

    def step_tail(self, req: JobRequest, simulator: Simulator) -> StepTail | None:
        """Gradient reduce-scatter over ``cp x dp``, the norm's all-reduce, AdamW over the shard."""
        spec = simulator.spec
        params = rank_parameters(self.model_config(req), self.stage_layer_counts(req), req.tp, req.pp)
        shards = req.cp * req.dp
        spans = req.tp * shards > (spec.gpus_per_node or req.tp * shards)
        kind: CollectiveKind = "reduce_scatter" if shards > 1 else "all_reduce"
        sync = [collective_cost(simulator, n * GRAD_BYTES_PER_PARAM, shards, spans, kind) for n in params]
        norm_s = simulator.params.comm_latency_s if req.pp * req.tp * shards > 1 else 0.0
        step = []
        for n in params:
            ops = [
                OpCost(name, "optimizer", 0.0, b * n / shards, bound="memory")
                for name, b in FSDP_STEP_BYTES_PER_PARAM.items()
            ]
            m = simulator.predict_sequence(ops, (), clock_mhz=spec.clock_max_mhz).measurement
            step.append((m.time_s, m.energy_j))
        sync_s, step_s = max(t for t, _ in sync), max(t for t, _ in step)
        time_s = sync_s + norm_s + step_s
        # every rank: its own sync and step, idle at the blocking power for the rest of the tail
        energy_j = sum(se + oe + (time_s - st - ot) * spec.blocking_power_w for (st, se), (ot, oe) in zip(sync, step))
        parts = {"grad_sync": sync_s, "embedding_grad_sync": 0.0, "grad_norm_reduce": norm_s, "optimizer": step_s}
        return StepTail(time_s=time_s, energy_j=energy_j, parts_s=parts, parameters_per_gpu=params)
