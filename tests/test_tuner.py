"""The MBO tuner: Pareto/hypervolume maths, search space, stopping rule, selection, quality, resume."""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.errors import OptionsError
from kareus_fx.tuner import (
    Budget,
    CachedProfilerFactory,
    MBOSettings,
    TuningResult,
    build_search_space,
    converged,
    exhaustive_search,
    frontier_hv_ratio,
    random_search,
    tune_partition,
    tune_partition_types,
)
from kareus_fx.tuner.acquisition import PASSES, allocate_pass_counts, grid_neighbours
from kareus_fx.tuner.mbo import capped_batch_size
from kareus_fx.tuner.pareto import (
    Normalizer,
    domination_gap,
    hv_improvement_2d,
    hypervolume_2d,
    pareto_front,
    pareto_mask,
    reference_point,
)
from kareus_fx.tuner.space import N_FEATURES, slot_roofline_times_s
from kareus_fx.tuner.surrogate import BootstrapXGB, XGBParams
from kareus_fx.tuner.synthetic import SyntheticProfiler, synthetic_partition_types
from kareus_fx.workload import CollectiveSpec, Measurement, PartitionConfig, PartitionType

A100 = gpu_spec("A100-SXM4-40GB")
SMALL, MEDIUM, LARGE = synthetic_partition_types()


# --------------------------------------------------------------------------------------------
# Pareto and hypervolume against brute force


def _brute_mask(pts: np.ndarray) -> np.ndarray:
    n = len(pts)
    out = np.ones(n, dtype=bool)
    for i, j in itertools.product(range(n), range(n)):
        if i != j and np.all(pts[j] <= pts[i]) and np.any(pts[j] < pts[i]):
            out[i] = False
    return out


def _grid_hv(pts: np.ndarray, ref: tuple[int, int]) -> int:
    """Count the unit cells [a, a+1) x [b, b+1) below ``ref`` dominated by integer points."""
    count = 0
    for a in range(ref[0]):
        for b in range(ref[1]):
            if np.any((pts[:, 0] <= a) & (pts[:, 1] <= b)):
                count += 1
    return count


@pytest.mark.parametrize("seed", range(25))
def test_pareto_mask_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    pts = rng.integers(0, 12, size=(n, 2)).astype(float)  # many ties and duplicates
    assert np.array_equal(pareto_mask(pts), _brute_mask(pts))
    pts3 = rng.integers(0, 6, size=(n, 3)).astype(float)
    assert np.array_equal(pareto_mask(pts3), _brute_mask(pts3))


@pytest.mark.parametrize("seed", range(25))
def test_hypervolume_matches_grid_counting(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 30))
    pts = rng.integers(0, 25, size=(n, 2)).astype(float)
    ref = (20, 22)  # some points lie outside the reference box
    assert hypervolume_2d(pts, ref) == pytest.approx(_grid_hv(pts, ref))


@pytest.mark.parametrize("seed", range(10))
def test_hv_improvement_is_hv_difference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    front = rng.random((int(rng.integers(0, 15)), 2))
    cands = rng.random((50, 2)) * 1.2
    ref = np.array([1.1, 1.1])
    hvi = hv_improvement_2d(cands, front, ref)
    base = hypervolume_2d(front, ref)
    expected = [hypervolume_2d(np.vstack([front, c]), ref) - base for c in cands]
    assert np.allclose(hvi, expected, atol=1e-12)
    gap = domination_gap(cands, front, ref)
    assert np.all(gap[hvi > 1e-12] == 0)  # positive HVI: nothing to close
    assert np.all(gap[(hvi == 0) & np.all(cands < ref, axis=1)] >= 0)


