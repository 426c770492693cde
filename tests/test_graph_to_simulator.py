"""Graph to cost model: partition types traced from a reference model feed the simulator.

The times and energies here are the simulated A100's (a cost model calibrated on measured data),
not measurements.
"""

from __future__ import annotations

import pytest

from kareus_fx.capture.dump import load_dump, partition_types_from_dump
from kareus_fx.capture.tracing import TraceSpec, trace_full_size
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.workload import PartitionConfig


@pytest.fixture(scope="module")
def llama_types(tmp_path_factory):
    out = tmp_path_factory.mktemp("dump")
    spec = TraceSpec(model="llama3.2-3b", tp=8, mbs=8, seq=4096, layers=4)
    (path,) = trace_full_size(spec, options={"dump_dir": str(out)}).dump_paths
    return partition_types_from_dump(load_dump(path))


def test_dump_round_trips_partition_types(llama_types):
    assert sorted(t.graph for t in llama_types.values()) == ["backward", "backward", "forward", "forward"]
    for ptype in llama_types.values():
        assert ptype.collective.kind == "all_reduce" and ptype.collective.group_size == 8
        assert all(op.bound in ("compute", "memory") for slot in ptype.slots for op in slot.ops)
        assert ptype.launch_slots


def test_simulator_prefers_overlap_to_sequential_on_traced_types(llama_types):
    profiler = SimulatedProfiler("A100-SXM4-40GB")
    for ptype in llama_types.values():
        sequential = profiler.measure(ptype, PartitionConfig(clock_mhz=1410, comm_sms=24, launch_slot=None))
        overlapped = min(
            (
                profiler.measure(ptype, PartitionConfig(clock_mhz=1410, comm_sms=sms, launch_slot=slot))
                for slot in ptype.launch_slots
                for sms in (6, 12, 18)
            ),
            key=lambda m: m.time_s,
        )
        assert overlapped.time_s < sequential.time_s, ptype.type_id
        assert sequential.energy_j == pytest.approx(sequential.dynamic_energy_j + sequential.static_energy_j)
