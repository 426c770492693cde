"""bench/overlap_holdback.py's accounting on the Kareus attention partition (one analytic type)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from kareus_fx.cost_models.analytic_workloads import kareus_attention_tp2
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.cost_models.simulator import Simulator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import overlap_holdback

GPU = "A100-SXM4-40GB"


def _holdback(**overrides: float) -> dict:
    graph = SimpleNamespace(ptypes=[kareus_attention_tp2(count=3)])
    sim = Simulator(GPU, replace(gpu_params(GPU).params, **overrides))
    return overlap_holdback.holdback([graph], sim, 1200)


def test_the_overlapped_collectives_wall_time_is_split_by_what_runs_beside_it():
    r = _holdback()
    beside = r["collective_beside"]
    wall_ms = sum(b["ms"] for b in beside.values())
    # The collective runs at least as long overlapped as alone, and the overlap never beats the
    # compute alone nor loses to running the two one after the other here.
    assert wall_ms >= r["collective_ms"] * (1 - 1e-9)
    assert r["compute_ms"] <= r["overlapped_ms"] <= r["sequential_ms"]
    assert r["sequential_ms"] == pytest.approx(r["compute_ms"] + r["collective_ms"])
    assert 0.0 <= r["hidden"] <= 1.0
    assert r["overlap_cost_ms"] == pytest.approx(r["overlapped_ms"] - r["compute_ms"])
    p = gpu_params(GPU).params
    for kind in ("compute-bound", "memory-bound"):
        if beside[kind]["ms"] > 0:
            b = beside[kind]
            # The mean slowdown is 1 + contention x utilisation, contention between the two coefficients.
            lo = 1 + min(p.comm_contention, p.comm_contention_compute) * b["mean_hbm_util"]
            hi = 1 + max(p.comm_contention, p.comm_contention_compute) * b["mean_hbm_util"]
            assert lo - 1e-9 <= b["mean_slowdown"] <= hi + 1e-9


def test_without_contention_the_collective_runs_at_its_own_speed_and_hides_more():
    calibrated = _holdback()
    free = _holdback(comm_contention=0.0, comm_contention_compute=0.0)
    for b in free["collective_beside"].values():
        if "mean_slowdown" in b and b["ms"] > 0:
            assert b["mean_slowdown"] == pytest.approx(1.0)
    assert free["hidden"] > calibrated["hidden"]
    assert free["collective_ms"] == pytest.approx(calibrated["collective_ms"])
