"""Tensor / context parallel layout and Megatron-style communication autograd functions.

Every collective goes through ``torch.distributed._functional_collectives`` (funcol), so
Dynamo traces it without a graph break, and ``aot_autograd`` lowers it to
``torch.ops._c10d_functional.{all_reduce, all_gather_into_tensor, reduce_scatter_tensor}``
followed by ``torch.ops._c10d_functional.wait_tensor`` in the forward and the backward graph.
Each function below takes the process group by *name* (a string), which Dynamo treats as a
constant.

=========================  ========================  ==========================
function                   forward                   backward
=========================  ========================  ==========================
:func:`copy_to_tp`         identity                  all_reduce (sum)
:func:`reduce_from_tp`     all_reduce (sum)          identity
:func:`gather_from_tp`     all_gather (new dim 0)    keep this rank's slice
:func:`cp_all_gather`      all_gather along ``dim``  reduce_scatter along ``dim``
:func:`scatter_to_tp`      keep this rank's slice    all_gather along ``dim``
:func:`gather_along_tp`    all_gather along ``dim``  keep this rank's slice
=========================  ========================  ==========================

A group of size 1 (``name is None``) makes every function the identity, with no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from kareus_fx.errors import ParallelConfigError

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in a TP x CP (x EP replicas) (x PP) grid; ranks are laid out TP-fastest,
    then CP, then the expert-parallel group's data-parallel replicas, then PP.

    Global rank ``r`` has ``tp_rank = r % tp``, ``cp_rank = (r // tp) % cp`` and
    ``pp_rank = r // (tp * cp * ep_replicas)`` (the pipeline stage it runs, as Megatron-LM orders
    tp-cp-dp-pp): the TP group of a rank is ``tp`` consecutive ranks (one node's NVLink domain in
    practice); its CP group is strided by ``tp``; each stage has its own groups.

    Expert parallelism: the EP group is ``ep`` consecutive ranks, ``ep // tp`` data-parallel
    replicas' TP groups (with ``ep == tp`` it is the TP group; ``ep == 1``: no group), placed
    node-contiguously as the ranks are. The layout holds exactly the ``ep_replicas`` replicas one
    EP group needs; EP is not combined with CP. A size-1 dimension has no group (``None``) and issues
    no collective. Pipeline stages exchange activations point to point; they form no group here.
    """

    tp: int = 1
    cp: int = 1
    tp_rank: int = 0
    cp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None

    @property
    def ep_replicas(self) -> int:
        """Data-parallel replicas (of the TP x CP grid) that one EP group spans."""
        return max(1, self.ep // self.tp)

    @property
    def world_size(self) -> int:
        """Ranks of one pipeline stage: its TP x CP grid times the EP group's replicas."""
        return self.tp * self.cp * self.ep_replicas

    @property
    def tp_group_name(self) -> GroupName | None:
        return None if self.tp_group is None else self.tp_group.group_name

    @property
    def cp_group_name(self) -> GroupName | None:
        return None if self.cp_group is None else self.cp_group.group_name

    @property
    def ep_group_name(self) -> GroupName | None:
        return None if self.ep_group is None else self.ep_group.group_name

    @classmethod
    def from_default_group(cls, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1) -> ParallelLayout:
        """Split the default process group into TP, CP and EP groups (per pipeline stage).

        Collective over the default group when it has more than one rank (every rank must call
        it, in the same order as any other ``new_group``). ``tp = cp = pp = ep = 1`` needs no
        ``torch.distributed`` initialisation.
        """
        if tp < 1 or cp < 1 or pp < 1 or ep < 1:
            raise ParallelConfigError(f"tp, cp, pp and ep must be >= 1, got tp={tp}, cp={cp}, pp={pp}, ep={ep}")
        if ep > 1 and (ep % tp or cp > 1):
            raise ParallelConfigError(f"ep={ep} needs a multiple of tp={tp} (whole TP groups) and cp=1 (got cp={cp})")
        replicas = max(1, ep // tp)
        world_needed = tp * cp * replicas * pp
        if not dist.is_available() or not dist.is_initialized():
            if world_needed == 1:
                return cls()
            raise ParallelConfigError(
                f"tp={tp} x cp={cp} x ep replicas={replicas} x pp={pp} needs {world_needed} processes but "
                "torch.distributed is not initialised; call torch.distributed.init_process_group first "
                "(or use tp=cp=pp=ep=1)"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != world_needed:
            factors = f"tp*cp*pp = {tp}*{cp}*{pp}" if ep == 1 else f"tp*cp*pp*(ep/tp) = {tp}*{cp}*{pp}*{replicas}"
            raise ParallelConfigError(
                f"world size {world} != {factors} = {world_needed}; "
                f"launch {world_needed} processes or choose degrees that multiply to {world}"
            )
        stage_size = tp * cp * replicas

        def per_stage(groups: list[list[int]]) -> list[list[int]]:
            return [[s * stage_size + r for r in ranks] for s in range(pp) for ranks in groups]

        grid = tp * cp  # ranks of one replica
        return cls(
            tp=tp,
            cp=cp,
            tp_rank=rank % tp,
            cp_rank=(rank // tp) % cp,
            tp_group=_subgroup(
                rank,
                per_stage([[d * grid + c * tp + t for t in range(tp)] for d in range(replicas) for c in range(cp)]),
            ),
            cp_group=_subgroup(
                rank,
                per_stage([[d * grid + c * tp + t for c in range(cp)] for d in range(replicas) for t in range(tp)]),
            ),
            pp=pp,
            pp_rank=rank // stage_size,
            ep=ep,
            ep_rank=rank % stage_size if ep > 1 else 0,
            ep_group=_subgroup(rank, per_stage([list(range(stage_size))])) if ep > 1 else None,
        )


def _subgroup(rank: int, partition: list[list[int]]) -> dist.ProcessGroup | None:
    """This rank's group of ``partition`` (a list of disjoint rank lists covering the world)."""
    if len(partition[0]) == 1:
        return None
    if len(partition) == 1:
        return dist.group.WORLD
    mine = None
    for ranks in partition:  # new_group is collective: every rank creates every group
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _wait(t: torch.Tensor) -> torch.Tensor:
    # Eagerly funcol returns an AsyncCollectiveTensor; traced, it has already emitted wait_tensor.
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _all_reduce(x: torch.Tensor, group: GroupName) -> torch.Tensor:
    return _wait(funcol.all_reduce(x.contiguous(), "sum", group))


def _all_gather(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    return _wait(funcol.all_gather_single(x.contiguous(), dim, group))


def _reduce_scatter(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    return _wait(funcol.reduce_scatter_single(x.contiguous(), "sum", dim, group))


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: GroupName) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: GroupName) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: GroupName, rank: int) -> torch.Tensor:
        ctx.rank = rank
        return _all_gather(x.unsqueeze(0), 0, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank], None, None


def _all_gather_moved(x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
    """All-gather along ``dim`` as an all-gather along dim 0 of ``x`` with ``dim`` moved first, so
    the collective never concatenates along a batch-leading dim 0 (it keeps the batch in place)."""
    return _all_gather(x.movedim(dim, 0), 0, group).movedim(0, dim)


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: GroupName, tp: int, rank: int) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return x.chunk(tp, dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_moved(grad, ctx.dim, ctx.group), None, None, None, None


class _GatherAlongTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: GroupName, tp: int, rank: int) -> torch.Tensor:
        ctx.dim, ctx.tp, ctx.rank = dim, tp, rank
        return _all_gather_moved(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.tp, ctx.dim)[ctx.rank].contiguous(), None, None, None, None


class _CPAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: GroupName) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group: GroupName | None) -> torch.Tensor:
    """Enter a column-parallel region: identity forward, all-reduce of the gradient backward."""
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: GroupName | None) -> torch.Tensor:
    """Leave a row-parallel region: all-reduce (sum) forward, identity backward."""
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: GroupName | None, rank: int) -> torch.Tensor:
    """Stack every TP rank's ``x`` on a new dim 0 for a computation replicated across TP.

    Backward keeps only this rank's slice of the gradient: every TP rank computes the same
    replicated result, so summing the slices' gradients across ranks would count them ``tp`` times.
    """
    return x.unsqueeze(0) if group is None else _GatherFromTP.apply(x, group, rank)


