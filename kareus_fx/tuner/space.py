"""The per-partition-type search space (paper appendices B and C) and its numeric encoding.

A configuration is a :class:`~kareus_fx.workload.PartitionConfig`: SM clock, SMs given to the
collective, and the launch slot of the collective (``None`` = sequential execution).

Axes (appendix C, with the choices this project makes where the paper leaves them open):

- **Clock**: from ``gpu.tuning_clock_min_mhz`` to ``gpu.clock_max_mhz`` at ``clock_stride_mhz``
  (default 30 MHz: adjacent 15 MHz settings differ marginally), counted down from the maximum so
  the maximum clock is always in the space. A100: 1410, 1380, ..., 900 (18 clocks). The stride must
  be a multiple of the GPU's clock grid step. ``supported_clocks_mhz`` (e.g. NVML's list on a real
  GPU) restricts the grid further.
- **Collective SMs**: 1-20 step 1 when the collective's group has fewer than 4 GPUs, else 3-30 step 3
  (A100, 108 SMs). On a GPU with more SMs the upper end scales by ``sm_count / 108`` and is rounded
  to the step (H100, 132 SMs: 1-24 step 1, or 3-36 step 3); the step and the lower end stay.
  Sequential configs keep the SM axis: the collective still runs with that many SMs, alone.
- **Launch slot**: every slot of ``PartitionType.launch_slots`` (the partition pass already dropped
  slots that always expose the collective) plus sequential (``launch_slot=None``).

Encoding for the surrogates (:meth:`SearchSpace.features`), one row per config, all in [0, 1]:

0. clock, min-max scaled over the space's clocks;
1. collective SMs, min-max scaled over the space's SM choices;
2. launch position: launch slot index / number of slots; sequential = 1.0 (after everything);
3. sequential flag (1.0 for sequential, else 0.0);
4. overlap capacity: the share of the partition's roofline compute time (at the maximum clock) from
   the launch slot to the end, i.e. how much computation the collective can hide under; 0.0 for
   sequential;
5. hiding capacity: collective SMs x roofline compute time from the launch slot to the end *at the
   config's clock*, scaled by its largest value in the space; 0.0 for sequential;
6. compute-time estimate: the partition's roofline compute time at the config's clock, times
   ``sm_count / (sm_count - comm_sms)`` when overlapped (the computation runs on the SMs the
   collective leaves; sequential: all SMs), min-max scaled over the space.

Launch timing is categorical; the ordinal position plus the capacity feature gives the trees an
order that means something (later launch = less computation left to hide under) with two numbers
instead of one one-hot column per slot. ``encoding="onehot"`` appends one indicator column per
launch option (slots then sequential) for comparison.

Why features 5 and 6. An overlapped partition takes about ``max(compute(f, s), before(f, slot) +
collective(s))``: the collective is hidden while its time stays under the computation left after
its launch. A collective limited to ``s`` SMs moves data at a rate roughly proportional to ``s``
(below the link's saturation), so it is hidden when ``s x remaining(f, slot) >= bytes / per-SM
rate``: feature 5 against a threshold. The per-SM rate is not known before measuring, but a tree
split on feature 5 *is* that threshold, whatever the rate; without it the trees must carve the
hidden/exposed boundary out of clock x SMs x slot boxes, and from 10-15 % of the space they did not
(the frontier of the simulated Llama-3.2-3B forward MLP type runs along the smallest SM choice at
the earliest launch slot, where the collective is just hidden; the trees predicted that column
about 2.5 % too slow and the search never went there). When the collective is hidden the time is
the computation's, which the collective slows by taking SMs (feature 6); the clock-SMs trade-off
along the frontier (e.g. 3 against 6 SMs, 1-3 % apart) is then a difference the trees see in one
feature. Both come from the roofline times of the slots and the GPU spec (no measurement); the
trees still learn everything the estimates leave out (memory-bound slots, contention, the TDP
plateau). Measured with ``bench/mbo_quality.py`` (5 seeds): see the surrogate module docstring.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.errors import OptionsError
from kareus_fx.workload import PartitionConfig, PartitionType

DEFAULT_CLOCK_STRIDE_MHZ = 30
REFERENCE_SM_COUNT = 108
"""A100's SM count: the SM ranges of appendix C are quoted for it."""

