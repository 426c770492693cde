"""How an all-to-all's bytes split between NVLink and the node network.

The all-to-all of an expert-parallel group of ``g`` ranks (``CollectiveSpec.group_size``), each
with a buffer of ``S`` bytes (``CollectiveSpec.bytes``, the share a rank keeps for itself included):

- Placement: ranks fill nodes in order, ``gpus_per_node`` to a node, so the group spans
  ``ceil(g / gpus_per_node)`` nodes; the last one holds the remainder.
- Routing: uniform. Each rank sends ``S / g`` to every rank of the group, itself included, so
  ``(g - 1) / g`` of its buffer leaves the GPU: the share for the other ranks of its node over
  NVLink, the rest over its part of the node's network (``GPUSpec.node_network_share_bytes_per_s``:
  the node's line rate over its GPUs, since every GPU of the node sends at once). A byte for another
  node crosses the network once and no NVLink (a flat all-to-all, as ``all_to_all_single`` runs; no
  forwarding through a peer, no deduplication of a token sent to several experts of one node).
- The two lanes run at once and the slower one sets the time (:meth:`KernelModel.collective_time`):
  ``all_to_all_latency_s + max(NVLink bytes / NVLink lane rate, network bytes / network lane rate)``.
  The slowest rank ends the collective: a rank of a full node has the most NVLink bytes, a rank of
  the partly filled last node the most network bytes; the split takes each lane's worst rank.
- NVLink lane rate: the library's per-SM rate (the curves of the other collectives, with the
  all-to-all's kind factor; MSCCL++'s grows with the peers on the node) times the SMs, capped
  smoothly at ``all_to_all_nvlink_efficiency`` x the spec's NVLink bandwidth. So SMs matter inside a
  node up to the cap, and the SM clock acts on the per-SM rate as for other collectives
  (``comm_clock_exponent``).
- Network lane rate: ``all_to_all_network_efficiency`` x the GPU's network share. Neither the SMs
  nor the SM clock limit it: the NIC's DMA engine moves the bytes, the SMs only post the requests
  (DeepEP's second version reaches about 0.9 of the line rate on 6 and 12 SMs, the first version
  used 24; ``data/calibration/deepep``).
- A spec without a node (``gpus_per_node`` None) holds every group inside one node.

The two efficiencies and the latency are fitted on DeepEP's measurements (calibration step 7,
:mod:`~kareus_fx.cost_models.all_to_all_fit`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.cost_models.sim_params import SimParams, gpu_params
from kareus_fx.workload import CollectiveSpec

ROUTING_ASSUMPTION = (
    "uniform routing over a node-contiguous group: each rank sends 1/g of its buffer to every rank; "
    "on-node shares over NVLink, off-node shares over the GPU's share of the node network; the slower lane sets the time"
)


@dataclass(frozen=True)
class AllToAllSplit:
    """Where the slowest rank's bytes go, as fractions of its buffer."""

    nodes: int
    """Nodes the group spans."""
    ranks_per_node: int
    """Ranks of the group on a full node (the whole group inside one node)."""
    nvlink_fraction: float
    """Share of the buffer a rank of a full node sends over NVLink: ``(ranks_per_node - 1) / g``."""
    network_fraction: float
    """Share of the buffer a rank of the last (least filled) node sends to other nodes."""


def all_to_all_split(spec: GPUSpec, group_size: int) -> AllToAllSplit:
    """The split of a ``group_size``-rank all-to-all on ``spec``'s nodes (module docstring)."""
    g = max(1, group_size)
    per_node = g if spec.gpus_per_node is None else min(g, spec.gpus_per_node)
    nodes = math.ceil(g / per_node)
    last_node = g - (nodes - 1) * per_node
    return AllToAllSplit(nodes, per_node, (per_node - 1) / g, (g - last_node) / g)


def all_to_all_lanes(spec: GPUSpec, collective: CollectiveSpec, params: SimParams | None = None) -> dict[str, Any]:
    """The all-to-all's assumption in numbers, for plan output and tables: nodes spanned, the
    shares of the buffer on each lane, the links' rates and what the lanes reach with enough SMs
    (``params``: default, the GPU's calibrated parameters)."""
    p = gpu_params(spec.name).params if params is None else params
    split = all_to_all_split(spec, collective.group_size)
    share = spec.node_network_share_bytes_per_s
    return {
        "group_size": collective.group_size,
        "nodes": split.nodes,
        "ranks_per_node": split.ranks_per_node,
        "nvlink_fraction": split.nvlink_fraction,
        "off_node_fraction": split.network_fraction,
        "nvlink_bytes_per_s": spec.nvlink_bandwidth_bytes_per_s,
        "nvlink_lane_cap_bytes_per_s": p.all_to_all_nvlink_efficiency * spec.nvlink_bandwidth_bytes_per_s,
        "network_share_bytes_per_s": share,
        "network_lane_bytes_per_s": None if share is None else p.all_to_all_network_efficiency * share,
        "latency_s": p.all_to_all_latency_s,
        "assumption": ROUTING_ASSUMPTION,
    }
