"""A collective's SMs draw their own SM-active power."""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

import pytest

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.power_model import PowerModel
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.workload import CollectiveSpec, OpCost, PartitionConfig, PartitionType, SlotSpec

A100 = "A100-SXM4-40GB"
FMAX = 1410
ALL_REDUCE = CollectiveSpec("all_reduce", 64 * 2**20, group_size=8)


def _sim(comm_w: float | None = None) -> Simulator:
    spec = replace(gpu_spec(A100), tdp_w=float("inf"))  # no throttling: energies stay linear
    params = gpu_params(A100).params
    if comm_w is not None:
        params = replace(params, comm_sm_active_power_w=comm_w)
    return Simulator(spec, params)


def test_exposed_collective_charges_its_sms_at_the_collective_coefficient():
    """A collective alone on NCCL's 24 SMs: its SM-seconds are 24/108 of its time, priced at the
    collective's coefficient only; the compute SM term stays empty."""
    lo, hi = _sim(0.0), _sim(400.0)
    a = lo.predict_sequence([], [ALL_REDUCE], FMAX, comm_sms=24)
    b = hi.predict_sequence([], [ALL_REDUCE], FMAX, comm_sms=24)
    assert a.terms.time_s == b.terms.time_s  # power, not time
    assert a.terms.sm_clock_s == 0.0
    assert a.terms.comm_sm_clock_s == pytest.approx(24 / 108 * a.terms.time_s)  # max clock: scale 1
    assert b.measurement.energy_j - a.measurement.energy_j == pytest.approx(400.0 * a.terms.comm_sm_clock_s)


def test_overlap_splits_sm_seconds_between_compute_and_collective():
    """Beside a GEMM the collective's 6 SMs are counted apart from the GEMM's resident SMs; the
    energy moves with the collective's coefficient by exactly its SM-seconds."""
    params = gpu_params(A100).params
    mm = OpCost("mm", "aten.mm.default", 216 * params.cta_flops, 1e6)
    ptype = PartitionType("t", "forward", (SlotSpec((mm,)),), ALL_REDUCE, 1, (0,))
    config = PartitionConfig(clock_mhz=FMAX, comm_sms=6, launch_slot=0)
    lo, hi = _sim(0.0).predict(ptype, config), _sim(300.0).predict(ptype, config)
    assert lo.terms.time_s == hi.terms.time_s
    comm_alone = _sim().predict_sequence([], [ALL_REDUCE], FMAX, comm_sms=6, comm_library="mscclpp")
    # 6 of 108 SMs for at least the collective's standalone time (it slows beside the GEMM).
    assert lo.terms.comm_sm_clock_s >= 6 / 108 * comm_alone.terms.time_s * 0.99
    assert lo.terms.comm_sm_clock_s <= 6 / 108 * lo.terms.time_s
    assert hi.measurement.energy_j - lo.measurement.energy_j == pytest.approx(300.0 * lo.terms.comm_sm_clock_s)
    gemm_alone = _sim().predict_sequence([mm], (), FMAX)
    assert lo.terms.sm_clock_s <= gemm_alone.terms.sm_clock_s * 1.02  # the GEMM's CTA-time only


def test_collective_sm_power_scales_with_clock_and_voltage_like_the_compute_sms():
    spec, params = gpu_spec(A100), gpu_params(A100).params
    power = PowerModel(spec, params)
    for clock in (1410, 1200, 900):
        base = power.phase_power_w(clock, 0.0, 0.0, 0.0)
        comm = power.phase_power_w(clock, 0.0, 0.0, 0.0, comm_sm_frac=24 / 108)
        assert comm - base == pytest.approx(power.clock_scale(clock) * params.comm_sm_active_power_w * 24 / 108)


def test_calibrated_collective_sm_power_is_fitted_and_below_a_compute_sms():
    """The A100 entry carries the fitted coefficient (calibration step 4 lists it), at most a
    compute SM's: a collective's CTA issues loads, stores and adds, no tensor-core work."""
    text = resources.files("kareus_fx.cost_models").joinpath("data/calibrated_params.json").read_text()
    entry = json.loads(text)["gpus"][A100]
    assert "comm_sm_active_power_w" in entry["provenance"]["power_and_clock"]["method"]
    p = entry["params"]
    assert 0.0 < p["comm_sm_active_power_w"] <= p["sm_active_power_w"]