def test_pareto_front_sorted_and_reference_point() -> None:
    pts = np.array([[3.0, 1.0], [1.0, 3.0], [2.0, 2.0], [3.0, 3.0]])
    assert pareto_front(pts).tolist() == [[1.0, 3.0], [2.0, 2.0], [3.0, 1.0]]
    norm = Normalizer.from_points(pts)
    assert norm(pts).min() == 0 and norm(pts).max() == 1
    assert reference_point(norm(pts), 0.1, "observed").tolist() == pytest.approx([1.1, 1.1])
    # the dominated corner (3, 3) does not move the front-based reference point
    assert reference_point(norm(pts), 0.1, "front").tolist() == pytest.approx([1.1, 1.1])
    worse = np.vstack([pts, [[9.0, 9.0]]])
    assert reference_point(Normalizer.from_points(worse)(worse), 0.1, "front").tolist() == pytest.approx(
        [0.25 + 0.1, 0.25 + 0.1]
    )


# --------------------------------------------------------------------------------------------
# Search space


def test_search_space_axes_a100() -> None:
    space = build_search_space(LARGE, A100)
    assert space.clocks_mhz[0] == 900 and space.clocks_mhz[-1] == 1410 and len(space.clocks_mhz) == 18
    assert space.comm_sms == tuple(range(3, 31, 3))
    assert space.launch_options == LARGE.launch_slots + (None,)
    assert len(space) == 18 * 10 * 7 == len(set(space.configs))
    feats = space.features()
    assert feats.shape == (len(space), N_FEATURES) and feats.min() >= 0 and feats.max() <= 1
    seq = space.index(PartitionConfig(1410, 30, None))
    assert feats[seq, 3] == 1 and feats[seq, 4] == 0 and feats[seq, 5] == 0
    onehot = build_search_space(LARGE, A100, encoding="onehot").features()
    assert onehot.shape == (len(space), N_FEATURES + 7) and np.all(onehot[:, N_FEATURES:].sum(axis=1) == 1)


def test_hiding_capacity_and_compute_time_features() -> None:
    """Feature 5 (SMs x compute left after the launch at the config's clock) and feature 6 (compute
    time on the SMs the collective leaves) move the way the physics says along every axis."""
    space = build_search_space(MEDIUM, A100)
    feats = space.features()

    def f(clock: int, sms: int, slot: int | None, col: int) -> float:
        return float(feats[space.index(PartitionConfig(clock, sms, slot)), col])

    first, last = space.launch_options[0], space.launch_options[-2]
    sms = space.comm_sms
    # more SMs: the collective hides under more of the computation, which runs on fewer SMs
    assert all(f(1200, a, first, 5) < f(1200, b, first, 5) for a, b in itertools.pairwise(sms))
    assert all(f(1200, a, first, 6) < f(1200, b, first, 6) for a, b in itertools.pairwise(sms))
    # a later launch leaves less computation to hide under; the compute estimate does not care
    assert f(1200, 9, last, 5) < f(1200, 9, first, 5)
    assert f(1200, 9, last, 6) == f(1200, 9, first, 6)
    # a lower clock slows the computation: more to hide under, longer compute time
    assert f(900, 9, first, 5) > f(1410, 9, first, 5) and f(900, 9, first, 6) > f(1410, 9, first, 6)
    # sequential: nothing to hide under, and the computation has every SM
    assert f(1200, 9, None, 5) == 0 and f(1200, 9, None, 6) < f(1200, 3, first, 6)

    # feature 6 is the roofline estimate, min-max scaled (fastest: sequential at the top clock)
    def compute_s(clock: int, comm_sms: int) -> float:
        return slot_roofline_times_s(MEDIUM, A100, clock).sum() * A100.sm_count / (A100.sm_count - comm_sms)

    lo, hi = compute_s(1410, 0), compute_s(900, sms[-1])
    assert f(1200, 9, first, 6) == pytest.approx((compute_s(1200, 9) - lo) / (hi - lo))
    assert f(1410, 9, None, 6) == pytest.approx(0.0) and f(900, sms[-1], first, 6) == pytest.approx(1.0)


