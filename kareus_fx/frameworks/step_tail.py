"""Megatron-LM's per-iteration work after the last microbatch: gradient sync and the optimizer step.

The iteration composer prices the pipeline's microbatches (and the sends between stages). After
the last backward, Megatron-LM's ``train_step`` does, on every GPU, once per iteration:

1. ``finalize_model_grads``: the gradient all-reduce over the data-parallel x context-parallel
   group (the ranks that hold the same weights), then, with tied embeddings and a pipeline, the
   all-reduce of the word embedding's gradient between the first stage (input embedding) and the
   last (its copy as the output layer).
2. ``clip_grad_norm``: the L2 norm of the gradients (one read of them) and an all-reduce of that
   one number over the model-parallel group (a latency).
3. ``optimizer.step``: Adam over the fp32 master weights (apex/TE ``multi_tensor_adam``), the copy
   of the updated master weights into the bf16 model weights, and the zeroing of the gradient
   buffer for the next iteration.

Every method runs it alike (the same weights, the same step), so it adds the same time to each;
it shrinks every reduction a little and sets the iteration's absolute scale. Assumptions, each a
stated fact of Megatron-LM or the hardware, none fitted:

- Gradients are accumulated and all-reduced in fp32 (Megatron-LM's ``--bf16`` sets
  ``accumulate_allreduce_grads_in_fp32``), 4 bytes per parameter; the word embedding's gradient
  (``main_grad``) too.
- Bytes moved per parameter by the memory-bound step, each pass one kernel over the rank's
  parameters: the norm reads the fp32 gradient (4); Adam reads gradient, master weight and both
  moments and writes weight and moments (28); the copy reads the fp32 weight and writes the bf16
  one (6); the zeroing writes the fp32 gradient (4). Gradient clipping's scaling pass runs only
  when the norm exceeds the threshold (data-dependent) and is not priced. Without the distributed
  optimizer (Megatron-LM's default) every rank steps all of its parameters.
- With Megatron-core's distributed optimizer (``distributed_optimizer=True``; the paper's testbed
  ran NeMo's ``mcore_distributed_optim``) over a data x context group of ``g`` ranks: the
  gradient sync is a reduce-scatter of the fp32 gradient buffer (each rank keeps the reduced
  ``1/g`` it owns), the norm, Adam and the copy into the bf16 weights run on that shard (``1/g``
  of their bytes), the zeroing on the whole buffer, and an all-gather of the updated bf16
  parameters (2 bytes each) over the group follows the step (``DistributedOptimizer``'s param
  all-gather). With ``g = 1`` it is the plain optimizer. The grad buffer's buckets
  (``grad_allreduce_chunk_size_mb``) split a collective into a few; their latencies are not priced.
- Parameters per GPU: a decoder layer's projections and MLP (``1/tp`` each), its norms whole; the
  first pipeline rank holds the word embedding (``1/tp``), the last the final norm and the output
  layer (``1/tp``; with tied embeddings a copy of the embedding when the pipeline has more than
  one rank). Biases: none (Llama, Qwen3).
- Placement (Megatron-LM's rank order tensor, context, data, pipeline): the data x context group of
  a stage is ``tp x cp x dp`` consecutive ranks, inside a node when they fit in one; the embedding
  group joins rank ``r`` of the first stage with rank ``r`` of the last, across nodes where their
  ranks' nodes differ (``pipeline_sends``'s rule). Inside a node a collective runs NCCL on its
  default channels (the simulator's ``nccl`` curve); across nodes a ring all-reduce's bus bytes go
  at the GPU's share of the node network (line rate, as the stage sends), costing the blocking
  power while it runs.
- The step runs at the maximum clock (no method scales the optimizer's clock). Ranks wait for each
  other at the grad-norm all-reduce: the tail lasts the slowest rank's sync, the norm's latency,
  then the slowest rank's step; a rank idles the rest of it at the blocking power.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kareus_fx.compose.iteration import IterationFrontier, IterationPoint
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.errors import OptionsError
from kareus_fx.frameworks.pipeline_sends import network_share_bytes_per_s, node_of
from kareus_fx.models.configs import ModelConfig
from kareus_fx.workload import CollectiveKind, CollectiveSpec, OpCost

__all__ = [
    "GRAD_BYTES_PER_PARAM",
    "PARAM_BYTES",
    "STEP_PASSES_BYTES_PER_PARAM",
    "StepTail",
    "collective_cost",
    "rank_parameters",
    "stage_parameters",
    "step_tail",
    "with_step_tail",
]

GRAD_BYTES_PER_PARAM = 4
"""fp32 gradients (``accumulate_allreduce_grads_in_fp32``)."""
PARAM_BYTES = 2
"""bf16 model weights (the distributed optimizer's parameter all-gather)."""
STEP_PASSES_BYTES_PER_PARAM: Mapping[str, int] = {
    "grad_norm": 4,
    "adam": 28,
    "copy_to_model_weights": 6,
    "zero_grad_buffer": 4,
}
"""HBM bytes per parameter of each memory-bound pass of the step (module docstring)."""


@dataclass(frozen=True)
class StepTail:
    """The per-iteration work after the last microbatch, priced on the simulated GPU."""

    time_s: float
    energy_j: float
    """Over one GPU per pipeline rank (as :class:`~kareus_fx.compose.iteration.IterationPoint`'s
    ``energy_j``; the plan scales it by ``tp x cp x dp``)."""
    parts_s: Mapping[str, float]
    """The slowest rank's seconds per part: ``grad_sync``, ``embedding_grad_sync``,
    ``grad_norm_reduce``, ``optimizer`` (with the distributed optimizer's parameter all-gather)."""
    parameters_per_gpu: tuple[float, ...]
    """Parameters each pipeline rank's GPU steps."""


def _layer_parameters(cfg: ModelConfig, tp: int) -> float:
    h, hd = cfg.hidden_size, cfg.head_dim
    attention = h * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, o and k, v
    mlp = 3 * h * cfg.ffn_size  # gate, up, down
    norms = 2 * h + (2 * hd if cfg.qk_norm else 0)
    return (attention + mlp) / tp + norms


def stage_parameters(cfg: ModelConfig, stage_layers: Sequence[int], tp: int) -> tuple[float, ...]:
    """Parameters on one GPU of each global stage of ``stage_layers``: its decoder layers, the word
    embedding on the first, the output layer and final norm on the last."""
    params = [layers * _layer_parameters(cfg, tp) for layers in stage_layers]
    embedding = cfg.vocab_size * cfg.hidden_size / tp
    params[0] += embedding
    if len(params) > 1 or not cfg.tie_embeddings:
        params[-1] += embedding  # the output layer (with tied embeddings: Megatron-LM's copy on the last stage)
    params[-1] += cfg.hidden_size  # final norm
    return tuple(params)


def rank_parameters(cfg: ModelConfig, stage_layers: Sequence[int], tp: int, ranks: int) -> tuple[float, ...]:
    """Parameters on one GPU of each pipeline rank; global stage ``s`` (of ``stage_layers``) runs
    on rank ``s mod ranks`` (interleaved 1F1B's placement; one stage per rank without it)."""
    if len(stage_layers) % ranks:
        raise OptionsError(f"{len(stage_layers)} stages do not spread evenly over {ranks} pipeline ranks")
    params = [0.0] * ranks
    for s, n in enumerate(stage_parameters(cfg, stage_layers, tp)):
        params[s % ranks] += n
    return tuple(params)


_RING_PASSES: Mapping[CollectiveKind, float] = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}
"""Ring passes over the ``(g - 1) / g`` share of the buffer: an all-reduce is a reduce-scatter then
an all-gather."""


