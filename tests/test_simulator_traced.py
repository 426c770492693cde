"""Paper section 3's effects on a traced partition: Llama-3.2-3B's forward attention sub-layer.

``test_simulator.py`` shows the effects on hand-built partitions; here the partition type comes
from a real trace (meta device, fake process group): Llama-3.2-3B at TP=4 (the paper's Figure 3),
microbatch 8 (nanobatch 4), sequence 4096, 4 layers (partition types do not depend on the layer
count). Every time and energy is the simulated A100's (a calibrated cost model).

The traced sub-layer differs from the hand-built one: its kernels are Inductor's fusion of the
aten graph (``passes/kernel_groups.py``): the residual add and RMSNorm run as one memory-bound
slot, the RoPE of Q and K as another, and a memory-bound ``clone`` slot follows the attention.
Slots are found by their roofline label (``SlotSpec.bound``, from arithmetic intensity),
never by index.
"""

from __future__ import annotations

import pytest

from kareus_fx.capture.dump import load_dump
from kareus_fx.capture.tracing import TraceSpec, trace_full_size
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.plan.graph_workload import partitioned_graphs
from kareus_fx.tuner.space import comm_sm_grid
from kareus_fx.workload import PartitionConfig, PartitionType

A100 = "A100-SXM4-40GB"
FMAX = 1410
LOW_CLOCK_MHZ = 1100
"""The lower clock of the paper's Figure 3e/3f."""
ATTENTION = "kareus.attention.default"
SM_SWEEP = range(1, 31)


@pytest.fixture(scope="module")
def attn(tmp_path_factory) -> PartitionType:
    """The forward partition type whose computation holds the attention kernel (about 10 s to trace)."""
    spec = TraceSpec(model="llama3.2-3b", tp=4, mbs=8, seq=4096, layers=4)
    (path,) = trace_full_size(spec, options={"dump_dir": str(tmp_path_factory.mktemp("dump")), "gpu": A100}).dump_paths
    forward = partitioned_graphs(load_dump(path))["forward"]
    (ptype,) = [t for t in forward.ptypes if any(op.target == ATTENTION for s in t.slots for op in s.ops)]
    nanobatch_output_bytes = 4 * 4096 * 3072 * 2  # bf16 [nanobatch 4, seq, hidden]
    assert ptype.collective.kind == "all_reduce" and ptype.collective.group_size == 4
    assert ptype.collective.bytes == nanobatch_output_bytes
    return ptype


@pytest.fixture(scope="module")
def sim() -> Simulator:
    return Simulator(A100)


def energy_j(sim: Simulator, ptype: PartitionType, clock_mhz: int, sms: int, slot: int) -> float:
    return sim.measure(ptype, PartitionConfig(clock_mhz, sms, slot)).energy_j


def norm_and_linear_slots(ptype: PartitionType) -> tuple[int, int]:
    """The launch slots of Figure 3d and 3b: the memory-bound slot moving the most bytes (the
    RMSNorm block) and the first compute-bound slot after it (the QKV linear)."""
    memory = [i for i in ptype.launch_slots if ptype.slots[i].bound == "memory"]
    norm = max(memory, key=lambda i: ptype.slots[i].bytes)
    linear = next(i for i in ptype.launch_slots if i > norm and ptype.slots[i].bound == "compute")
    return norm, linear


def best_sms(sim: Simulator, ptype: PartitionType, clock_mhz: int, slot: int) -> int:
    return min(SM_SWEEP, key=lambda n: energy_j(sim, ptype, clock_mhz, n, slot))


def _slot_time_s(prediction, ptype: PartitionType, slot: int) -> float:
    names = {op.name for op in ptype.slots[slot].ops}
    return sum(s.end_s - s.start_s for s in prediction.timeline if s.compute in names)


def _collective_time_s(prediction) -> float:
    comm = [s for s in prediction.timeline if s.comm]
    return max(s.end_s for s in comm) - min(s.start_s for s in comm)


def test_interior_comm_sm_count_minimises_energy_at_max_clock(sim, attn):
    """3.2.1 (collective launched with the QKV linear): too few SMs expose the collective, too
    many slow the computation beside it."""
    _, linear = norm_and_linear_slots(attn)
    e = {n: energy_j(sim, attn, FMAX, n, linear) for n in SM_SWEEP}
    best = best_sms(sim, attn, FMAX, linear)
    assert SM_SWEEP[0] < best < SM_SWEEP[-1], f"energy-optimal SM count {best} is at the edge: {e}"
    assert e[SM_SWEEP[0]] > 1.05 * e[best] and e[SM_SWEEP[-1]] > 1.01 * e[best], e
    few, opt, many = (
        sim.predict(attn, PartitionConfig(FMAX, n, linear), timeline=True) for n in (SM_SWEEP[0], best, SM_SWEEP[-1])
    )
    assert few.exposed_comm_s > 5 * opt.exposed_comm_s
    # Too many: the collective stays hidden, but the linear beside it runs on fewer SMs.
    assert many.exposed_comm_s < 0.1 * few.exposed_comm_s
    assert _slot_time_s(many, attn, linear) > 1.03 * _slot_time_s(opt, attn, linear)
    assert many.measurement.time_s > opt.measurement.time_s


