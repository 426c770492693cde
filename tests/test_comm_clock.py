"""A collective's per-SM rate follows the clock by its own exponent, a prior of 0."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.cost_models.kernel_model import KernelModel
from kareus_fx.cost_models.sim_params import SimParams, gpu_params
from kareus_fx.workload import CollectiveSpec

A100 = "A100-SXM4-40GB"
TP8_NANOBATCH = CollectiveSpec("all_reduce", 6 * 4096 * 2048 * 2, group_size=8)


def _km(**changes: float) -> KernelModel:
    return KernelModel(gpu_spec(A100), replace(gpu_params(A100).params, **changes))


def test_prior_is_clock_independent_for_both_libraries():
    assert SimParams().comm_clock_exponent == 0.0
    km = _km()
    for sms, library in ((3, "mscclpp"), (24, "nccl")):
        fast = km.collective_time(TP8_NANOBATCH, sms, 1410, library)
        assert km.collective_time(TP8_NANOBATCH, sms, 900, library) == pytest.approx(fast)


def test_exponent_one_slows_an_sm_bound_collective_and_not_a_link_bound_one():
    km = _km(comm_clock_exponent=1.0)
    few = km.collective_time(TP8_NANOBATCH, 3, 1080, "mscclpp") / km.collective_time(TP8_NANOBATCH, 3, 1410, "mscclpp")
    many = km.collective_time(TP8_NANOBATCH, 12, 1080, "mscclpp") / km.collective_time(
        TP8_NANOBATCH, 12, 1410, "mscclpp"
    )
    assert 1.15 < few < 1410 / 1080 + 1e-9  # SM bound: close to the clock ratio, never beyond it
    assert many < 1.01  # 12 SMs sit at 2.4x the link cap: the cap sets the time


def test_collective_exponent_leaves_memory_bound_kernels_alone():
    base, comm = _km(), _km(comm_clock_exponent=1.0)
    nbytes = 512 * 2**20
    for sms in (8, 108):
        assert comm.kernel(0.0, nbytes, sms, 1080).time_s == base.kernel(0.0, nbytes, sms, 1080).time_s
