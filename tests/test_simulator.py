"""The simulated GPU shows the effects of paper section 3 and keeps its physical invariants."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from kareus_fx.cost_models.analytic_workloads import (
    elementwise,
    gemm,
    llama_attention_partition,
    llama_mlp_partition,
)
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.kernel_model import KernelModel, memory_share
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.workload import CollectiveSpec, OpCost, PartitionConfig, PartitionType, SlotSpec

A100 = "A100-SXM4-40GB"
FMAX = 1410
# Llama-3.2-3B attention sub-layer at TP=4 (paper Figure 3): RMSNorm, QKV linear, RoPE,
# FlashAttention, output linear; the all-reduce of the previous nanobatch.
NORM, QKV, ROPE, FLASH, OUT = range(5)


@pytest.fixture(scope="module")
def sim() -> Simulator:
    return Simulator(A100)


@pytest.fixture(scope="module")
def attn():
    return llama_attention_partition(tp=4, nanobatch=4, seq=4096)


def energy(sim: Simulator, ptype, clock: int, sms: int, slot) -> float:
    return sim.measure(ptype, PartitionConfig(clock, sms, slot)).energy_j


# ----- section 3 effects ----------------------------------------------------------------------------
def test_interior_sm_count_minimises_energy(sim, attn):
    """3.2.1: too few SMs expose the collective, too many slow the computation beside it."""
    sms = list(range(1, 31))
    e = [energy(sim, attn, FMAX, n, QKV) for n in sms]
    best = int(np.argmin(e))
    assert 0 < best < len(sms) - 1, f"energy-optimal SM count {sms[best]} is at the edge"
    assert e[0] > 1.05 * e[best] and e[-1] > 1.01 * e[best]
    # Too few: the collective is exposed; too many: it is hidden but the computation is slower.
    few = sim.predict(attn, PartitionConfig(FMAX, 1, QKV))
    many = sim.predict(attn, PartitionConfig(FMAX, 30, QKV))
    opt = sim.predict(attn, PartitionConfig(FMAX, sms[best], QKV))
    assert few.exposed_comm_s > 5 * opt.exposed_comm_s
    assert many.measurement.time_s > opt.measurement.time_s


def _alternating_partition():
    """Norm-like memory-bound slots alternating with Linear-like GEMMs of similar length, so that
    the collective is hidden by a GEMM slot (the premise of the paper's Figure 3b vs 3d)."""
    norm = elementwise("norm", 3.5e8, 1, 1, 2, "aten._fused_rms_norm.default")
    linear = gemm("linear", 8192, 4096, 4096)
    slots = (SlotSpec((norm,)), SlotSpec((linear,)), SlotSpec((norm,)), SlotSpec((linear,)))
    return PartitionType("alternating", "forward", slots, CollectiveSpec("all_reduce", 60e6, 4), 1, (0, 1, 2, 3))


def test_memory_bound_launch_slot_costs_more_at_max_clock(sim):
    """3.2.2: with the collective hidden either way, launching it beside a memory-bound kernel
    makes the two compete for HBM (prolonging both) and costs more than launching it beside a
    compute-bound kernel."""
    ptype = _alternating_partition()
    for n in (8, 16, 24):
        mem_first, gemm_first = (sim.predict(ptype, PartitionConfig(FMAX, n, slot)) for slot in (0, 1))
        assert gemm_first.exposed_comm_s < 1e-4
        assert mem_first.measurement.energy_j > gemm_first.measurement.energy_j
        assert mem_first.measurement.time_s > gemm_first.measurement.time_s


def test_collective_and_memory_bound_kernel_prolong_each_other(sim, attn):
    """The mechanism on the attention partition: beside the collective, RMSNorm runs longer than
    alone, and the collective moves data more slowly beside RMSNorm than beside the QKV GEMM.
    The collective's latency phase is set to zero so that RMSNorm (shorter than the calibrated
    latency) meets the collective's data movement."""
    sim = Simulator(sim.spec, replace(sim.params, comm_latency_s=0.0))
    n = 16
    norm_alone = sim.predict(attn, PartitionConfig(FMAX, n, None), timeline=True)
    norm_beside = sim.predict(attn, PartitionConfig(FMAX, n, NORM), timeline=True)

    def kernel_time(pred, name):
        return sum(s.end_s - s.start_s for s in pred.timeline if s.compute == name)

    assert kernel_time(norm_beside, "rmsnorm") > 1.05 * kernel_time(norm_alone, "rmsnorm")
    # The collective's rate beside each kernel: slowed by the kernel's HBM draw (queueing).
    km, sms = sim.kernels, sim.spec.sm_count - n
    norm, qkv = attn.slots[NORM].ops[0], attn.slots[QKV].ops[0]
    norm_draw = km.kernel(norm.flops, norm.bytes, sms, FMAX).hbm_bytes_per_s
    qkv_draw = km.kernel(qkv.flops, qkv.bytes, sms, FMAX).hbm_bytes_per_s
    assert norm_draw > 3 * qkv_draw
    norm_rates = km.kernel(norm.flops, norm.bytes, sms, FMAX)
    qkv_rates = km.kernel(qkv.flops, qkv.bytes, sms, FMAX)
    norm_kappa, qkv_kappa = (
        km.comm_contention(r.memory_share) / km.hbm_saturation_bytes_per_s for r in (norm_rates, qkv_rates)
    )
    assert 1 / (1 + norm_kappa * norm_draw) < 0.5 / (1 + qkv_kappa * qkv_draw)


def test_lower_clock_moves_the_energy_optimal_launch_slot(sim, attn):
    """3.2.3: the energy-optimal launch slot depends on the clock."""

    def best_slot(clock: int, sms: int) -> int:
        return min(attn.launch_slots, key=lambda s: energy(sim, attn, clock, sms, s))

    moved = [n for n in (4, 8, 12, 16, 20, 24) if best_slot(FMAX, n) != best_slot(1100, n)]
    assert moved, "the energy-optimal launch slot is the same at 1410 and 1100 MHz for every SM count"


def test_overlap_beats_sequential_and_exposed_comm_is_worse_at_low_clock(sim, attn):
    seq = sim.predict(attn, PartitionConfig(FMAX, 8, None))
    ovl = sim.predict(attn, PartitionConfig(FMAX, 8, QKV))
    assert ovl.measurement.time_s < seq.measurement.time_s
    assert ovl.measurement.energy_j < seq.measurement.energy_j
    assert seq.exposed_comm_s > 0 and ovl.exposed_comm_s < seq.exposed_comm_s
    # Lower clock: dynamic energy falls, static grows with time (its share of the total rises).
    low = sim.predict(attn, PartitionConfig(900, 8, None)).measurement
    high = seq.measurement
    assert low.dynamic_energy_j < high.dynamic_energy_j and low.time_s > high.time_s
    assert low.static_energy_j / low.energy_j > high.static_energy_j / high.energy_j


# ----- power model ---------------------------------------------------------------------------------
def test_energy_is_dynamic_plus_static(sim, attn):
    spec = sim.spec
    for cfg in (PartitionConfig(FMAX, 4, QKV), PartitionConfig(1005, 12, None), PartitionConfig(1200, 1, ROPE)):
        m = sim.measure(attn, cfg)
        assert m.energy_j == pytest.approx(m.dynamic_energy_j + m.static_energy_j, rel=1e-12)
        assert m.static_energy_j == pytest.approx(spec.static_power_w * m.time_s, rel=1e-12)
        assert m.dynamic_energy_j > 0


def test_dynamic_power_is_monotonic_in_clock(sim, attn):
    spec = sim.spec
    clocks = list(range(spec.tuning_clock_min_mhz, spec.clock_max_mhz + 1, spec.clock_step_mhz))
    for cfg in (lambda f: PartitionConfig(f, 6, QKV), lambda f: PartitionConfig(f, 6, None)):
        preds = [sim.predict(attn, cfg(f)) for f in clocks]
        power = [p.measurement.dynamic_energy_j / p.measurement.time_s for p in preds]
        for (a, b), p in zip(itertools.pairwise(power), preds[1:]):
            if p.throttled:  # at the cap: dynamic power = TDP - static, flat
                assert b == pytest.approx(spec.tdp_w - spec.static_power_w) and b >= a - 1e-9
            else:
                assert b > a
    v = [sim.power.voltage(f) for f in clocks]
    assert all(b >= a for a, b in itertools.pairwise(v)) and v[-1] == pytest.approx(1.0)


def test_power_capped_at_tdp():
    """A phase that would exceed the TDP runs at the clock where it draws exactly the TDP."""
    base = gpu_params(A100)
    capped = Simulator(replace(base.spec, tdp_w=250.0), base.params)
    free = Simulator(replace(base.spec, tdp_w=1e9), base.params)
    gemm = [OpCost("gemm", "aten.mm.default", 2.0 * 8192 * 8192 * 8192, 3 * 8192 * 8192 * 2.0)]
    c = capped.predict_sequence(gemm, (), FMAX)
    f = free.predict_sequence(gemm, (), FMAX)
    assert c.throttled and not f.throttled
    assert c.clock_mhz < FMAX
    assert c.measurement.time_s > f.measurement.time_s
    assert c.measurement.energy_j / c.measurement.time_s <= 250.0 + 1e-6
    assert f.measurement.energy_j / f.measurement.time_s > 250.0
    # The same through a partition: average power never exceeds the TDP.
    for cfg in (PartitionConfig(FMAX, 4, QKV), PartitionConfig(FMAX, 8, None)):
        m = capped.measure(llama_mlp_partition(), cfg)
        assert m.energy_j / m.time_s <= 250.0 + 1e-6


def test_a40_throttles_near_its_cap():
    """The A40 (300 W) is power-capped at its top clocks: time stops improving there."""
    sim = Simulator("A40")
    gemm = [OpCost("gemm", "aten.mm.default", 2.0 * 8192**3, 3 * 8192 * 8192 * 2.0)]
    top = sim.predict_sequence(gemm, (), sim.spec.clock_max_mhz)
    assert top.throttled and top.measurement.energy_j / top.measurement.time_s <= sim.spec.tdp_w + 1e-6
    low = sim.predict_sequence(gemm, (), 1005)
    assert not low.throttled


# ----- kernel model -------------------------------------------------------------------------------
def test_wave_quantisation_when_sms_are_taken():
    km = KernelModel(gpu_spec(A100), gpu_params(A100).params)
    flops = 216 * km.params.cta_flops  # exactly two waves on 108 SMs
    full = km.kernel(flops, 1e6, 108, FMAX).time_s
    assert km.kernel(flops, 1e6, 107, FMAX).time_s == pytest.approx(1.5 * full, rel=0.02)  # third wave
    assert km.kernel(flops, 1e6, 72, FMAX).time_s == pytest.approx(1.5 * full, rel=0.02)
    assert km.kernel(flops, 1e6, 71, FMAX).time_s == pytest.approx(2.0 * full, rel=0.02)
    # Compute throughput scales with the clock.
    assert km.kernel(flops, 1e6, 108, 705).time_s == pytest.approx(2 * full, rel=0.02)


def test_memory_and_collective_bandwidth_saturate_with_sms():
    spec = gpu_spec(A100)
    km = KernelModel(spec, gpu_params(A100).params)
    bw = [km.memory_bandwidth(n, FMAX) for n in range(1, 109)]
    assert all(b > a for a, b in itertools.pairwise(bw))
    assert bw[3] == pytest.approx(4 * bw[0], rel=0.05)  # linear at few SMs
    assert bw[-1] <= spec.hbm_bandwidth_bytes_per_s and bw[-1] > 0.7 * spec.hbm_bandwidth_bytes_per_s
    assert bw[-1] - bw[79] < 0.1 * bw[-1]  # saturated
    coll = CollectiveSpec("all_reduce", 32 * 2**20, 2)
    t = [km.collective_time(coll, n, FMAX) for n in range(1, 31)]  # Kareus's MSCCL++ kernel (the default)
    assert all(b < a for a, b in itertools.pairwise(t))
    assert t[0] / t[1] > 1.6 and t[-2] / t[-1] < 1.05  # halves at first, flat at the end


def test_nccl_collective_runs_on_nccls_measured_curve():
    """An NCCL collective's bus bandwidth is NanoFlow's measured 8-GPU curve (between the 16- and
    32-CTA reduce-scatter runs at 24 CTAs), the same for every group size inside the node, and not
    the MSCCL++ kernel's, which grows with the peers and reaches the link cap on the same SMs."""
    entry = gpu_params(A100)
    km = KernelModel(gpu_spec(A100), entry.params)
    measured_gbps = entry.provenance["collective_shape"]["bus_bandwidth_GBps"]
    sms = entry.params.default_comm_sms
    rs = [
        km.collective_bandwidth(CollectiveSpec("reduce_scatter", 64 * 2**20, g), sms, FMAX, "nccl") / 1e9
        for g in (2, 4, 8)
    ]
    assert measured_gbps["reduce_scatter_16"] < rs[0] < measured_gbps["reduce_scatter_32"]
    assert rs[0] == pytest.approx(rs[1], rel=1e-12) and rs[0] == pytest.approx(rs[2], rel=1e-12)
    tp8 = CollectiveSpec("all_reduce", 128 * 2**20, 8)
    nccl, mscclpp = km.collective_bandwidth(tp8, sms, FMAX, "nccl"), km.collective_bandwidth(tp8, sms, FMAX, "mscclpp")
    assert nccl < 0.95 * mscclpp  # the MSCCL++ kernel reaches the link cap with these SMs, NCCL does not


def test_partition_config_library_prices_the_collective(sim, attn):
    """The same (clock, SMs, slot) with NCCL and with MSCCL++ are two configurations: a TP8
    collective on 24 SMs is slower on NCCL (the baselines' library) than on Kareus's tuned kernel,
    and a sequence runs NCCL unless told otherwise."""
    tp8 = replace(attn, collective=CollectiveSpec("all_reduce", 128 * 2**20, 8))
    sms = sim.params.default_comm_sms
    nccl = sim.predict(tp8, PartitionConfig(FMAX, sms, None, "nccl")).exposed_comm_s  # sequential: all exposed
    mscclpp = sim.predict(tp8, PartitionConfig(FMAX, sms, None, "mscclpp")).exposed_comm_s
    assert nccl > 1.1 * mscclpp
    assert PartitionConfig(FMAX, sms, None).comm_library == "mscclpp"
    ops, colls = [op for slot in tp8.slots for op in slot.ops], [tp8.collective]
    default = sim.predict_sequence(ops, colls, FMAX).measurement.time_s
    assert default == sim.predict_sequence(ops, colls, FMAX, comm_library="nccl").measurement.time_s
    assert default > sim.predict_sequence(ops, colls, FMAX, comm_library="mscclpp").measurement.time_s


def test_collective_and_memory_kernel_slow_each_other(sim, attn):
    """Beside a memory-bound kernel the collective ends later than beside a compute-bound one."""
    norm_first = sim.predict(attn, PartitionConfig(FMAX, 16, NORM), timeline=True)
    comm_end = max(s.end_s for s in norm_first.timeline if s.comm)
    alone = sim.kernels.collective_time(attn.collective, 16, FMAX)
    assert comm_end > 1.2 * alone


# ----- sequential, non-partitioned work and whole microbatches --------------------------------------
def test_sequential_is_compute_then_collective_alone(sim, attn):
    ops = [op for slot in attn.slots for op in slot.ops]
    seq = sim.predict(attn, PartitionConfig(1200, 8, None)).measurement
    parts = sim.predict_sequence(ops, [attn.collective], 1200, comm_sms=8, comm_library="mscclpp").measurement
    assert seq.time_s == pytest.approx(parts.time_s, rel=1e-9)
    assert seq.energy_j == pytest.approx(parts.energy_j, rel=1e-9)
    only_ops = sim.predict_sequence(ops, (), 1200).measurement
    comm = sim.kernels.collective_time(attn.collective, 8, 1200)
    assert seq.time_s == pytest.approx(only_ops.time_s + comm, rel=1e-9)


def test_microbatch_sums_partitions_and_other_work(sim):
    attn = llama_attention_partition(count=28)
    mlp = llama_mlp_partition(count=28)
    head = [OpCost("lm_head", "aten.mm.default", 2.0 * 16384 * 3072 * 32064, 2.0 * (16384 * 3072 + 3072 * 32064))]
    mb = sim.predict_microbatch([attn, mlp], 1200, comm_sms=8, other_ops=head).measurement
    a = sim.predict(attn, PartitionConfig(1200, 8, None, "nccl")).measurement  # un-split: NCCL
    m = sim.predict(mlp, PartitionConfig(1200, 8, None, "nccl")).measurement
    h = sim.predict_sequence(head, (), 1200).measurement
    assert mb.time_s == pytest.approx(28 * (a.time_s + m.time_s) + h.time_s, rel=1e-9)
    assert mb.energy_j == pytest.approx(28 * (a.energy_j + m.energy_j) + h.energy_j, rel=1e-9)


def test_rejects_bad_configs(sim, attn):
    with pytest.raises(ValueError, match="clock"):
        sim.measure(attn, PartitionConfig(2000, 4, 0))
    with pytest.raises(ValueError, match="comm_sms"):
        sim.measure(attn, PartitionConfig(FMAX, 0, 0))
    with pytest.raises(ValueError, match="launch_slot"):
        sim.measure(attn, PartitionConfig(FMAX, 4, 9))


# ----- profiler ------------------------------------------------------------------------------------
def test_simulated_profiler_noise_is_seeded_and_reproducible(attn):
    configs = [PartitionConfig(f, n, s) for f in (1200, 1410) for n in (2, 8) for s in (None, 1, 3)]
    exact = SimulatedProfiler(A100)
    a = SimulatedProfiler(A100, noise_std=0.03, seed=7)
    b = SimulatedProfiler(A100, noise_std=0.03, seed=7)
    c = SimulatedProfiler(A100, noise_std=0.03, seed=8)
    ma = [a.measure(attn, cfg) for cfg in configs]
    mb = [b.measure(attn, cfg) for cfg in reversed(configs)][::-1]  # order does not matter
    assert ma == mb
    assert ma != [c.measure(attn, cfg) for cfg in configs]
    again = [a.measure(attn, cfg) for cfg in configs]  # a repeat is a new draw, itself reproducible
    assert again != ma and again == [b.measure(attn, cfg) for cfg in configs]
    for m, cfg in zip(ma, configs):
        e = exact.measure(attn, cfg)
        assert m.energy_j == pytest.approx(m.dynamic_energy_j + m.static_energy_j)
        assert abs(m.time_s / e.time_s - 1) < 0.2
    rel = np.array([m.time_s / exact.measure(attn, cfg).time_s - 1 for m, cfg in zip(ma, configs)])
    assert 0 < np.std(rel) < 0.1
    assert exact.measure(attn, configs[0]) == Simulator(A100).measure(attn, configs[0])
    assert a.kind != exact.kind and a.kind == b.kind and a.gpu_name == A100


def test_every_known_gpu_simulates(attn):
    for gpu in ("A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM-141GB", "A40"):
        sim = Simulator(gpu)
        m = sim.measure(attn, PartitionConfig(sim.spec.clock_max_mhz, 8, 1))
        assert m.time_s > 0 and m.dynamic_energy_j > 0
    assert (
        Simulator("H100-SXM5-80GB").measure(attn, PartitionConfig(1980, 8, 1)).time_s
        < Simulator(A100).measure(attn, PartitionConfig(1410, 8, 1)).time_s
    )


def test_memory_share_of_an_extreme_kernel_is_finite():
    """A kernel whose compute time dwarfs its memory time by 1e200 (a corrupt or fuzzed plan's
    costs) is compute-bound, not an OverflowError; ordinary kernels keep the smooth roofline's share."""
    assert memory_share(1e100, 1e-100, 4.0) == 0.0
    assert memory_share(1e-100, 1e100, 4.0) == 1.0
    assert memory_share(2.0, 1.0, 4.0) == pytest.approx(1.0 / 17.0)


def test_a_throttle_swing_costs_energy_at_the_same_power():
    """Paper Appendix A: a clock that swings around its average costs more dynamic energy than a
    steady clock with that average. Under the cap the swing's average power meets the TDP, so the
    swinging GPU runs at a lower average clock (slower) for the same power; a swing of 0 is the
    steady clock at the cap; a request just over the cap barely swings (the swing stays below the
    requested clock), and the cost grows with the request up to the full swing."""
    base = gpu_params(A100)
    spec = replace(base.spec, tdp_w=300.0)  # caps a GEMM near 1,150 MHz, above the voltage knee
    gemm = [OpCost("gemm", "aten.mm.default", 2.0 * 8192 * 8192 * 8192, 3 * 8192 * 8192 * 2.0)]
    steady = Simulator(spec, replace(base.params, throttle_swing_mhz=0.0))
    swinging = Simulator(spec, replace(base.params, throttle_swing_mhz=150.0))
    s, w = steady.predict_sequence(gemm, (), FMAX), swinging.predict_sequence(gemm, (), FMAX)
    assert s.throttled and w.throttled
    for p in (s, w):  # both draw the cap on average
        assert p.measurement.energy_j / p.measurement.time_s == pytest.approx(300.0, rel=1e-9)
    assert w.clock_mhz < s.clock_mhz - 1.0 and w.measurement.time_s > s.measurement.time_s
    # At the swing's average clock, a steady clock costs less dynamic energy than the swing.
    same_average = steady.predict_sequence(gemm, (), w.clock_mhz)
    assert not same_average.throttled
    assert same_average.measurement.time_s == pytest.approx(w.measurement.time_s, rel=1e-9)
    assert same_average.measurement.dynamic_energy_j < w.measurement.dynamic_energy_j
    # The swing stays below the requested clock: just over the cap it is a step or two.
    levels = swinging.power.throttle_swing(s.clock_mhz, s.clock_mhz + 20.0)
    assert max(level for level, _ in levels) <= s.clock_mhz + 20.0
    assert sum(weight for _, weight in levels) == pytest.approx(1.0)
    assert sum(level * weight for level, weight in levels) == pytest.approx(s.clock_mhz)
    # A request further over the cap swings wider: a lower average clock, slower (the A40 profile's
    # backward above 1,455 MHz is slower than at it).
    requests = [s.clock_mhz + 15.0, s.clock_mhz + 75.0, s.clock_mhz + 150.0]
    assert requests[-1] <= FMAX
    clocks = [swinging.predict_sequence(gemm, (), f).clock_mhz for f in requests]
    assert clocks[0] > clocks[1] > clocks[2] == pytest.approx(w.clock_mhz, abs=1.0)


def test_param_overrides_replace_calibrated_values_and_key_the_profile_database(monkeypatch):
    from kareus_fx.cost_models.sim_params import OVERRIDES_ENV, clear_cache

    calibrated = SimulatedProfiler("A100-SXM4-40GB")
    assert calibrated.simulator.params.throttle_swing_mhz > 0
    monkeypatch.setenv(OVERRIDES_ENV, '{"throttle_swing_mhz": 0}')
    clear_cache()
    try:
        steady = SimulatedProfiler("A100-SXM4-40GB")
        assert steady.simulator.params.throttle_swing_mhz == 0
        assert gpu_params("A100-SXM4-40GB").provenance["overridden"] == {"throttle_swing_mhz": 0}
        assert steady.kind != calibrated.kind  # measurements never mix in one database
        monkeypatch.setenv(OVERRIDES_ENV, '{"no_such_param": 1}')
        clear_cache()
        with pytest.raises(ValueError, match="no_such_param"):
            gpu_params("A100-SXM4-40GB")
    finally:
        monkeypatch.delenv(OVERRIDES_ENV)
        clear_cache()
