"""One communicator per planned communication SM count (paper 3.2.1 and 5.2).

The plan gives each partition type a number of SMs for its collective. A collective's SM use is
the number of CTAs its kernel launches, which NCCL fixes per communicator
(``ncclConfig_t.minCTAs`` / ``maxCTAs``). :class:`CollectiveBackends` therefore keeps, per SM
count, a communicator over the same ranks as a base group (a TP or CP group):

- NCCL base group (GPU): a new NCCL group created with
  ``torch.distributed.ProcessGroupNCCL.Options()`` whose ``config.min_ctas`` and
  ``config.max_ctas`` are both the SM count (so the kernel uses exactly that many CTAs, as far
  as NCCL's channel limit allows).
- MSCCL++: when ``import mscclpp`` succeeds on a GPU run, each entry records the grid size
  (= the planned SMs) that an MSCCL++ kernel would launch with; the collective itself still
  runs on the CTA-limited NCCL group (MSCCL++ kernels are not wired in).
- gloo (CPU): a new gloo group over the same ranks, so the rewritten collectives really run on
  another communicator; the SM count is recorded but not enforced.
- The fake backend (planning on meta): the base group itself; nothing runs.

Creating a process group is collective over the whole default group: every rank calls
``new_group`` for every group, members or not, in the same order. A job with several TP (CP)
groups, e.g. one per pipeline stage, must therefore create its SM-limited communicators at
startup, with :func:`prepare_comm_groups` on every rank: it gathers every rank's base groups and
creates, per SM count in ascending order, one communicator per distinct base group in ascending
rank order. Created lazily (inside a compile) they would hang: each stage compiles its own
graph, at its own time. Only a base group spanning the whole world may be created lazily (every
rank compiles the same graph then), which :meth:`CollectiveBackends.group_for` does; for any
other base group it raises :class:`CollectiveBackendError` naming :func:`prepare_comm_groups`.
Communicators are cached per process by (base group ranks, SM count).

Timeout: every communicator created here gets the deployment's process-group timeout
(``timeout_s`` of :func:`prepare_comm_groups`, default :data:`DEFAULT_TIMEOUT_S`), so a collective
whose peer died or hangs fails within it instead of waiting for the backend's default (30 min for
gloo). A killed peer usually fails the collective at once (its connection closes); the timeout
bounds the case of a peer that is alive but stuck.
"""

from __future__ import annotations

import datetime
import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kareus_fx.errors import KareusError

DEFAULT_TIMEOUT_S = 600.0
"""Process-group timeout of the SM-limited communicators when the deployment names none (NCCL's default)."""

_timeout_s = DEFAULT_TIMEOUT_S


def comm_timeout_s() -> float:
    """The timeout this process gives the communicators it creates (see the module docstring)."""
    return _timeout_s


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
    """Per-SM-count communicators over the ranks of ``group`` (default: the world group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise CollectiveBackendError(
                "torch.distributed is not initialised: call init_process_group() before creating CollectiveBackends"
            )
        if group is None:
            group = dist.group.WORLD
            if group is None:  # only while init_process_group is half done
                raise CollectiveBackendError("torch.distributed has no world group yet")
        self.base_group = group
        self.ranks = tuple(dist.get_process_group_ranks(self.base_group))
        self.backend = str(dist.get_backend(self.base_group))
        self.enforces_sm_limit = "nccl" in self.backend
        self.mscclpp_available = self.enforces_sm_limit and mscclpp_importable()
        self._groups: dict[int, dist.ProcessGroup] = {}
        self.limits: dict[int, SMLimitedGroup] = {}

    @property
    def spans_world(self) -> bool:
        """The base group holds every rank (its communicators may be created lazily)."""
        return len(self.ranks) == dist.get_world_size()

    def prepare(self, sm_counts: Iterable[int]) -> None:
        """Create the communicators of every SM count in ``sm_counts`` (same call on every rank;
        only for a base group spanning the world: see :func:`prepare_comm_groups`)."""
        for sm_count in sorted(set(sm_counts)):
            self.group_for(sm_count)

    def group_for(self, sm_count: int) -> dist.ProcessGroup:
        """The process group whose collectives use ``sm_count`` SMs."""
        _check_sm_count(sm_count)
        group = self._groups.get(sm_count)
        if group is not None:
            return group
        if not self.spans_world:
            raise CollectiveBackendError(
                f"no communicator for {sm_count} SMs over ranks {list(self.ranks)}: with more than one "
                f"TP or CP group (pipeline stages), creating communicators is collective over all "
                f"ranks and must happen at startup. Call kareus_fx.deploy.deployment.prepare_collectives(plan, "
                f"target, [tp_group, cp_group]) on every rank after init_process_group, before the "
                f"first compiled step"
            )
        return self._add(sm_count, create_comm_group(self.ranks, self.backend, sm_count))

    def group_name_for(self, sm_count: int) -> str:
        """The group name for ``torch.ops._c10d_functional`` collectives at ``sm_count`` SMs."""
        self.group_for(sm_count)
        return self.limits[sm_count].group_name

    def _add(self, sm_count: int, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        group = self.base_group if group is None else group
        self._groups[sm_count] = group
        self.limits[sm_count] = SMLimitedGroup(
            sm_count=sm_count,
            backend="nccl" if self.enforces_sm_limit else self.backend,
            enforced=self.enforces_sm_limit,
            group_name=group.group_name,
            mscclpp_grid_size=sm_count if self.mscclpp_available else None,
        )
        return group


_BACKENDS: dict[tuple[int, ...], CollectiveBackends] = {}
"""This process's communicators, by the global ranks of their base group."""


