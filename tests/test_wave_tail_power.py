"""SM-active power follows the SMs that hold CTAs: a partial last wave leaves SMs empty."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.kernel_model import KernelModel, mean_resident_sms
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.workload import CollectiveSpec, OpCost, PartitionConfig, PartitionType, SlotSpec

A100 = "A100-SXM4-40GB"
FMAX = 1410


def test_mean_resident_sms_counts_the_last_waves_ctas():
    assert mean_resident_sms(256, 108, 0.0) == pytest.approx(256 / 3)  # 108 + 108 + 40 CTAs over 3 waves
    assert mean_resident_sms(216, 108, 0.0) == pytest.approx(108.0)  # two full waves
    assert mean_resident_sms(50, 108, 0.0) == pytest.approx(50.0)  # one wave: its CTAs all along
    assert mean_resident_sms(256, 108, 1.0) == pytest.approx(108.0)  # memory-bound: streams until done
    assert mean_resident_sms(256, 108, 0.5) == pytest.approx(0.5 * 108 + 0.5 * 256 / 3)


def test_kernel_rates_keep_time_and_busy_sms_and_lower_powered_sms():
    km = KernelModel(gpu_spec(A100), gpu_params(A100).params)
    flops = 217 * km.params.cta_flops  # 3 waves on 108 SMs, the last with one CTA
    r = km.kernel(flops, 1e6, 108, FMAX)
    assert r.busy_sms == 108.0
    assert r.memory_share < 0.01
    assert r.powered_sms == pytest.approx(217 / 3, rel=0.01)
    full = km.kernel(216 * km.params.cta_flops, 1e6, 108, FMAX)
    assert full.powered_sms == pytest.approx(108.0, rel=1e-3)
    assert r.time_s == pytest.approx(1.5 * full.time_s, rel=0.02)  # wave quantisation unchanged


def test_sm_active_energy_follows_the_ctas_not_the_waves():
    """One more CTA costs a whole wave of time but only one CTA of SM-active energy."""
    spec = replace(gpu_spec(A100), tdp_w=float("inf"))  # no throttling: one clock for both
    sim = Simulator(spec, gpu_params(A100).params)
    cta = sim.params.cta_flops
    two = sim.predict_sequence([OpCost("mm", "aten.mm.default", 216 * cta, 1e6)], (), FMAX)
    three = sim.predict_sequence([OpCost("mm", "aten.mm.default", 217 * cta, 1e6)], (), FMAX)
    assert three.terms.time_s > 1.4 * two.terms.time_s  # a third wave (plus the same launch gap)
    # sm_clock_s integrates resident SMs: 217 CTA-times against 216, not 1.5x.
    assert three.terms.sm_clock_s / two.terms.sm_clock_s == pytest.approx(217 / 216, rel=0.02)
    # The emptier tail lowers the average power of the longer run.
    assert three.measurement.energy_j / three.terms.time_s < two.measurement.energy_j / two.terms.time_s


def test_partition_beside_a_collective_powers_only_resident_sms():
    """A GEMM pushed into a sparse extra wave by the collective's SMs draws less SM-active power
    per second than its standalone full waves; the collective's SMs are charged as before."""
    spec = replace(gpu_spec(A100), tdp_w=float("inf"))
    params = gpu_params(A100).params
    sim = Simulator(spec, params)
    cta = params.cta_flops
    mm = OpCost("mm", "aten.mm.default", 216 * cta, 1e6)  # 2 waves alone, 3 on 102 SMs
    ptype = PartitionType(
        "t", "forward", (SlotSpec((mm,)),), CollectiveSpec("all_reduce", 64 * 2**20, group_size=8), 1, (0,)
    )
    run = sim.predict(ptype, PartitionConfig(clock_mhz=FMAX, comm_sms=6, launch_slot=0), timeline=True)
    gemm_alone = sim.predict_sequence([mm], (), FMAX)
    assert run.terms.time_s > gemm_alone.terms.time_s
    overlap_s = min(run.terms.time_s, 1.5 * gemm_alone.terms.time_s)
    # Resident SMs beside the collective: the GEMM's 216 CTA-times plus the collective's 6 SMs.
    gemm_sm_s = gemm_alone.terms.sm_clock_s
    assert run.terms.sm_clock_s < gemm_sm_s + (6 / 108) * run.terms.time_s + 0.02 * gemm_sm_s
    assert run.terms.sm_clock_s < (102 + 6) / 108 * overlap_s