def cp_all_gather(x: torch.Tensor, dim: int, group: GroupName | None) -> torch.Tensor:
    """Concatenate every CP rank's ``x`` along ``dim`` (in CP-rank order).

    Backward reduce-scatters: the gathered tensor feeds different computations on each rank
    (each rank's own queries), so its gradients add up across ranks.
    """
    return x if group is None else _CPAllGather.apply(x, dim, group)


def scatter_to_tp(x: torch.Tensor, dim: int, group: GroupName | None, tp: int, rank: int) -> torch.Tensor:
    """This rank's ``1 / tp`` slice along ``dim`` of ``x``, which is replicated over the TP group
    (no collective forward). Backward all-gathers the slices' gradients: the replicated ``x`` feeds
    every rank's slice, so its gradient on each rank is the whole concatenation."""
    return x if group is None else _ScatterToTP.apply(x, dim, group, tp, rank)


def gather_along_tp(x: torch.Tensor, dim: int, group: GroupName | None, tp: int, rank: int) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along ``dim`` (in TP-rank order) into a replicated tensor.

    Backward keeps this rank's slice of the gradient: the replicated result feeds the same
    computation on every rank, so each rank's gradient of it is already the whole one.
    """
    return x if group is None else _GatherAlongTP.apply(x, dim, group, tp, rank)