def test_search_space_small_group_stride_and_bigger_gpu() -> None:
    pair = PartitionType("pair", "forward", SMALL.slots, CollectiveSpec("all_reduce", 1e6, 2), 1, (0,))
    assert build_search_space(pair, A100).comm_sms == tuple(range(1, 21))
    h100 = gpu_spec("H100-SXM5-80GB")
    assert build_search_space(SMALL, h100).comm_sms == tuple(range(3, 37, 3))  # 30 * 132 / 108
    assert build_search_space(pair, h100).comm_sms == tuple(range(1, 25))
    clocks = build_search_space(SMALL, A100, clock_stride_mhz=60).clocks_mhz
    assert clocks[-1] == 1410 and np.all(np.diff(clocks) == 60)
    with pytest.raises(OptionsError):
        build_search_space(SMALL, A100, clock_stride_mhz=20)


# --------------------------------------------------------------------------------------------
# Stopping rule and pass allocation


def test_converged_rule() -> None:
    assert not converged([], 2, 0.01)
    assert not converged([0.0], 2, 0.01)  # not enough batches yet
    assert converged([0.2, 0.0, 0.001], 2, 0.01)  # flat over the window
    assert not converged([0.2, 0.05, 0.03], 2, 0.01)  # still improving
    assert not converged([0.0, 0.025, 0.0], 2, 0.01)  # one flat batch in a window of 2 is not enough
    assert converged([0.0, 0.0], 2, 0.01)


def test_pass_allocation() -> None:
    counts = allocate_pass_counts(32)
    assert sum(counts.values()) == 32 and counts["total"] == 13
    assert [counts[p] for p in ("dynamic", "static", "uncertainty")] == [7, 6, 6]
    assert allocate_pass_counts(5) == {"total": 2, "dynamic": 1, "static": 1, "uncertainty": 1}
    assert sum(allocate_pass_counts(1).values()) == 1


def test_grid_neighbours_are_one_step_along_one_axis() -> None:
    shape = (3, 4, 2)
    centre = int(np.ravel_multi_index((1, 2, 0), shape))
    got = {tuple(int(v) for v in np.unravel_index(i, shape)) for i in np.flatnonzero(grid_neighbours(shape, [centre]))}
    assert got == {(0, 2, 0), (2, 2, 0), (1, 1, 0), (1, 3, 0), (1, 2, 1)}
    corner = grid_neighbours(shape, [0])
    assert corner.sum() == 3 and not corner[0]
    assert not grid_neighbours(shape, np.array([], dtype=int)).any()


def test_search_space_is_its_grid_in_row_major_order() -> None:
    space = build_search_space(SMALL, A100)
    clocks, sms, launches = space.grid_shape
    assert len(space) == clocks * sms * launches
    row = int(np.ravel_multi_index((2, 1, 0), space.grid_shape))
    cfg = space.configs[row]
    assert (cfg.clock_mhz, cfg.comm_sms) == (space.clocks_mhz[2], space.comm_sms[1])


@dataclass
class CountingProfiler:
    """Wraps a profiler; counts calls per config."""

    inner: object = field(default_factory=SyntheticProfiler)
    gpu_name: str = "A100-SXM4-40GB"
    counts: Counter = field(default_factory=Counter)
    order: list = field(default_factory=list)

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        self.counts[(ptype.type_id, config)] += 1
        self.order.append(config)
        return self.inner.measure(ptype, config)


@dataclass
class FlatProfiler:
    """Every config measures the same: the hypervolume cannot improve after the initial sample."""

    gpu_name: str = "A100-SXM4-40GB"

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        return Measurement(time_s=1e-3, energy_j=0.3, dynamic_energy_j=0.24, static_energy_j=0.06)


def test_stops_on_flat_hypervolume() -> None:
    res = tune_partition(MEDIUM, FlatProfiler(), seed=0)
    assert res.stats.stop_reason == "converged"
    assert res.stats.batches == MBOSettings().window
    assert res.stats.rel_improvement_history == [0.0] * res.stats.batches


def test_runs_to_max_batches_without_convergence() -> None:
    settings = MBOSettings(threshold=0.0, budgets={k: Budget(12, 6, 3) for k in ("small", "medium", "large")})
    res = tune_partition(MEDIUM, SyntheticProfiler(), settings=settings, seed=0)
    assert res.stats.stop_reason == "max_batches" and res.stats.batches == 3
    assert res.stats.measured == 12 + 3 * 6
    assert len(res.stats.acq_seconds) == 3 and len(res.stats.hv_history) == 4
    assert all(b >= a - 1e-12 for a, b in zip(res.stats.hv_history, res.stats.hv_history[1:]))