def backends_for(group: dist.ProcessGroup) -> CollectiveBackends:
    """The cached :class:`CollectiveBackends` of ``group`` (one per base group's ranks)."""
    ranks = tuple(dist.get_process_group_ranks(group))
    backends = _BACKENDS.get(ranks)
    if backends is None:
        backends = _BACKENDS[ranks] = CollectiveBackends(group)
    return backends


def create_comm_group(ranks: Sequence[int], backend: str, sm_count: int) -> dist.ProcessGroup | None:
    """A new communicator over ``ranks`` for ``sm_count`` SMs (module docstring); collective over
    the world. None: use the base group (the fake backend), or this rank is not in ``ranks``."""
    if backend == "fake":
        return None
    timeout = datetime.timedelta(seconds=_timeout_s)
    if "nccl" not in backend:
        return _member_group(
            dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout, group_desc=f"kareus_comm_sm{sm_count}")
        )
    device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if sm_count > device_sms:
        raise CollectiveBackendError(
            f"the plan gives a collective {sm_count} SMs but this GPU has {device_sms}: "
            "the plan was made for another GPU"
        )
    return _member_group(
        dist.new_group(
            ranks=list(ranks),
            backend="nccl",
            pg_options=nccl_options_for(sm_count),
            timeout=timeout,
            group_desc=f"kareus_comm_sm{sm_count}",
        )
    )


def _member_group(handle: object) -> dist.ProcessGroup | None:
    """What ``dist.new_group`` (unannotated) returned: the group, or None for a non-member
    (torch returns ``GroupMember.NON_GROUP_MEMBER`` there)."""
    return handle if isinstance(handle, dist.ProcessGroup) else None


def prepare_comm_groups(
    sm_counts: Iterable[int],
    groups: Iterable[dist.ProcessGroup | None],
    timeout_s: float | None = None,
) -> None:
    """Create every rank's communicators for ``sm_counts`` over its ``groups`` (the module docstring).

    Call on every rank, after ``init_process_group`` and before the first compiled step, with
    this rank's own base groups (``[tp_group, cp_group]``; None entries, size-1 dimensions, are
    skipped). Collective over the world; idempotent. Ranks may pass different SM counts only if
    every rank passes the same set (it is checked). ``timeout_s`` (default
    :data:`DEFAULT_TIMEOUT_S`) is the process-group timeout of the communicators created from now on.
    """
    global _timeout_s
    if timeout_s is not None:
        if not timeout_s > 0:
            raise CollectiveBackendError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        _timeout_s = float(timeout_s)
    counts = sorted(set(sm_counts))
    for sm_count in counts:
        _check_sm_count(sm_count)
    mine = {tuple(dist.get_process_group_ranks(g)): g for g in groups if g is not None}
    created = sorted((ranks, count) for ranks, backends in _BACKENDS.items() for count in backends.limits)
    backend_names = sorted({str(dist.get_backend(g)) for g in mine.values()})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (counts, sorted(mine), backend_names, created))
    if any(other[0] != counts for other in gathered):
        raise CollectiveBackendError(
            f"prepare_comm_groups got different SM counts on different ranks ({[g[0] for g in gathered]}); "
            "every rank must pass the SM counts of the whole plan (all stages)"
        )
    backends = {name for _, _, names, _ in gathered for name in names}
    if len(backends) > 1:
        raise CollectiveBackendError(f"the base groups run on different backends {sorted(backends)}")
    backend = backends.pop() if backends else ""
    siblings = sorted({tuple(ranks) for _, rank_lists, _, _ in gathered for ranks in rank_lists})
    # A pair any member created before is skipped by every rank (all members created it together).
    done = {(tuple(ranks), count) for *_, pairs in gathered for ranks, count in pairs}
    for sm_count in counts:
        for ranks in siblings:
            if (ranks, sm_count) in done:
                continue
            group = create_comm_group(ranks, backend, sm_count)
            if ranks in mine:
                backends_for(mine[ranks])._add(sm_count, group)


def _check_sm_count(sm_count: object) -> None:
    if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1:
        raise CollectiveBackendError(f"sm_count must be a positive integer, got {sm_count!r}")