@pytest.mark.xfail(
    strict=True,
    reason=(
        "with the contention fitted end to end on the Llama rows (calibration step 6) and steps 3-5 fitted "
        "again, the norm slot beside the collective runs 1.010x its time alone, below the 1.03x of the paper's "
        "Figure 3d: the calibration rows and the Kareus attention partition leave the collective's HBM draw "
        "smaller than that figure shows"
    ),
)
def test_memory_bound_launch_slot_runs_longer_at_max_clock(sim, attn):
    """3.2.2 (Figure 3d vs 3b): launched with the RMSNorm block, the collective and the norm
    compete for HBM and both run longer than beside the QKV linear."""
    norm, linear = norm_and_linear_slots(attn)
    intensity = {i: attn.slots[i].flops / attn.slots[i].bytes for i in (norm, linear)}  # FLOP per byte
    assert intensity[norm] < 1 and intensity[linear] > 100, intensity
    best = best_sms(sim, attn, FMAX, linear)
    with_norm, with_linear, alone = (
        sim.predict(attn, PartitionConfig(FMAX, best, slot), timeline=True) for slot in (norm, linear, None)
    )
    assert _slot_time_s(with_norm, attn, norm) > 1.03 * _slot_time_s(alone, attn, norm)
    # Beside the fused norm (one short slot) the collective runs about 1.24x as long as beside
    # the linear; 1.3x before fusion, when the norm slot moved ten times the bytes.
    assert _collective_time_s(with_norm) > 1.1 * _collective_time_s(with_linear)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "on the middle layer's partition (the type's exemplar) the simulated A100 prices the norm "
        "launch within -0.5 % to +0.4 % of the linear launch at 11-30 SMs (below the linear launch at 12, 13, "
        "29 and 30); on the first layer's it was +0.06 % to +0.7 %. The paper's Figure 3d vs 3b gap needs "
        "more contention than the calibrated model has"
    ),
)
def test_memory_bound_launch_slot_costs_more_at_max_clock(sim, attn):
    """3.2.2 (Figure 3d vs 3b): launched with the QKV linear the collective costs less energy than
    launched with the RMSNorm block, at every SM count from the one that minimises the linear
    launch's energy up.

    Below that count the collective is exposed at the end whichever slot launches it, and
    launching it a slot earlier (with the norm) wins on exposure; the test states the effect
    where the collective is hidden, as in the paper's figure."""
    norm, linear = norm_and_linear_slots(attn)
    best = best_sms(sim, attn, FMAX, linear)
    for n in range(best, SM_SWEEP[-1] + 1):
        assert energy_j(sim, attn, FMAX, n, norm) > energy_j(sim, attn, FMAX, n, linear), n


@pytest.mark.xfail(
    strict=True,
    reason=(
        "with fused kernels and the split contention the simulated A100's optimum "
        "launches with the memory-bound RoPE slot at both 1,410 and 1,100 MHz (python bench/section3_traced.py "
        "--tp 4 --clocks 1410 1100), so the clock does not move it as in the paper's Figure 3f"
    ),
)
def test_lower_clock_moves_the_energy_optimal_launch_slot(sim, attn):
    """3.2.3 (Figure 3b vs 3f): over the tuner's (SM count, launch slot) space, the energy-optimal
    schedule launches the collective with a compute-bound kernel at the maximum clock and with a
    memory-bound one at 1,100 MHz, where the compute-bound kernels are slower and losing SMs to
    the collective costs them more."""
    grid = comm_sm_grid(gpu_spec(A100), attn.collective.group_size)

    def optimum(clock_mhz: int) -> tuple[int, int]:
        return min(((n, s) for n in grid for s in attn.launch_slots), key=lambda c: energy_j(sim, attn, clock_mhz, *c))

    (_, fast_slot), (_, slow_slot) = optimum(FMAX), optimum(LOW_CLOCK_MHZ)
    assert fast_slot != slow_slot
    assert attn.slots[fast_slot].bound == "compute" and attn.slots[slow_slot].bound == "memory"