def test_budget_cap_by_fraction_of_space() -> None:
    budgets = {k: Budget(40, 20, 5) for k in ("small", "medium", "large")}
    settings = MBOSettings(threshold=0.0, max_fraction=0.05, budgets=budgets)
    res = tune_partition(SMALL, SyntheticProfiler(), settings=settings, seed=0)
    assert res.stats.measured == int(0.05 * res.stats.space_size) == 18
    assert res.stats.n_init == 9


def test_capped_budget_keeps_the_number_of_refits() -> None:
    budget = Budget(n_init=40, batch_size=20, max_batches=6)
    assert capped_batch_size(budget, planned=160, n_init=40) == 20  # uncapped: the budget's batch
    assert capped_batch_size(budget, planned=81, n_init=40) == 7  # 41 left over 6 batches
    assert capped_batch_size(budget, planned=40, n_init=40) == 1
    settings = MBOSettings(threshold=0.0, budgets=dict.fromkeys(("small", "medium", "large"), budget))
    res = tune_partition(MEDIUM, SyntheticProfiler(), settings=settings, seed=0)  # 720 configs, cap 108
    assert res.stats.n_init == 40 and res.stats.batch_size == 12
    assert res.stats.batches == 6 and res.stats.measured == 108


def test_surrogate_mean_follows_the_clock_between_measured_clocks() -> None:
    """Measured at 4 of 18 clocks: plain trees would predict a constant between them; the clock
    line makes the prediction fall with the clock in between, and the mean (the model on all
    points) reproduces the measured points."""
    clocks = np.linspace(0.0, 1.0, 18)
    sms = np.linspace(0.0, 1.0, 10)
    grid = np.array([[c, s, 0.0, 0.0, 0.5] for c in clocks for s in sms])

    def truth(x: np.ndarray) -> np.ndarray:
        return 2.0 - x[:, 0] + 0.3 * (x[:, 1] - 0.4) ** 2

    train = grid[np.isin(np.round(grid[:, 0] * 17), [0, 6, 11, 17])]
    model = BootstrapXGB(XGBParams(), seed=0).fit(train, truth(train))
    mean, std = model.predict(grid)
    assert np.max(np.abs(mean - truth(grid))) < 0.05
    at_sms = mean.reshape(18, 10)[:, 4]
    assert np.all(np.diff(at_sms) < 0), at_sms  # strictly falling: no ties between measured clocks
    train_mean, _ = model.predict(train)
    assert np.max(np.abs(train_mean - truth(train))) < 0.01
    assert std.shape == mean.shape and np.all(std >= 0)


# --------------------------------------------------------------------------------------------
# Determinism, duplicates, provenance, serialisation


def test_seeded_runs_reproduce_the_measured_sequence() -> None:
    a, b, c = CountingProfiler(), CountingProfiler(), CountingProfiler()
    ra = tune_partition(LARGE, a, seed=3)
    tune_partition(LARGE, b, seed=3)
    tune_partition(LARGE, c, seed=4)
    assert a.order == b.order
    assert a.order != c.order
    assert [p.config for p in ra.points] == a.order


def test_no_config_is_measured_twice() -> None:
    prof = CountingProfiler()
    for ptype in (SMALL, MEDIUM, LARGE):
        res = tune_partition(ptype, prof, seed=0)
        assert len({p.config for p in res.points}) == len(res.points) == res.stats.measured
    assert max(prof.counts.values()) == 1
    assert sum(prof.counts.values()) == len(prof.order)


def test_exhaustive_measures_each_config_once() -> None:
    prof = CountingProfiler()
    res = exhaustive_search(SMALL, prof)
    assert res.stats.measured == res.stats.space_size == len(prof.counts) == 360
    assert set(prof.counts.values()) == {1}


