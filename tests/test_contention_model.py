"""The collective's contention model: beside compute-bound and beside memory-bound kernels."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kareus_fx.cost_models import calibration
from kareus_fx.cost_models.kernel_model import memory_share
from kareus_fx.cost_models.sim_params import SimParams, gpu_params
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.plan.presets import PRESETS


def test_memory_share_runs_from_compute_bound_to_memory_bound():
    assert memory_share(1.0, 0.0, 4.0) == 0.0
    assert memory_share(0.0, 1.0, 4.0) == 1.0
    assert memory_share(1.0, 1.0, 4.0) == pytest.approx(0.5)
    assert memory_share(1.0, 0.25, 4.0) < 0.01 < 0.99 < memory_share(0.25, 1.0, 4.0)


def test_a_gemm_gets_the_compute_contention_and_a_norm_the_memory_one():
    loaded = gpu_params("A100-SXM4-40GB")
    params = replace(loaded.params, comm_contention=10.0, comm_contention_compute=2.0)
    km = Simulator(loaded.spec, params).kernels
    gemm = km.kernel(2.0 * 8192 * 4096 * 4096, 2.0 * (8192 * 4096 * 2 + 4096 * 4096), 92, 1410)
    norm = km.kernel(5 * 3.5e8, 2.0 * 3.5e8 * 2, 92, 1410)
    assert km.comm_contention(gemm.memory_share) == pytest.approx(2.0, abs=0.05)
    assert km.comm_contention(norm.memory_share) == pytest.approx(10.0, abs=0.05)


def test_collective_beside_a_gemm_slows_as_nanoflow_measured():
    """The fitted compute-bound contention reproduces NanoFlow's network-beside-GEMM slowdowns
    (1.1x to 1.6x) within 20 %, far below the memory-bound coefficient's effect."""
    prior = SimParams()
    params = replace(prior, **calibration.fit_memory_curve(prior)[0])
    coll, coll_prov = calibration.fit_collective_shape(prior)
    params = replace(params, **coll)
    values, prov = calibration.fit_compute_contention(params, coll_prov)
    assert prov["max_abs_rel_error"] < 0.2
    for row in prov["rows"]:
        assert 1.0 < row["slowdown"] < 1.7
    assert 0.0 < values["comm_contention_compute"] < gpu_params("A100-SXM4-40GB").params.comm_contention


def test_the_paper_microbatch_sweep_presets_exist():
    for mbs in (8, 12, 16, 20):
        preset = PRESETS[f"qwen3-1.7b-tp8-mbs{mbs}-seq4k"]
        assert (preset.tp, preset.cp, preset.pp, preset.mbs, preset.seq) == (8, 1, 2, mbs, 4096)
