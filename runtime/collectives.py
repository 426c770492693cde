"""One process group per planned communication SM count (paper 3.2.1 and 5.2).

The plan gives each partition type a number of SMs for its collective. A collective's SM use is
the number of CTAs its kernel launches, which NCCL fixes per communicator
(``ncclConfig_t.minCTAs`` / ``maxCTAs``). :class:`CollectiveBackends` therefore keeps, per SM
count, a communicator over the same ranks as the base group:

- NCCL base group (GPU): a new NCCL group created with
  ``torch.distributed.ProcessGroupNCCL.Options()`` whose ``config.min_ctas`` and
  ``config.max_ctas`` are both the SM count (so the kernel uses exactly that many CTAs, as far
  as NCCL's channel limit allows), cached by SM count.
- MSCCL++: when ``import mscclpp`` succeeds on a GPU run, each entry records the grid size
  (= the planned SMs) that an MSCCL++ kernel would launch with; the collective itself still
  runs on the CTA-limited NCCL group (MSCCL++ kernels are not wired in).
- Any other backend (gloo on CPU, the fake backend used for planning): the base group itself;
  the SM count is recorded but not enforced.

Creating a process group is collective over the whole default group: every rank must call
:meth:`CollectiveBackends.group_for` (or :meth:`prepare`) for the same new SM counts in the
same order. ``prepare(plan_sm_counts)`` at deployment does that once, before training.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kareus_fx.errors import KareusError


class CollectiveBackendError(KareusError, RuntimeError):
    """No process group can be given for a planned SM count (no group, bad count)."""


@dataclass(frozen=True)
class SMLimitedGroup:
    """The communicator chosen for one SM count."""

    sm_count: int
    backend: str  # the backend that runs the collective ("nccl", "gloo", "fake", ...)
    enforced: bool  # the communicator itself limits its kernels to sm_count CTAs
    group_name: str  # the name functional collectives take as their group argument
    mscclpp_grid_size: int | None  # grid size for an MSCCL++ kernel, when mscclpp imports


def nccl_options_for(sm_count: int) -> dist.ProcessGroupNCCL.Options:
    """NCCL process-group options whose kernels use exactly ``sm_count`` CTAs."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.min_ctas = sm_count
    options.config.max_ctas = sm_count
    return options


def mscclpp_importable() -> bool:
    """Whether ``import mscclpp`` succeeds."""
    try:
        importlib.import_module("mscclpp")
    except ImportError:
        return False
    return True


class CollectiveBackends:
    """Per-SM-count process groups over the ranks of ``group`` (default: the world group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise CollectiveBackendError(
                "torch.distributed is not initialised: call init_process_group() before "
                "creating CollectiveBackends"
            )
        self.base_group = dist.group.WORLD if group is None else group
        self.ranks = dist.get_process_group_ranks(self.base_group)
        self.backend = str(dist.get_backend(self.base_group))
        self.enforces_sm_limit = "nccl" in self.backend
        self.mscclpp_available = self.enforces_sm_limit and mscclpp_importable()
        self._groups: dict[int, dist.ProcessGroup] = {}
        self.limits: dict[int, SMLimitedGroup] = {}

    def prepare(self, sm_counts: Iterable[int]) -> None:
        """Create the groups of every SM count in ``sm_counts`` (same call on every rank)."""
        for sm_count in sorted(set(sm_counts)):
            self.group_for(sm_count)

    def group_for(self, sm_count: int) -> dist.ProcessGroup:
        """The process group whose collectives use ``sm_count`` SMs (created on first use)."""
        _check_sm_count(sm_count)
        group = self._groups.get(sm_count)
        if group is None:
            group = self._create(sm_count)
            self._groups[sm_count] = group
            self.limits[sm_count] = SMLimitedGroup(
                sm_count=sm_count,
                backend="nccl" if self.enforces_sm_limit else self.backend,
                enforced=self.enforces_sm_limit,
                group_name=group.group_name,
                mscclpp_grid_size=sm_count if self.mscclpp_available else None,
            )
        return group

    def group_name_for(self, sm_count: int) -> str:
        """The group name for ``torch.ops._c10d_functional`` collectives at ``sm_count`` SMs."""
        self.group_for(sm_count)
        return self.limits[sm_count].group_name

    def _create(self, sm_count: int) -> dist.ProcessGroup:
        if not self.enforces_sm_limit:
            return self.base_group
        device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if sm_count > device_sms:
            raise CollectiveBackendError(
                f"the plan gives a collective {sm_count} SMs but this GPU has {device_sms}: "
                "the plan was made for another GPU"
            )
        return dist.new_group(
            ranks=self.ranks,
            backend="nccl",
            pg_options=nccl_options_for(sm_count),
            group_desc=f"kareus_comm_sm{sm_count}",
        )


def _check_sm_count(sm_count: object) -> None:
    if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1:
        raise CollectiveBackendError(f"sm_count must be a positive integer, got {sm_count!r}")