SMALL_GROUP_SMS = (1, 20, 1)
"""(first, last, step) collective SMs for a group of fewer than 4 GPUs (appendix C)."""
LARGE_GROUP_SMS = (3, 30, 3)
"""(first, last, step) collective SMs for a group of 4 or more GPUs (appendix C)."""

Encoding = Literal["ordinal", "onehot"]
N_FEATURES = 7
"""Columns of the ordinal encoding (module docstring); one-hot launch columns come after them."""


def clock_grid_mhz(
    gpu: GPUSpec,
    stride_mhz: int = DEFAULT_CLOCK_STRIDE_MHZ,
    supported_clocks_mhz: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Tuning clocks, ascending: ``clock_max_mhz`` downwards by ``stride_mhz`` to the tuning floor."""
    if stride_mhz <= 0 or stride_mhz % gpu.clock_step_mhz:
        raise OptionsError(
            f"clock stride {stride_mhz} MHz must be a positive multiple of {gpu.name}'s "
            f"{gpu.clock_step_mhz} MHz clock step (e.g. {2 * gpu.clock_step_mhz})"
        )
    clocks = range(gpu.clock_max_mhz, gpu.tuning_clock_min_mhz - 1, -stride_mhz)
    grid = sorted(clocks)
    if supported_clocks_mhz is not None:
        supported = {int(c) for c in supported_clocks_mhz}
        grid = [c for c in grid if c in supported]
        if not grid:
            raise OptionsError(
                f"none of the tuning clocks {sorted(clocks)} is among the supported clocks "
                f"{sorted(supported)}; pass a stride that lands on the GPU's clock grid"
            )
    return tuple(grid)


def comm_sm_grid(gpu: GPUSpec, group_size: int) -> tuple[int, ...]:
    """Collective SM choices for a collective over ``group_size`` GPUs (see module docstring)."""
    first, last, step = SMALL_GROUP_SMS if group_size < 4 else LARGE_GROUP_SMS
    scaled_last = int(round(last * gpu.sm_count / REFERENCE_SM_COUNT / step)) * step
    scaled_last = max(first, min(scaled_last, gpu.sm_count - 1))
    return tuple(range(first, scaled_last + 1, step))


def slot_roofline_times_s(ptype: PartitionType, gpu: GPUSpec, clock_mhz: float | None = None) -> np.ndarray:
    """Roofline time of each slot at ``clock_mhz`` (default: the maximum clock): the sum over its
    ops of max(compute, memory); compute time scales with the clock, memory time does not."""
    peak = gpu.peak_flops_per_s(clock_mhz)
    bw = gpu.hbm_bandwidth_bytes_per_s
    return np.array(
        [sum(max(op.flops / peak, op.bytes / bw) for op in slot.ops) for slot in ptype.slots],
        dtype=float,
    )


@dataclass(frozen=True)
class SearchSpace:
    """Every configuration of one partition type, in a fixed order (clock, SMs, launch option)."""

    ptype: PartitionType
    clocks_mhz: tuple[int, ...]
    comm_sms: tuple[int, ...]
    launch_options: tuple[int | None, ...]
    """Launch slots in ``ptype.launch_slots`` order, then ``None`` (sequential)."""
    slot_times_by_clock_s: tuple[tuple[float, ...], ...]
    """Roofline time of each slot at each clock of :attr:`clocks_mhz` (same order)."""
    sm_count: int
    """SMs of the GPU (the computation gets those the collective does not)."""
    encoding: Encoding = "ordinal"
    configs: tuple[PartitionConfig, ...] = field(init=False, repr=False)
    _index: dict[PartitionConfig, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        configs = tuple(
            PartitionConfig(clock_mhz=c, comm_sms=s, launch_slot=slot)
            for c in self.clocks_mhz
            for s in self.comm_sms
            for slot in self.launch_options
        )
        object.__setattr__(self, "configs", configs)
        object.__setattr__(self, "_index", {cfg: i for i, cfg in enumerate(configs)})

    def __len__(self) -> int:
        return len(self.configs)

    @property
    def grid_shape(self) -> tuple[int, int, int]:
        """(clocks, SM choices, launch options): :attr:`configs` is this grid in row-major order."""
        return (len(self.clocks_mhz), len(self.comm_sms), len(self.launch_options))

    def __iter__(self) -> Iterator[PartitionConfig]:
        return iter(self.configs)

    def __contains__(self, config: object) -> bool:
        return config in self._index

    def index(self, config: PartitionConfig) -> int:
        """Position of ``config`` in :attr:`configs`; ``KeyError`` if it is not in the space."""
        return self._index[config]

    @property
    def max_clock_mhz(self) -> int:
        return self.clocks_mhz[-1]

    @property
    def slot_times_s(self) -> tuple[float, ...]:
        """Roofline time of each slot at the maximum clock."""
        return self.slot_times_by_clock_s[-1]

    def features(self, configs: Sequence[PartitionConfig] | None = None) -> np.ndarray:
        """Numeric feature rows for ``configs`` (default: the whole space); see module docstring."""
        configs = self.configs if configs is None else configs
        n_slots = max(len(self.ptype.slots), 1)
        by_clock = np.asarray(self.slot_times_by_clock_s, dtype=float).reshape(len(self.clocks_mhz), -1)
        # suffix[c, k]: roofline compute time from slot k to the end at clock index c (k = n: 0)
        suffix = np.column_stack([np.cumsum(by_clock[:, ::-1], axis=1)[:, ::-1], np.zeros(len(by_clock))])
        at_max_clock = suffix[-1] / (suffix[-1, 0] or 1.0)
        c_lo, c_hi = self.clocks_mhz[0], self.clocks_mhz[-1]
        s_lo, s_hi = self.comm_sms[0], self.comm_sms[-1]
        capacity_max = float(suffix[:, 0].max()) * s_hi or 1.0
        slowest_compute_s = float(suffix[:, 0].max()) * self.sm_count / (self.sm_count - s_hi)
        fastest_compute_s = float(suffix[:, 0].min())
        clock_pos = {c: i for i, c in enumerate(self.clocks_mhz)}
        onehot = self.encoding == "onehot"
        option_pos = {opt: i for i, opt in enumerate(self.launch_options)}
        width = N_FEATURES + (len(self.launch_options) if onehot else 0)
        out = np.zeros((len(configs), width), dtype=float)
        for row, cfg in enumerate(configs):
            at_clock = suffix[clock_pos[cfg.clock_mhz]]
            out[row, 0] = (cfg.clock_mhz - c_lo) / (c_hi - c_lo) if c_hi > c_lo else 0.0
            out[row, 1] = (cfg.comm_sms - s_lo) / (s_hi - s_lo) if s_hi > s_lo else 0.0
            if cfg.launch_slot is None:
                out[row, 2] = 1.0
                out[row, 3] = 1.0
                compute_s = at_clock[0]
            else:
                out[row, 2] = cfg.launch_slot / n_slots
                out[row, 4] = at_max_clock[cfg.launch_slot]
                out[row, 5] = cfg.comm_sms * at_clock[cfg.launch_slot] / capacity_max
                compute_s = at_clock[0] * self.sm_count / (self.sm_count - cfg.comm_sms)
            span = slowest_compute_s - fastest_compute_s
            out[row, 6] = (compute_s - fastest_compute_s) / span if span > 0 else 0.0
            if onehot:
                out[row, N_FEATURES + option_pos[cfg.launch_slot]] = 1.0
        return out


def build_search_space(
    ptype: PartitionType,
    gpu: GPUSpec,
    *,
    clock_stride_mhz: int = DEFAULT_CLOCK_STRIDE_MHZ,
    supported_clocks_mhz: Sequence[int] | None = None,
    encoding: Encoding = "ordinal",
) -> SearchSpace:
    """The search space of ``ptype`` on ``gpu`` (see the module docstring for each axis)."""
    bad = [s for s in ptype.launch_slots if not 0 <= s < len(ptype.slots)]
    if bad:
        raise OptionsError(
            f"partition type {ptype.type_id!r} has launch slots {bad} outside its {len(ptype.slots)} slots"
        )
    options: tuple[int | None, ...] = tuple(dict.fromkeys(ptype.launch_slots)) + (None,)
    clocks = clock_grid_mhz(gpu, clock_stride_mhz, supported_clocks_mhz)
    return SearchSpace(
        ptype=ptype,
        clocks_mhz=clocks,
        comm_sms=comm_sm_grid(gpu, ptype.collective.group_size),
        launch_options=options,
        sm_count=gpu.sm_count,
        slot_times_by_clock_s=tuple(
            tuple(float(t) for t in slot_roofline_times_s(ptype, gpu, clock)) for clock in clocks
        ),
        encoding=encoding,
    )