def collective_cost(
    simulator: Simulator, nbytes: float, group: int, spans_nodes: bool, kind: CollectiveKind = "all_reduce"
) -> tuple[float, float]:
    """Seconds and joules (one GPU) of a ``kind`` collective of a ``nbytes`` buffer (an all-gather's
    output) over ``group`` ranks."""
    if group <= 1 or nbytes <= 0.0:
        return 0.0, 0.0
    spec, params = simulator.spec, simulator.params
    if spans_nodes:
        bus_bytes = _RING_PASSES[kind] * (group - 1) / group * nbytes
        time_s = params.comm_latency_s + bus_bytes / network_share_bytes_per_s(spec)
        return time_s, time_s * spec.blocking_power_w
    collective = CollectiveSpec(kind=kind, bytes=nbytes, group_size=group)
    m = simulator.predict_sequence((), (collective,), clock_mhz=spec.clock_max_mhz, comm_library="nccl").measurement
    return m.time_s, m.energy_j


def step_tail(
    simulator: Simulator,
    cfg: ModelConfig,
    stage_layers: Sequence[int],
    *,
    tp: int,
    cp: int,
    dp: int,
    pp: int,
    distributed_optimizer: bool = False,
) -> StepTail:
    """Time and energy of the work after the last microbatch (module docstring) on ``simulator``'s
    GPU, for ``cfg`` split into ``stage_layers`` over ``pp`` pipeline ranks of ``tp x cp`` GPUs,
    ``dp`` replicas; ``distributed_optimizer``: Megatron-core's, sharded over the ``cp x dp`` group."""
    spec = simulator.spec
    params = rank_parameters(cfg, stage_layers, tp, pp)
    per_rank = tp * cp * dp  # GPUs of a pipeline rank, in every replica
    sync_spans = per_rank > (spec.gpus_per_node or per_rank)
    tied = cfg.tie_embeddings and pp > 1
    embedding_spans = tied and node_of(0, spec) != node_of((pp - 1) * per_rank, spec)
    embedding_bytes = cfg.vocab_size * cfg.hidden_size / tp * GRAD_BYTES_PER_PARAM
    embedding = collective_cost(simulator, embedding_bytes, 2, embedding_spans) if tied else (0.0, 0.0)
    norm_s = simulator.params.comm_latency_s if pp * tp > 1 else 0.0
    group = cp * dp
    shards = group if distributed_optimizer else 1
    grad_kind: CollectiveKind = "reduce_scatter" if shards > 1 else "all_reduce"
    grad = [collective_cost(simulator, n * GRAD_BYTES_PER_PARAM, group, sync_spans, grad_kind) for n in params]
    sync = [(t, e) if r not in (0, pp - 1) else (t + embedding[0], e + embedding[1]) for r, (t, e) in enumerate(grad)]
    step: list[tuple[float, float]] = []
    for n in params:
        ops = [
            OpCost(name, "optimizer", 0.0, b * n / (1 if name == "zero_grad_buffer" else shards), bound="memory")
            for name, b in STEP_PASSES_BYTES_PER_PARAM.items()
        ]
        m = simulator.predict_sequence(ops, (), clock_mhz=spec.clock_max_mhz).measurement
        gather = (
            collective_cost(simulator, n * PARAM_BYTES, group, sync_spans, "all_gather") if shards > 1 else (0.0, 0.0)
        )
        step.append((m.time_s + gather[0], m.energy_j + gather[1]))
    step_s = max(t for t, _ in step)
    time_s = max(t for t, _ in sync) + norm_s + step_s
    # every rank: its own sync and step, idle at the blocking power for the rest of the tail
    energy_j = sum(se + oe + (time_s - st - ot) * spec.blocking_power_w for (st, se), (ot, oe) in zip(sync, step))
    parts = {
        "grad_sync": max(t for t, _ in grad),
        "embedding_grad_sync": embedding[0],
        "grad_norm_reduce": norm_s,
        "optimizer": step_s,
    }
    return StepTail(time_s=time_s, energy_j=energy_j, parts_s=parts, parameters_per_gpu=params)


def with_step_tail(frontier: IterationFrontier, tail: StepTail) -> IterationFrontier:
    """``frontier`` with every plan's time and energy lengthened by ``tail`` (the same for every
    plan: the step does not depend on the microbatches' schedule). The solver's own numbers
    (``solver_time_s``, ``solver_energy_j``) stay the pipeline's."""

    def longer(points: tuple[IterationPoint, ...]) -> tuple[IterationPoint, ...]:
        return tuple(
            dataclasses.replace(p, time_s=p.time_s + tail.time_s, energy_j=p.energy_j + tail.energy_j) for p in points
        )

    return dataclasses.replace(frontier, points=longer(frontier.points), trace=longer(frontier.trace))
