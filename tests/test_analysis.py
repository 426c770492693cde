"""Node labels of passes/analysis.py on aten graphs traced with fake tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from kareus_fx.capture.tracing import fake_process_group
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.passes.analysis import META_KEY, analyse_graph


def _trace(fn, *shapes, dtype=torch.float32):
    inputs = [torch.empty(s, dtype=dtype, device="meta") for s in shapes]
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _by_target(gm, target):
    return [n for n in gm.graph.nodes if n.target == target]


def test_matmul_flops_and_bytes_from_metadata():
    gm = _trace(lambda a, b: a @ b, (64, 32), (32, 16))
    costs = analyse_graph(gm, gpu_spec())
    (mm,) = _by_target(gm, torch.ops.aten.mm.default)
    assert costs[mm].kind == "compute"
    assert costs[mm].flops == 2 * 64 * 32 * 16
    assert costs[mm].bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert mm.meta[META_KEY] is costs[mm]


def test_bound_label_depends_on_the_gpu_ridge_point():
    # Square fp32 matmul of side n has intensity n/6 = 256 FLOP/B: above A100-40GB's ridge
    # (312e12 / 1555e9 = 200.6) and below H100's (989.4e12 / 3350e9 = 295.3).
    n = 1536
    gm = _trace(lambda a, b: a @ b, (n, n), (n, n))
    (mm,) = _by_target(gm, torch.ops.aten.mm.default)
    assert analyse_graph(gm, gpu_spec("A100-SXM4-40GB"))[mm].bound == "compute"
    assert analyse_graph(gm, gpu_spec("H100-SXM5-80GB"))[mm].bound == "memory"


def test_elementwise_is_memory_bound_and_views_are_free():
    gm = _trace(lambda x: torch.relu(x.view(-1, 8).t()) + 1, (16, 8))
    costs = analyse_graph(gm, gpu_spec())
    kinds = {n.target: costs[n].kind for n in gm.graph.nodes if n.op == "call_function"}
    assert kinds[torch.ops.aten.view.default] == "other"
    assert kinds[torch.ops.aten.t.default] == "other"
    (relu,) = _by_target(gm, torch.ops.aten.relu.default)
    assert costs[relu].bound == "memory"
    assert costs[relu].flops == 16 * 8
    assert costs[relu].bytes == 2 * 16 * 8 * 4


def test_collectives_and_waits_with_bytes_and_group_size():
    def step(x):
        reduced = funcol.all_reduce(x, "sum", dist.group.WORLD)
        gathered = funcol.all_gather_single(reduced, 0, dist.group.WORLD)
        return funcol.reduce_scatter_single(gathered, "sum", 0, dist.group.WORLD)

    with fake_process_group(world_size=4):
        gm = _trace(step, (8, 128), dtype=torch.bfloat16)
        costs = analyse_graph(gm, gpu_spec())
    c10d = torch.ops._c10d_functional
    (ar,) = _by_target(gm, c10d.all_reduce.default)
    (ag,) = _by_target(gm, c10d.all_gather_into_tensor.default)
    (rs,) = _by_target(gm, c10d.reduce_scatter_tensor.default)
    message_bytes = 8 * 128 * 2
    assert (costs[ar].collective.kind, costs[ar].collective.bytes, costs[ar].collective.group_size) == (
        "all_reduce",
        message_bytes,
        4,
    )
    assert (costs[ag].collective.kind, costs[ag].collective.bytes, costs[ag].collective.group_size) == (
        "all_gather",
        4 * message_bytes,
        4,
    )
    assert (costs[rs].collective.kind, costs[rs].collective.bytes) == ("reduce_scatter", 4 * message_bytes)
    waits = _by_target(gm, c10d.wait_tensor.default)
    assert len(waits) == 3 and all(costs[w].kind == "wait" for w in waits)


def test_unknown_gpu_is_rejected_with_the_known_names():
    from kareus_fx.errors import UnknownGPUError

    with pytest.raises(UnknownGPUError, match=r"unknown GPU 'V100'.*A100-SXM4-40GB"):
        gpu_spec("V100")