def test_every_pass_contributes_candidates() -> None:
    res = tune_partition(LARGE, SyntheticProfiler(), seed=0)
    sources = Counter(p.source for p in res.points)
    assert set(sources) == {"initial", *PASSES}
    batch1 = [p.source for p in res.points if p.batch == 1]
    budget = MBOSettings().budget_for(LARGE)
    assert Counter(batch1) == Counter({k: v for k, v in allocate_pass_counts(budget.batch_size).items() if v})
    assert res.stats.measured <= budget.max_measurements
    assert sum(res.frontier_sources().values()) == pytest.approx(1.0)


def test_initial_sample_has_anchors_and_covers_every_axis_value() -> None:
    res = tune_partition(LARGE, SyntheticProfiler(), seed=5)
    init = [p.config for p in res.points if p.source == "initial"]
    assert PartitionConfig(1410, 30, None) in init
    assert PartitionConfig(1410, 18, 0) in init  # middle of 3..30
    space = build_search_space(LARGE, A100)
    assert {c.launch_slot for c in init} == set(space.launch_options)
    assert {c.comm_sms for c in init} == set(space.comm_sms)
    assert {c.clock_mhz for c in init} == set(space.clocks_mhz)


def test_result_json_round_trip() -> None:
    res = tune_partition(MEDIUM, SyntheticProfiler(noise_std=0.01), seed=1)
    data = json.loads(json.dumps(res.to_dict()))
    back = TuningResult.from_dict(data)
    assert back.points == res.points
    assert back.stats == res.stats
    assert [p.config for p in back.frontier] == [p.config for p in res.frontier]
    assert data["frontier"] == [p.to_dict() for p in res.frontier]
    assert MBOSettings.from_dict(res.settings) == MBOSettings()
    assert MBOSettings.from_dict(json.loads(json.dumps(res.settings))) == MBOSettings()


# --------------------------------------------------------------------------------------------
# Quality on the synthetic profiler


def test_mbo_quality_beats_random_on_synthetic_types() -> None:
    """Fixed seeds 0-2. The HV ratio against the paper's reference point (10 % beyond the worst
    point of the space) is >= 0.98 on every seed; random search scores about 0.99 on it too, so
    "beats random" is checked on the strict ratio (reference 10 % beyond the exhaustive frontier's
    worst point): MBO leads by 0.01-0.1 there (bench/mbo_quality.py --synthetic)."""
    prof = SyntheticProfiler()
    for ptype in (SMALL, MEDIUM, LARGE):
        exhaustive = exhaustive_search(ptype, prof)
        mbo, rnd = [], []
        for seed in range(3):
            res = tune_partition(ptype, prof, seed=seed)
            assert res.stats.fraction_measured < 0.20
            assert frontier_hv_ratio(res, exhaustive, strict=False) >= 0.98, (ptype.type_id, seed)
            base = random_search(ptype, prof, res.stats.measured, seed=seed)
            mbo.append(frontier_hv_ratio(res, exhaustive))
            rnd.append(frontier_hv_ratio(base, exhaustive))
        assert np.mean(mbo) > np.mean(rnd), (ptype.type_id, mbo, rnd)


# --------------------------------------------------------------------------------------------
# Parallel tuning


def test_parallel_matches_in_process() -> None:
    factory = functools.partial(SyntheticProfiler, "A100-SXM4-40GB", 0.0, 0)
    settings = MBOSettings(budgets={k: Budget(12, 6, 2) for k in ("small", "medium", "large")})
    one = tune_partition_types([SMALL, MEDIUM], factory, settings=settings, workers=1, progress=False)
    two = tune_partition_types([SMALL, MEDIUM], factory, settings=settings, workers=2, progress=False)
    assert list(one) == ["syn_small", "syn_medium"] == list(two)
    for tid in one:
        assert [p.config for p in one[tid].points] == [p.config for p in two[tid].points]
    # a type's run does not depend on which other types are tuned with it
    alone = tune_partition_types([MEDIUM], factory, settings=settings, progress=False)
    assert [p.config for p in alone["syn_medium"].points] == [p.config for p in one["syn_medium"].points]


# --------------------------------------------------------------------------------------------
# Resume with the profile database; the simulated GPU

