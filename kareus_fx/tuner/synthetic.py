"""A small analytic partition model for testing and benchmarking the tuner without a GPU.

Not a GPU model (that is ``kareus_fx.cost_models.simulated_profiler``): a smooth but nontrivial
function of (clock, collective SMs, launch slot) with the properties the tuner must cope with:

- each slot's time is its roofline time, the compute part scaling with 1/clock;
- the collective's time falls with its SMs and saturates; while it runs, overlapped computation
  slows down, compute-bound slots by the SMs they lose (``sm_count / (sm_count - sms)``) and
  memory-bound slots by HBM contention (a fixed 30 %), so the best SM count is interior and the
  best launch slot depends on which slots the collective overlaps;
- dynamic power grows with clock x voltage^2 (voltage linear in clock), so lower clocks save dynamic
  energy but cost static energy (``static_power_w x time``): a real time-energy trade-off.

``noise_std`` adds multiplicative Gaussian noise that is a deterministic function of
(seed, type, config), so a config measured twice reads the same (as a profile database would).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.workload import (
    CollectiveSpec,
    Measurement,
    OpCost,
    PartitionConfig,
    PartitionType,
    SlotSpec,
)

_MEM_CONTENTION = 1.3
_SLOWDOWN_ENERGY = 0.3  # share of the nominal power drawn during the slowed-down extra time


@dataclass
class SyntheticProfiler:
    """Analytic :class:`~kareus_fx.workload.Profiler`; counts calls in ``calls``."""

    gpu_name: str = "A100-SXM4-40GB"
    noise_std: float = 0.0
    seed: int = 0
    calls: int = 0

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        self.calls += 1
        gpu = gpu_spec(self.gpu_name)
        f = config.clock_mhz / gpu.clock_max_mhz
        volt = 0.65 + 0.35 * f
        peak = gpu.peak_flops_per_s(config.clock_mhz)
        bw = gpu.hbm_bandwidth_bytes_per_s
        times, powers, membound = [], [], []
        for slot in ptype.slots:
            t_c = slot.flops / peak
            t_m = slot.bytes / bw
            mem = t_m > t_c
            times.append(max(t_c, t_m) + 4e-6)
            powers.append((150.0 if mem else 260.0) * f * volt**2 + (40.0 if mem else 0.0))
            membound.append(mem)
        sms = config.comm_sms
        coll = ptype.collective
        wire = coll.bytes * 2 * (coll.group_size - 1) / coll.group_size / gpu.nvlink_bandwidth_bytes_per_s
        comm_t = wire * (1.0 + (6.0 / sms) ** 1.3) * (0.9 + 0.1 / f) + 15e-6
        comm_p = (25.0 + 2.2 * sms) * (0.5 + 0.5 * f * volt**2)

        energy = 0.0
        if config.launch_slot is None:
            total_t = sum(times) + comm_t
            energy = sum(t * p for t, p in zip(times, powers)) + comm_t * comm_p
        else:
            k = config.launch_slot
            total_t = sum(times[:k])
            energy = sum(t * p for t, p in zip(times[:k], powers[:k]))
            left = comm_t
            for t, p, mem in zip(times[k:], powers[k:], membound[k:]):
                slow = _MEM_CONTENTION if mem else gpu.sm_count / (gpu.sm_count - sms)
                slowed = t * slow
                if left >= slowed:
                    dur = slowed
                    left -= slowed
                elif left > 0:
                    frac = left / slowed
                    dur = left + (1 - frac) * t
                    left = 0.0
                else:
                    dur = t
                total_t += dur
                energy += p * t + p * _SLOWDOWN_ENERGY * (dur - t)
            total_t += left  # exposed communication
            energy += comm_t * comm_p
        if self.noise_std > 0:
            key = f"{self.seed}|{ptype.type_id}|{config.clock_mhz}|{config.comm_sms}|{config.launch_slot}"
            rng = np.random.default_rng(zlib.crc32(key.encode()))
            total_t *= 1.0 + self.noise_std * rng.standard_normal()
            energy *= 1.0 + self.noise_std * rng.standard_normal()
        static = gpu.static_power_w * total_t
        return Measurement(time_s=total_t, energy_j=energy + static, dynamic_energy_j=energy, static_energy_j=static)


def _gemm(name: str, m: int, n: int, k: int) -> OpCost:
    return OpCost(name, "aten.mm", 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n))


def _eltwise(name: str, elems: int, passes: int = 3) -> OpCost:
    return OpCost(name, "aten.add", 4.0 * elems, 2.0 * elems * passes)


def synthetic_partition_types(tokens: int = 16384, hidden: int = 3072, tp: int = 8) -> list[PartitionType]:
    """Three partition types of 1, 3 and 7 computations around an all-reduce over ``tp`` GPUs."""
    h_tp = hidden // tp
    ar = CollectiveSpec("all_reduce", bytes=2.0 * tokens * hidden, group_size=tp)
    small = PartitionType(
        "syn_small",
        "forward",
        (SlotSpec((_gemm("proj", tokens, hidden, 4 * h_tp),)),),
        ar,
        count=28,
        launch_slots=(0,),
    )
    medium = PartitionType(
        "syn_medium",
        "forward",
        (
            SlotSpec((_eltwise("norm", tokens * hidden),)),
            SlotSpec((_gemm("up", tokens, 2 * 4 * h_tp, hidden),)),
            SlotSpec((_eltwise("act", tokens * 8 * h_tp),)),
        ),
        ar,
        count=28,
        launch_slots=(0, 1, 2),
    )
    large = PartitionType(
        "syn_large",
        "backward",
        (
            SlotSpec((_eltwise("norm_bwd", tokens * hidden),)),
            SlotSpec((_gemm("down_dgrad", tokens, 4 * h_tp, hidden),)),
            SlotSpec((_gemm("down_wgrad", 4 * h_tp, hidden, tokens),)),
            SlotSpec((_eltwise("act_bwd", tokens * 8 * h_tp, passes=4),)),
            SlotSpec((_gemm("up_dgrad", tokens, hidden, 8 * h_tp),)),
            SlotSpec((_gemm("up_wgrad", 8 * h_tp, hidden, tokens),)),
            SlotSpec((_eltwise("residual", tokens * hidden),)),
        ),
        ar,
        count=28,
        launch_slots=(0, 1, 2, 3, 4, 5),
    )
    return [small, medium, large]
