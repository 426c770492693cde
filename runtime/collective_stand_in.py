"""The collective's stand-in in a partition replay: an SM-limited reduce.

A replay cannot run the partition's real collective on one GPU, so the collective is replaced by
an SM-limited reduce (``dst += src``, bf16) over the bytes one rank moves in a ring algorithm
(all-reduce ``2 (g-1)/g`` of the buffer, the others ``(g-1)/g``): a Triton kernel with
``comm_sms`` programs when Triton imports, else ``torch.add`` (the SM limit is then not enforced;
a warning says so). It takes SMs and HBM bandwidth like the collective, not its link time.
:mod:`~kareus_fx.runtime.partition_replay` issues it on a side stream.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kareus_fx.runtime.recorded_ops import random_tensor
from kareus_fx.workload import CollectiveSpec

logger = logging.getLogger(__name__)


_BF16_BYTES = 2


@dataclass(frozen=True)
class CollectiveKernel:
    """The SM-limited reduce standing for one collective; ``run(comm_sms)`` issues it."""

    spec: CollectiveSpec
    elements: int
    run: Callable[[int], Any] = field(repr=False)


def collective_traffic_bytes(spec: CollectiveSpec) -> float:
    """Bytes one rank sends in a ring algorithm: all-reduce ``2(g-1)/g`` x buffer, else ``(g-1)/g``."""
    share = (spec.group_size - 1) / spec.group_size
    return spec.bytes * share * (2.0 if spec.kind == "all_reduce" else 1.0)


@functools.lru_cache(maxsize=1)
def _triton_reduce() -> Callable[[torch.Tensor, torch.Tensor, int], None] | None:
    """A reduce ``dst += src`` over ``grid`` Triton programs (one per SM), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # A Triton kernel: its parameters are pointers and constexprs, typed by Triton, not Python (and
    # Triton is not installed where mypy runs: no triton in CPU CI).
    @triton.jit  # type: ignore[untyped-decorator]
    def _reduce(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        start = tl.program_id(0) * BLOCK
        step = tl.num_programs(0) * BLOCK
        for offset in range(start, n, step):
            offsets = offset + tl.arange(0, BLOCK)
            mask = offsets < n
            total = tl.load(dst_ptr + offsets, mask=mask) + tl.load(src_ptr + offsets, mask=mask)
            tl.store(dst_ptr + offsets, total, mask=mask)

    def launch(dst: torch.Tensor, src: torch.Tensor, grid: int) -> None:
        _reduce[(grid,)](dst, src, dst.numel(), BLOCK=2048)

    return launch


def build_collective_kernel(spec: CollectiveSpec, device: torch.device | str) -> CollectiveKernel:
    """The SM-limited reduce standing for ``spec`` (module docstring)."""
    device = torch.device(device)
    elements = max(1, round(collective_traffic_bytes(spec) / _BF16_BYTES))
    dst = torch.zeros(elements, dtype=torch.bfloat16, device=device)
    src = random_tensor((elements,), torch.bfloat16, device)
    triton_reduce = _triton_reduce() if device.type == "cuda" else None
    if triton_reduce is not None:
        return CollectiveKernel(spec, elements, lambda comm_sms: triton_reduce(dst, src, comm_sms))
    if device.type == "cuda":
        logger.warning("Triton does not import: the collective proxy is torch.add; its SM limit is not enforced")
    return CollectiveKernel(spec, elements, lambda comm_sms: dst.add_(src))
