"""Recorded ops of a graph dump made runnable again: the overload a record names and random
inputs of its recorded shapes. Shared by the on-device profiler's per-op replay
(:mod:`kareus_fx.runtime.kernel_rebuild`) and its fused replay (:mod:`kareus_fx.runtime.fused_replay`).

Random inputs: floating tensors standard normal, booleans fair coins, integers 0 or 1 (valid
indices for any non-empty dimension; the op's cost does not depend on their values).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["NodeTable", "random_tensor", "resolve_overload"]

NodeTable = Mapping[str, Mapping[str, Any]]
"""One dumped graph's node records by node name (``kareus_fx.capture.dump.node_record``)."""


def random_tensor(shape: Iterable[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on ``device`` with random values (module docstring)."""
    size = tuple(shape)
    if dtype.is_floating_point:
        return torch.randn(size, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.rand(size, device=device) < 0.5
    return torch.randint(0, 2, size, dtype=dtype, device=device)


def resolve_overload(target: str) -> Any:
    """The op overload a record's ``op`` names (``namespace.name.overload``), registering the
    ``kareus`` ops first where it is one of them."""
    namespace, name, overload = target.split(".")
    if namespace == "kareus":
        import kareus_fx.models.attention_op  # noqa: F401 - registers torch.ops.kareus

    return getattr(getattr(getattr(torch.ops, namespace), name), overload)
