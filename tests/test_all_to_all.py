"""The all-to-all's two lanes: NVLink inside a node, the node network's share per GPU across nodes,
calibrated on DeepEP's measurements (``data/calibration/deepep``)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from kareus_fx.cost_models.all_to_all import all_to_all_lanes, all_to_all_split
from kareus_fx.cost_models.all_to_all_fit import DEEPEP_FILE, FIELDS, load_rows, predicted_bandwidths
from kareus_fx.cost_models.analytic_workloads import gemm
from kareus_fx.cost_models.calibration import A40_SPEC
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.kernel_model import KernelModel
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.workload import CollectiveSpec, PartitionConfig, PartitionType, SlotSpec

A100 = "A100-SXM4-40GB"
H100 = "H100-SXM5-80GB"
BUFFER_BYTES = 4096 * 8 * 7168 * 2  # 4096 tokens, top-8, hidden 7168, BF16
DEEPEP_TOLERANCE = 0.08
"""Largest relative error allowed on a DeepEP row: the fit leaves at most about 6 % (combine EP8)."""


def _a2a(group: int, nbytes: float = BUFFER_BYTES) -> CollectiveSpec:
    return CollectiveSpec("all_to_all", nbytes, group_size=group)


def _km(name: str) -> KernelModel:
    loaded = gpu_params(name)
    return KernelModel(loaded.spec, loaded.params)


def test_fitted_model_reproduces_the_deepep_rows():
    rows = load_rows()
    assert len(rows) == 8 and {r.ep for r in rows} == {8, 16, 32, 64}
    predicted = predicted_bandwidths(gpu_params(A100).params, rows)
    errors = {row.label: bw / row.bandwidth_bytes_per_s - 1.0 for row, bw, _ in predicted}
    assert max(abs(e) for e in errors.values()) < DEEPEP_TOLERANCE, errors
    lanes = {row.ep: lane for row, _, lane in predicted}
    # Inside a node NVLink; EP16's NVLink forwarding is its slower lane; EP32/EP64 the network.
    assert lanes == {8: "NVLink", 16: "NVLink", 32: "network", 64: "network"}


def test_packaged_parameters_hold_the_step_7_fit_with_its_provenance():
    loaded = gpu_params(A100)
    prov = loaded.provenance["all_to_all"]
    assert prov["file"] == DEEPEP_FILE and len(prov["rows"]) == 8
    assert prov["max_abs_rel_error"] < DEEPEP_TOLERANCE
    assert 0.5 < loaded.params.all_to_all_nvlink_efficiency <= 1.0
    assert 0.5 < loaded.params.all_to_all_network_efficiency <= 1.0
    for name in FIELDS:  # carried unchanged to derived GPUs
        assert getattr(gpu_params(H100).params, name) == getattr(loaded.params, name)


def test_split_is_node_contiguous_and_takes_each_lanes_worst_rank():
    h100 = gpu_spec(H100)
    inside = all_to_all_split(h100, 8)
    assert (inside.nodes, inside.ranks_per_node, inside.nvlink_fraction, inside.network_fraction) == (1, 8, 7 / 8, 0)
    two = all_to_all_split(h100, 16)
    assert (two.nodes, two.nvlink_fraction, two.network_fraction) == (2, 7 / 16, 8 / 16)
    partial = all_to_all_split(h100, 12)  # 8 + 4 ranks: the 4-rank node sends 8/12 off-node
    assert (partial.nodes, partial.nvlink_fraction, partial.network_fraction) == (2, 7 / 12, 8 / 12)
    unknown = all_to_all_split(A40_SPEC, 16)  # no node entry: one node
    assert (unknown.nodes, unknown.network_fraction) == (1, 0.0)


def test_a_group_spanning_nodes_runs_at_the_network_share_and_is_slower_per_byte():
    km = _km(H100)
    p = km.params
    sms, clock = p.default_comm_sms, km.spec.clock_max_mhz
    across = km.collective_time(_a2a(32), sms, clock)
    share = km.spec.node_network_share_bytes_per_s
    assert share is not None and share == pytest.approx(3200e9 / 8 / 8)
    expected = p.all_to_all_latency_s + BUFFER_BYTES * 24 / 32 / (p.all_to_all_network_efficiency * share)
    assert across == pytest.approx(expected, rel=1e-12)
    inside = km.collective_time(_a2a(8), sms, clock)
    bus_across, bus_inside = km.bus_bytes(_a2a(32)), km.bus_bytes(_a2a(8))
    assert across / bus_across > 3 * inside / bus_inside


def test_more_sms_help_inside_a_node_up_to_the_cap():
    km = _km(H100)
    p, clock = km.params, km.spec.clock_max_mhz
    cap = p.all_to_all_nvlink_efficiency * km.spec.nvlink_bandwidth_bytes_per_s
    for library in ("mscclpp", "nccl"):
        times = [km.collective_time(_a2a(8), sms, clock, library) for sms in (1, 2, 4, 8, 16, 32, 64)]
        assert all(a > b for a, b in itertools.pairwise(times)), (library, times)
        assert times[0] > 2 * times[-1]
        assert km.collective_bandwidth(_a2a(8), 64, clock, library) == pytest.approx(cap, rel=0.01)
        assert km.collective_bandwidth(_a2a(8), 132, clock, library) <= cap


def test_nccl_curve_prices_an_all_to_all_on_its_lanes():
    km = _km(H100)
    clock = km.spec.clock_max_mhz
    for group in (8, 32):
        assert km.nccl_bandwidth(_a2a(group), 24, clock) == km.collective_bandwidth(_a2a(group), 24, clock, "nccl")


def test_across_nodes_sms_do_not_limit_the_network_lane():
    km = _km(H100)
    clock = km.spec.clock_max_mhz
    assert km.collective_time(_a2a(64), 16, clock) == pytest.approx(km.collective_time(_a2a(64), 64, clock))


def test_a100_and_h100_scale_with_their_node_networks():
    a100, h100 = _km(A100), _km(H100)
    latency = a100.params.all_to_all_latency_s
    assert h100.params.all_to_all_latency_s == latency
    t_a100 = a100.collective_time(_a2a(16), 24, a100.spec.clock_max_mhz) - latency
    t_h100 = h100.collective_time(_a2a(16), 24, h100.spec.clock_max_mhz) - latency
    assert t_a100 / t_h100 == pytest.approx(3200 / 400, rel=1e-9)  # 400 Gbps against 3200 Gbps a node


def test_group_of_one_costs_nothing():
    km = _km(H100)
    assert km.collective_time(_a2a(1), 24, km.spec.clock_max_mhz) == 0.0
    assert km.collective_bandwidth(_a2a(1), 24, km.spec.clock_max_mhz) > 0.0


def test_other_kinds_ignore_the_all_to_all_parameters():
    loaded = gpu_params(H100)
    changed = replace(
        loaded.params, all_to_all_nvlink_efficiency=0.1, all_to_all_network_efficiency=0.1, all_to_all_latency_s=1.0
    )
    base, other = KernelModel(loaded.spec, loaded.params), KernelModel(loaded.spec, changed)
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        coll = CollectiveSpec(kind, BUFFER_BYTES, group_size=8)
        for library in ("mscclpp", "nccl"):
            assert other.collective_time(coll, 12, 1980, library) == base.collective_time(coll, 12, 1980, library)


def test_lanes_state_the_assumption():
    h100 = gpu_spec(H100)
    params = gpu_params(H100).params
    lanes = all_to_all_lanes(h100, _a2a(32))
    assert lanes["nodes"] == 4 and lanes["off_node_fraction"] == pytest.approx(0.75)
    assert lanes["network_share_bytes_per_s"] == pytest.approx(50e9)
    assert lanes["network_lane_bytes_per_s"] == pytest.approx(params.all_to_all_network_efficiency * 50e9)
    assert lanes["nvlink_lane_cap_bytes_per_s"] == pytest.approx(
        params.all_to_all_nvlink_efficiency * h100.nvlink_bandwidth_bytes_per_s
    )
    assert "uniform routing" in lanes["assumption"]


def test_the_simulated_partition_runs_the_all_to_all_with_its_own_latency():
    loaded = gpu_params(H100)
    params = replace(loaded.params, all_to_all_latency_s=1e-3)
    sim, km = Simulator(loaded.spec, params), KernelModel(loaded.spec, params)
    ptype = PartitionType("experts", "forward", (SlotSpec((gemm("expert", 4096, 2048, 768),)),), _a2a(16), 1, (0,))
    sequential = sim.predict(ptype, PartitionConfig(loaded.spec.clock_max_mhz, 24, None))
    expected = km.collective_time(_a2a(16), 24, loaded.spec.clock_max_mhz)
    assert expected > 1e-3 + 1e-4
    assert sequential.exposed_comm_s == pytest.approx(expected, rel=1e-9)
