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
  replicated across the tensor-parallel group (no sequence parallelism in the reference models)
  and holds the rank's ``seq / cp`` tokens.
- Megatron-LM's scatter-gather of that tensor: each of the ``tp`` ranks sends ``1/tp`` of it, and the
  receiving stage all-gathers it over NVLink (a ring: ``(tp - 1)/tp`` of the bytes at the GPU's
  NVLink bandwidth).
- Rank order tensor, context, pipeline (one data-parallel replica, as planned): stage ``s`` holds
  ranks ``s * tp * cp`` onward, on node ``rank // gpus_per_node``. A boundary between two nodes
  runs over the node network, each GPU at its share (``node_network_bytes_per_s / gpus_per_node``,
  line rate; e.g. AWS p4d: 400 Gbps over 8 A100s, 6.25 GB/s each); within a node over NVLink.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kareus_fx.compose.pipeline import Instruction
from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.errors import OptionsError

__all__ = ["boundary_bytes", "link_wait_s", "stage_transfer_s"]


def boundary_bytes(dump: Mapping[str, Any]) -> float:
    """Bytes of the tensor a stage sends on: the first output of the (loaded) dump's forward graph."""
    graphs = {g["name"]: g for g in dump["graphs"]}
    nodes = {n["name"]: n for n in graphs["forward"]["nodes"]}
    (output,) = [n for n in nodes.values() if n["fx_op"] == "output"]
    sent = nodes[output["inputs"][0]]
    return float(math.prod(int(size) for size in sent["shape"]) * getattr(torch, sent["dtype"]).itemsize)


def _node_of(rank: int, spec: GPUSpec) -> int:
    if spec.gpus_per_node is None:
        raise OptionsError(
            f"no node network is known for the {spec.name} (gpus_per_node): a pipeline across "
            f"nodes cannot price its send/recv; plan for a GPU with a node entry in gpu_specs"
        )
    return rank // spec.gpus_per_node


def link_wait_s(sent_bytes: float, tp: int, cp: int, sender: int, spec: GPUSpec) -> float:
    """Seconds from stage ``sender``'s send to the activation being whole on the next stage."""
    group = tp * cp
    across_nodes = _node_of(sender * group, spec) != _node_of((sender + 1) * group, spec)
    per_gpu_bytes_per_s = spec.nvlink_bandwidth_bytes_per_s
    if across_nodes:
        if spec.node_network_bytes_per_s is None or spec.gpus_per_node is None:
            raise OptionsError(
                f"no node network bandwidth is known for the {spec.name} (node_network_bytes_per_s): a pipeline "
                f"across nodes cannot price its send/recv; plan for a GPU with a node entry in gpu_specs"
            )
        per_gpu_bytes_per_s = spec.node_network_bytes_per_s / spec.gpus_per_node
    send_s = sent_bytes / tp / per_gpu_bytes_per_s
    gather_s = sent_bytes * (tp - 1) / tp / spec.nvlink_bandwidth_bytes_per_s
    return send_s + gather_s


def stage_transfer_s(
    sent_bytes: Sequence[float], tp: int, cp: int, spec: GPUSpec
) -> dict[tuple[int, Instruction], float]:
    """Per (stage, instruction), the blocking send it ends with: a forward sends its activation
    to the next stage, a backward the activation's gradient to the previous one (``sent_bytes[s]``:
    the boundary tensor stage ``s`` sends on; the last stage's is unused). Zero where nothing is sent."""
    stages = len(sent_bytes)
    waits: dict[tuple[int, Instruction], float] = {(s, "forward"): 0.0 for s in range(stages)}
    waits |= {(s, "backward"): 0.0 for s in range(stages)}
    for s in range(stages - 1):
        wait_s = link_wait_s(sent_bytes[s], tp, cp, s, spec)
        waits[(s, "forward")] = wait_s
        waits[(s + 1, "backward")] = wait_s
    return waits
