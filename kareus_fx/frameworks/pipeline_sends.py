"""The pipeline's send/recv between stages: what moving an activation (or its gradient) costs.

In Megatron-LM's 1F1B, after the forward of a microbatch stage ``s`` sends its output activation
to stage ``s + 1``, and after the backward stage ``s + 1`` sends the gradient of that activation
(the same shape) back to ``s``. The steady-state sends are blocking (``send_forward_recv_backward``
waits for its transfer): the sender's next instruction starts after the transfer, and the receiver
cannot start before it. So each transfer lengthens the sending instruction by its time, on every
method alike, and costs the communication-blocking power while it runs (the GPU's SMs wait on the
link; the same power the iteration composer charges for every other wait).

Assumptions (each a stated physical fact, none fitted):

- The boundary tensor is the first output of the stage's traced forward graph (its hidden states;
  the other outputs are saved activations), at the traced rank's shape and dtype. It is
  replicated across the tensor-parallel group (no sequence parallelism in the reference models,
  nor on the paper's testbed: ``sequence_parallel: false`` in its NeMo configs,
  ml-energy/kareus ``tests/artifact/conf/megatron_*_config.yaml``) and holds the rank's
  ``seq / cp`` tokens.
- Megatron-core's send/recv (the testbed ran NeMo with ``mcore_gpt: true``): every one of the ``tp``
  ranks sends the whole tensor to its peer in the next stage (``get_tensor_shapes`` divides the
  sequence by ``tp`` only under sequence parallelism). Megatron-LM's older scatter-gather (each
  rank sending ``1/tp`` and the receiver all-gathering over NVLink) is not in Megatron-core.
- Rank order tensor, context, pipeline (one data-parallel replica, as planned): stage ``s`` holds
  ranks ``s * tp * cp`` onward, on node ``rank // gpus_per_node``. A boundary between two nodes
  runs over the node network, each GPU at its share (``node_network_bytes_per_s / gpus_per_node``,
  line rate; e.g. AWS p4d: 400 Gbps over 8 A100s, 6.25 GB/s each); within a node over NVLink.
- Under expert parallelism over data-parallel replicas (``ep > tp``), a stage's expert-parallel
  group is the TP x CP grids of ``ep / tp`` replicas placed next to each other (Megatron-LM's
  order tensor, context, expert-data, pipeline), so stage ``s`` holds ranks ``s * tp * cp * ep / tp``
  onward: its ``stage_replicas``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kareus_fx.compose.pipeline_schedule import Instruction
from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.errors import OptionsError

__all__ = ["boundary_bytes", "link_wait_s", "network_share_bytes_per_s", "node_of", "stage_transfer_s"]


def boundary_bytes(dump: Mapping[str, Any]) -> float:
    """Bytes of the tensor a stage sends on: the first output of the (loaded) dump's forward graph."""
    graphs = {g["name"]: g for g in dump["graphs"]}
    nodes = {n["name"]: n for n in graphs["forward"]["nodes"]}
    (output,) = [n for n in nodes.values() if n["fx_op"] == "output"]
    sent = nodes[output["inputs"][0]]
    return float(math.prod(int(size) for size in sent["shape"]) * getattr(torch, sent["dtype"]).itemsize)


def node_of(rank: int, spec: GPUSpec) -> int:
    """The node that global rank ``rank`` runs on (ranks fill nodes in order)."""
    if spec.gpus_per_node is None:
        raise OptionsError(
            f"no node network is known for the {spec.name} (gpus_per_node): work across nodes "
            f"(a pipeline's send/recv, a gradient sync) cannot be placed; plan for a GPU with a node entry in gpu_specs"
        )
    return rank // spec.gpus_per_node


def network_share_bytes_per_s(spec: GPUSpec) -> float:
    """One GPU's share of its node's network (all of a node's GPUs send at once)."""
    share = spec.node_network_share_bytes_per_s
    if share is None:
        raise OptionsError(
            f"no node network bandwidth is known for the {spec.name} (node_network_bytes_per_s): traffic across "
            f"nodes (a pipeline's send/recv, a gradient sync) cannot be priced; plan for a GPU with a node entry "
            f"in gpu_specs"
        )
    return share


def link_wait_s(
    sent_bytes: float,
    tp: int,
    cp: int,
    sender: int,
    spec: GPUSpec,
    receiver: int | None = None,
    stage_replicas: int = 1,
) -> float:
    """Seconds from pipeline rank ``sender``'s send to the activation being whole on pipeline rank
    ``receiver`` (default ``sender + 1``; interleaved 1F1B's last rank sends on to rank 0).
    ``stage_replicas``: the data-parallel replicas whose ranks of one stage sit together."""
    group = tp * cp * stage_replicas
    receiver = sender + 1 if receiver is None else receiver
    across_nodes = node_of(sender * group, spec) != node_of(receiver * group, spec)
    per_gpu_bytes_per_s = network_share_bytes_per_s(spec) if across_nodes else spec.nvlink_bandwidth_bytes_per_s
    return sent_bytes / per_gpu_bytes_per_s


def stage_transfer_s(
    sent_bytes: Sequence[float],
    tp: int,
    cp: int,
    spec: GPUSpec,
    ranks: int | None = None,
    stage_replicas: int = 1,
) -> dict[tuple[int, Instruction], float]:
    """Per (stage, instruction), the blocking send it ends with: a forward sends its activation
    to the next stage, a backward the activation's gradient to the previous one (``sent_bytes[s]``:
    the boundary tensor stage ``s`` sends on; the last stage's is unused). Zero where nothing is sent.

    ``ranks``: the pipeline's GPUs (default: one per stage); with fewer, global stage ``s`` runs on
    rank ``s mod ranks`` (interleaved 1F1B's looping placement). ``stage_replicas``: see :func:`link_wait_s`."""
    stages = len(sent_bytes)
    ranks = stages if ranks is None else ranks
    waits: dict[tuple[int, Instruction], float] = {(s, "forward"): 0.0 for s in range(stages)}
    waits |= {(s, "backward"): 0.0 for s in range(stages)}
    for s in range(stages - 1):
        wait_s = link_wait_s(sent_bytes[s], tp, cp, s % ranks, spec, (s + 1) % ranks, stage_replicas)
        waits[(s, "forward")] = wait_s
        waits[(s + 1, "backward")] = wait_s
    return waits
