"""passes/kernel_groups.py: aten ops grouped into the kernels Inductor generates, and priced."""

from __future__ import annotations

import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.passes.analysis import META_KEY, analyse_graph
from kareus_fx.passes.kernel_groups import KERNEL_META, count_kernels, group_kernels


def _norm_then_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return torch.nn.functional.silu(normed @ w)


def test_rmsnorm_is_one_kernel_beside_the_extern_matmul():
    x, w = torch.randn(8, 64), torch.randn(64, 32)
    gm = make_fx(_norm_then_matmul, decomposition_table=select_decomp_table())(x, w)
    gpu = gpu_spec()
    analyse_graph(gm, gpu)
    kernels = group_kernels(gm, gpu.ridge_point_flops_per_byte())
    # norm (pow, mean, add, rsqrt, mul) | mm | silu epilogue: Inductor makes 2 generated kernels + 1 extern.
    assert count_kernels(kernels) == {"fused": 2, "extern": 1}
    norm = next(k for k in kernels if any(n.startswith("pow") for n in k.nodes))
    # The fused norm reads x once and writes the normalised x once (fp32).
    assert norm.bytes == 2 * 8 * 64 * 4
    compute = [n for n in gm.graph.nodes if n.meta[META_KEY].kind == "compute"]
    assert all(n.meta[KERNEL_META] is not None for n in compute)
    # Node shares sum to their kernel's bytes.
    for kernel in kernels:
        assert sum(n.meta[META_KEY].bytes for n in compute if n.meta[KERNEL_META] == kernel.kernel_id) == kernel.bytes


def _cast_read_by_two_kernels(r: torch.Tensor, a: torch.Tensor, w: torch.Tensor):
    h = r + a
    x = h.float()  # inlined: read by the norm's reduction and by a product after the matmul
    s = x.pow(2).mean(-1, keepdim=True)
    t = (h @ w).float()
    return h, s, x * t


def test_a_cast_read_by_two_kernels_is_recomputed_not_stored():
    """A bf16 -> fp32 cast that two kernels read is recomputed by each from the bf16 tensor
    (Inductor inlines it), so no kernel writes or reads the fp32 copy."""
    rows, width = 64, 256
    args = (
        torch.randn(rows, width, dtype=torch.bfloat16),
        torch.randn(rows, width, dtype=torch.bfloat16),
        torch.randn(width, width, dtype=torch.bfloat16),
    )
    gm = make_fx(_cast_read_by_two_kernels, decomposition_table=select_decomp_table())(*args)
    gpu = gpu_spec()
    analyse_graph(gm, gpu)
    kernels = group_kernels(gm, gpu.ridge_point_flops_per_byte())
    bf16, fp32 = rows * width * 2, rows * width * 4
    reduction = next(k for k in kernels if any(n.startswith("pow") for n in k.nodes))
    product = next(k for k in kernels if "mul" in k.nodes)
    # reads r and a, writes h (a graph output, read by the matmul) and the mean; not the cast
    assert reduction.bytes == 3 * bf16 + rows * 4
    # reads h (recomputing the cast) and the matmul's bf16 output, writes the fp32 product
    assert product.bytes == bf16 + bf16 + fp32
