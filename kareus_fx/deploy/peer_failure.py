"""A deployed step whose collective fails because a peer rank died or hangs: fail fast and clearly.

When a rank dies mid-step (SIGKILL, OOM killer, a crashed node) its peers' collectives fail: at
once when its connections close (gloo: "Connection closed by peer"; NCCL: an aborted
communicator), otherwise when the process-group timeout runs out (the SM-limited communicators get
the deployment's timeout: :mod:`kareus_fx.runtime.collectives`). The deployment's dispatcher turns
that backend error into :class:`PeerFailureError`, which names this rank, the running instruction,
the collective (the partition whose collective was last launched or awaited, its collective
nodes, SM count and group ranks; for a graph without scheduled partitions, the graph) and the
timeout, after restoring this rank's clock (the deployment's controller and the running
:class:`~kareus_fx.runtime.step_context.StepContext`'s), so no survivor keeps a lowered clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.fx

from kareus_fx.compose.pipeline_schedule import PipelineNode
from kareus_fx.deploy.hook_ops import RUNTIME, ClockBinding
from kareus_fx.errors import KareusError
from kareus_fx.passes.stream_schedule import ScheduledPartition
from kareus_fx.runtime.collectives import comm_timeout_s
from kareus_fx.runtime.step_context import active_step_context

_BACKEND_FAILURE_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "timed out")


class PeerFailureError(KareusError, RuntimeError):
    """A collective of a deployed step failed: a peer rank died or did not answer in time."""


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a communication backend's failure (not a bug in the step)."""
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _BACKEND_FAILURE_MARKERS)


def peer_failure(
    err: BaseException,
    node: PipelineNode,
    graph_name: str,
    gm: torch.fx.GraphModule,
    partitions: Sequence[ScheduledPartition],
    clock: ClockBinding | None,
) -> PeerFailureError:
    """Restore this rank's clock and describe the failure of ``node``'s ``graph_name`` graph."""
    restored = _restore_clocks(clock)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    scheduled = {p.partition_id: p for p in partitions}
    partition = scheduled.get(RUNTIME.collective or "")
    if partition is not None:
        ranks = _group_ranks(gm, partition.collectives)
        over = f" over ranks {ranks}" if ranks else ""
        what = (
            f"collective {', '.join(partition.collectives)} of partition {partition.partition_id} "
            f"(type {partition.type_id}, {partition.comm_sms} SMs){over}"
        )
    else:
        where = "un-split" if not partitions else "outside its scheduled partitions"
        what = f"a collective of the {graph_name} graph ({where})"
    cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return PeerFailureError(
        f"rank {rank}: {what} failed while running {node}: a peer rank died or did not answer within the "
        f"{comm_timeout_s():.0f} s process-group timeout ({cause}). "
        f"{'This rank restored its GPU clock. ' if restored else ''}"
        "Check the peers' logs, then restart the job (the profile database and plan are kept)"
    )


def _restore_clocks(clock: ClockBinding | None) -> bool:
    controllers = [clock.controller] if clock is not None else []
    context = active_step_context()
    if context is not None and context.controller is not None:
        controllers.append(context.controller)
    for controller in controllers:
        controller.restore()
    return bool(controllers)


def _group_ranks(gm: torch.fx.GraphModule, collective_names: Sequence[str]) -> list[int] | None:
    """The global ranks of the first named collective's group, when it can be resolved."""
    from torch._C._distributed_c10d import _resolve_process_group
    from torch.distributed.distributed_c10d import GroupName

    nodes = {n.name: n for n in gm.graph.nodes}
    for name in collective_names:
        node = nodes.get(name)
        if node is not None and node.args and isinstance(node.args[-1], str):
            try:
                return dist.get_process_group_ranks(_resolve_process_group(GroupName(node.args[-1])))
            except (ValueError, RuntimeError, KeyError):
                return None
    return None
