"""Collectives (functional ``_c10d_functional`` ops) and DTensor entry, exit and redistribution.

An all-reduce, a broadcast or a wait is elementwise over the batch (each rank holds the same batch
elements). An all-gather along the batch dim stacks the group's copies: the batch becomes the
``p`` outer copies times the elements; a reduce-scatter along it must split exactly those copies,
never the batch itself. An all-to-all along the batch dim would exchange batch elements between
ranks and is refused. Inside an ``autograd.Function`` backward a sum or average all-reduce of a
part of a batch sum is the part of the all-reduced sum.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

from kareus_fx.passes.batch_dims.node_args import _arg, _norm_dim
from kareus_fx.passes.batch_dims.op_names import name_target
from kareus_fx.passes.batch_dims.propagation import (
    BatchAnalysis,
    _int_arg,
    _node_arg,
    passes_partial,
    register_batch_rule,
    register_partial_rule,
)
from kareus_fx.passes.batch_dims.values import PARTIAL, BatchDim, Call, Step

try:
    from torch.distributed.tensor import DTensor as _DTensor

    name_target(_DTensor.from_local, "dtensor.from_local")
    name_target(torch.distributed.tensor._api.from_local, "dtensor.from_local")
except (ImportError, AttributeError):  # pragma: no cover - torch built without distributed
    pass


@register_batch_rule("c10d.all_reduce", "c10d.wait_tensor", "c10d.broadcast")
def _rule_collective_pointwise(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    return Step(an.info(node.args[0]), True)


@register_batch_rule("c10d.all_gather_into_tensor")
def _rule_all_gather(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, group_size = node.args[0], _int_arg(an, node, 1)
    i = an.info(x)
    if i.dim != 0:
        return Step(i, True)
    if i.order is not None:
        raise an._fail(node, "gathers routed rows across ranks")
    return Step(BatchDim(0, i.k, i.p * group_size), True)


@register_batch_rule("c10d.reduce_scatter_tensor")
def _rule_reduce_scatter(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    x, group_size = node.args[0], _int_arg(an, node, 2)
    i = an.info(x)
    if i.dim != 0:
        return Step(i, True)
    if i.p % group_size == 0 and i.order is None:
        return Step(BatchDim(0, i.k, i.p // group_size), True)
    raise an._fail(node, "scatters the batch dim across ranks")


@register_batch_rule("c10d.all_to_all_single")
def _rule_all_to_all(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """An all-to-all with equal splits of a dim laid out ``(p, B, k)``, ``p`` a multiple of the
    group size: the chunk for each rank is whole ``(B, k)`` blocks, so nanobatch ``h`` of every
    rank (all ranks split alike) sends its own rows of each block and receives the other ranks'
    rows of nanobatch ``h``, laid out ``(p, B, k)`` again (expert-parallel dispatch and combine
    of padded, fixed-size buffers). Equal split sizes given as lists (funcol's autograd variant
    writes them out) are rewritten per nanobatch; any other split sizes are refused."""
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    if i.dim != 0:
        return Step(i, True)
    output_splits, input_splits, group_name = node.args[1:4]
    if not isinstance(group_name, str):
        raise an._fail(node, f"group {group_name!r} is not a group name")
    group_size = _resolve_process_group(GroupName(group_name)).size()
    rows = an.shape(x)[0]
    for splits in (output_splits, input_splits):
        if splits is not None and (
            not isinstance(splits, (list, tuple)) or list(splits) != [rows // group_size] * group_size
        ):
            raise an._fail(node, "exchanges slices of the batch dim between ranks by uneven split sizes")
    if i.order is not None or i.p % group_size:
        raise an._fail(node, f"exchanges slices of the batch dim between ranks ({i} over {group_size} ranks)")

    def call(h: int) -> Call:
        equal = [i.size(an.halves[h]) // group_size] * group_size
        return Call(node.op, node.target, (x, equal, equal, group_name, *node.args[4:]), dict(node.kwargs))

    return Step(i, True, call)


register_partial_rule("c10d.wait_tensor")(passes_partial)


@register_partial_rule("c10d.all_reduce")
def _partial_all_reduce(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """A sum (or average) over ranks of parts of a batch sum is the part of the reduced sum."""
    if node.args[1] not in ("sum", "avg"):
        raise an._fail(node, "non-linear all_reduce of a partial batch sum")
    return Step(PARTIAL, True)


@register_batch_rule("dtensor.from_local", "redistribute", "to_local", "full_tensor")
def _rule_dtensor(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """DTensor entry/exit and redistribution (``parallelize_module`` models at the Dynamo level).

    A DTensor's logical and local tensors hold the batch on the same dim as long as no placement
    shards that dim, and a redistribution that keeps it unsharded is elementwise over the batch
    (``Partial -> Replicate`` is an all-reduce, ``Replicate -> Shard(d)`` a local chunk).
    """
    x = _node_arg(an, node, 0)
    i = an.info(x)
    if not isinstance(i, BatchDim):
        raise an._fail(node, "batch enters through a non-data argument")
    if name == "dtensor.from_local":
        if _arg(node, 4, "shape") is not None or _arg(node, 5, "stride") is not None:
            raise an._fail(node, "explicit global shape")
        placements = _arg(node, 2, "placements")
    elif name == "redistribute":
        placements = _arg(node, 2, "placements")
    else:  # to_local, full_tensor
        placements = None
    if placements is not None and not isinstance(placements, (list, tuple)):
        raise an._fail(node, f"placements {placements!r} are not a list")
    nd = len(an.shape(node))
    sharded: list[object] = list(placements or ())
    for v in (an.vals.get(x), an.vals.get(node)):
        sharded += list(getattr(v, "placements", ()) or ())
    for p in sharded:
        d = getattr(p, "dim", None)
        if isinstance(d, int) and _norm_dim(d, nd) == i.dim:
            raise an._fail(node, f"shards the batch dim over the mesh ({p})")
    return Step(i, True)