_KILLED_RUN = textwrap.dedent(
    """
    import functools, os, signal, sys
    from kareus_fx.tuner import CachedProfilerFactory, tune_partition_types
    from kareus_fx.tuner.synthetic import SyntheticProfiler, synthetic_partition_types
    sys.path.insert(0, os.environ["TEST_DIR"])
    from test_tuner import RESUME_SETTINGS, LoggingProfiler
    factory = CachedProfilerFactory(
        os.environ["DB"],
        functools.partial(LoggingProfiler, os.environ["LOG"], int(os.environ["KILL_AT"]), "syn_large"),
        "log",
    )
    tune_partition_types(synthetic_partition_types(), factory, settings=RESUME_SETTINGS, workers=1, progress=False)
    """
)

RESUME_SETTINGS = MBOSettings(threshold=0.0, budgets={k: Budget(12, 6, 3) for k in ("small", "medium", "large")})
"""Small budgets (30 measurements a type, three refits) keep the killed-run test quick."""


class LoggingProfiler(SyntheticProfiler):
    """Appends every config it really measures to a log; kills its process at its call ``kill_at``
    on partition type ``kill_type`` (a worker builds one profiler per partition type)."""

    def __init__(self, log_path: str, kill_at: int = 0, kill_type: str = "") -> None:
        super().__init__()
        self.log_path = log_path
        self.kill_at = kill_at
        self.kill_type = kill_type

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        if ptype.type_id == self.kill_type and self.calls + 1 == self.kill_at:
            os.kill(os.getpid(), 9)  # SIGKILL mid-tuning: no cleanup, no flush
        m = super().measure(ptype, config)
        with open(self.log_path, "a") as fh:
            fh.write(f"{ptype.type_id} {config.clock_mhz} {config.comm_sms} {config.launch_slot}\n")
        return m


def test_killed_run_resumes_without_measuring_twice(tmp_path) -> None:
    db, log = tmp_path / "profiles.sqlite", tmp_path / "measured.log"
    env = dict(os.environ, DB=str(db), LOG=str(log), KILL_AT="20", TEST_DIR=os.path.dirname(__file__))
    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == -9, proc.stderr
    killed_at = log.read_text().splitlines()
    # two finished types of 30 measurements, then 19 of the third (past its initial sample of 12)
    assert len(killed_at) == 30 + 30 + 19 and killed_at[-1].startswith("syn_large")

    factory = CachedProfilerFactory(str(db), functools.partial(LoggingProfiler, str(log)), "log")
    resumed = tune_partition_types(
        synthetic_partition_types(), factory, settings=RESUME_SETTINGS, workers=1, progress=False
    )
    lines = log.read_text().splitlines()
    assert len(lines) == len(set(lines)), "a configuration was measured twice"
    assert len(lines) == sum(r.stats.measured for r in resumed.values()) > len(killed_at)
    # the resumed run is the run that was never killed
    fresh = tune_partition_types(
        synthetic_partition_types(),
        functools.partial(SyntheticProfiler),
        settings=RESUME_SETTINGS,
        workers=1,
        progress=False,
    )
    for tid, res in fresh.items():
        assert [p.config for p in resumed[tid].points] == [p.config for p in res.points]


def test_mbo_on_simulated_gpu() -> None:
    sim = pytest.importorskip("kareus_fx.cost_models.simulated_profiler")
    workloads = pytest.importorskip("kareus_fx.cost_models.analytic_workloads")
    prof = sim.SimulatedProfiler("A100-SXM4-40GB", noise_std=0.0, seed=0)
    ptype = workloads.llama_mlp_partition(tp=8, nanobatch=4, seq=4096)
    exhaustive = exhaustive_search(ptype, prof)
    res = tune_partition(ptype, prof, seed=0)
    assert res.stats.fraction_measured <= 0.15
    assert frontier_hv_ratio(res, exhaustive) >= 0.99
    rnd = random_search(ptype, prof, res.stats.measured, seed=0)
    assert frontier_hv_ratio(res, exhaustive) > frontier_hv_ratio(rnd, exhaustive)
