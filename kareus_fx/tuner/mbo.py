"""Kareus multi-objective Bayesian optimisation (MBO) of one partition type (paper section 4.3).

``tune_partition`` is Algorithm 1: a seeded random initial sample, then batches chosen by the four
acquisition passes of :mod:`kareus_fx.tuner.acquisition` on XGBoost surrogates refitted after every
batch, until the batch budget is spent or the hypervolume stops improving. ``exhaustive_search``
measures every configuration; ``random_search`` measures a seeded random subset (the baseline).

Budgets (appendix C scales the budget by the number of computations in the partition; its numbers
did not survive in our copy of the paper, whose section 6.6 mentions 32 candidates a batch for a
typical partition on a 85K-config global space). Ours, per ``len(ptype.slots)``, for per-type
spaces of a few hundred to a few thousand configs:

======== ============ ======= ===== =========== ==============================================
size     computations initial batch max batches worst case on A100, TP 8 (18 clocks x 10 SMs)
======== ============ ======= ===== =========== ==============================================
small    1            16      8     5           54 of 360 (the 15 % cap binds)
medium   2-3          24      12    6           81 of 540 (cap), 96 of 720 (13 %)
large    4 or more    40      10    6           81 of 540 (cap), 100 of 900-2,160 (11-5 %)
======== ============ ======= ===== =========== ==============================================

Most of a plan's device time is the large class's runs, so its batch is the smallest that keeps
the frontier (a batch of 20 allowed 160 measurements). The batch of 10 was chosen with
``bench/mbo_budget_sweep.py --size large --seeds 8`` on the large types of three presets other than
the one the cost is reported on (Llama-3.2-3B TP8 and CP2TP4, 4 types each, and ``syn_large``),
as the cheapest of the (initial, batch) settings tried, all with 6 batches, that kept every type's
mean strict HV ratio >= 0.99 (measurements summed over the 9 types; worst type's mean):

==========  ============  =================  ===================
initial     batch         measured (9 types) worst type's mean
==========  ============  =================  ===================
40          20 (before)   1,112              0.990
40          10 (chosen)   818                0.990
40          8             756                0.987
32          10            787                0.986
28          12            836                0.977
24          12            804                0.985
24          10            735                0.982
==========  ============  =================  ===================

The 540-config types keep their 81 measurements (the cap binds before and after); the 900-2,160
config types go from 124-155 to 90-100 (means over seeds). Seed noise on a type's mean is about 0.005 at 8 seeds.
Reported on ``qwen3-1.7b-tp8-mbs8-seq4k`` (``bench/mbo_quality.py --seeds 8``): mean strict HV
ratio 0.995 / 0.998 / 0.995 / 0.994 (worst seed 0.986 / 0.995 / 0.993 / 0.960) with 80 / 80 / 95 / 94
measurements (before, 3 seeds: 79 / 81 / 140 / 127), random search at the same budget 0.92 / 0.94 / 0.94 /
0.85, beaten by all 8 seeds on every type.

The total pass picks up to two of each batch's configs among the unmeasured grid neighbours of the
measured front (``MBOSettings.front_neighbours``, :func:`~kareus_fx.tuner.acquisition.select_batch`):
the frontier points a seed missed were next to measured frontier points (one clock step, one SM
choice, the other launch slot), where the surrogates' predicted improvement is within their error.
Chosen on the sweep presets (``bench/mbo_budget_sweep.py``'s types, 8 seeds): Llama-3.2-3B TP8 worst
seed 0.988 -> 0.995 and every type's mean 0.997-0.999 -> 0.998-1.000 with 355 measurements instead of
343; CP2TP4 worst type's mean 0.984 -> 0.987 (730 against 697); the synthetic types unchanged.
Reported on ``qwen3-1.7b-tp8-mbs8-seq4k`` (``bench/mbo_quality.py --preset qwen3-1.7b-tp8-mbs8-seq4k
--json``, 5 seeds, with the end-to-end calibration's parameters): 0.993 / 0.999 / 0.997 / 0.999 at
15 / 15 / 8.7 / 7.5 % measured.

``MBOSettings.max_fraction`` (default 0.15) caps the measured share of the space: the initial
sample shrinks to at most half the cap and the batches shrink so that ``max_batches`` of them still
fit in what is left (:func:`capped_batch_size`). The number of surrogate refits is what makes the
search adaptive; cutting the last batches instead (our first version) left a forward type of a
540-config space with 40 initial points and batches of 20, 20 and 1: three refits. Measured over 5
seeds on the Llama MLP, Qwen MLP and Qwen attention forward types (the capped ones), mean HV ratio
0.964 / 0.979 / 0.963 with three refits against 0.967 / 0.993 / 0.980 with batches of 7 (six
refits), with a surrogate whose linear base used every feature; with plain trees 0.964 / 0.955 /
0.966 against 0.978 / 0.946 / 0.971 (seed noise is about 0.01-0.02 on these types).
The stopping rule usually ends a run one or two batches before the limit.

The initial sample is large relative to the batches ("a relatively large initialisation set for
informative exploration"). It always contains the sequential config at the maximum clock with the
most SMs (the baseline schedule) and the as-soon-as-possible config (first launch slot, maximum
clock, middle SM choice). The rest is a balanced random design: along each axis (clock, SMs, launch
option) every value appears equally often (up to one), in an independent random order per axis,
so no SM range or launch slot goes unsampled; a drawn config that is already in the sample is
replaced by a uniformly random one. Everything is drawn from ``numpy.random.default_rng(seed)``.
Purely uniform sampling can leave a whole SM range unsampled, and the trees then never learn that
the best SM count is there: on ``syn_medium`` at 10 % of the space the worst of 8 seeds went from
an HV ratio of 0.76 (uniform) to 0.86 (balanced); the means were within seed noise.

Stopping (appendix C): stop after ``max_batches`` batches, or when the moving average of the
relative hypervolume improvement over the last ``window=2`` batches is below ``threshold=0.002``.
The relative improvement of a batch is ``(HV_after - HV_before) / HV_after`` on (time, total energy),
both HVs computed with the normaliser and reference point of the points measured after the batch,
so the two numbers are comparable, and the reference point sits just beyond the measured front
(:func:`~kareus_fx.tuner.pareto.reference_point`), so the number reflects changes near the front.
Chosen on the synthetic and simulated Llama types of ``bench/mbo_quality.py`` (6 seeds each):
(window 2, 0.002), (3, 0.001) and no early stop reached the same HV ratios on all five types;
(2, 0.002) measured the least (13.3 % of the space on average against 13.7 % and 13.8 %).
Re-checked with the large class's batch of 10 (``bench/mbo_budget_sweep.py --seeds 8``, every type of
Llama-3.2-3B TP8 and CP2TP4 and the synthetic types): threshold 0.005 / 0.01 measured 5 % / 11 % less
(1,222 / 1,151 against 1,289 over 15 types) and lowered the worst type's mean HV ratio from 0.982 to
0.976 / 0.973 (8 seeds), so the threshold stays.

Every measurement goes through the given profiler, in a deterministic order for a given seed and
profiler answers: re-running a killed run with a caching profiler re-issues the same configs.

A configuration the profiler reports as failed (:class:`~kareus_fx.workload.MeasurementFailedError`:
out of memory, a collective timed out) is kept in :attr:`TuningResult.failed` with its reason,
counts against the budget, is never chosen again in the run and never enters the surrogates or
the frontier; the run goes on. A run whose every initial configuration fails stops
(``stop_reason="all_failed"``) with an empty frontier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kareus_fx.cost_models.hardware import GPUSpec, gpu_spec
from kareus_fx.tuner.acquisition import DEFAULT_PASS_FRACTIONS, PASSES, MeasuredObjectives, select_batch
from kareus_fx.tuner.pareto import (
    REF_MARGIN,
    Normalizer,
    RefBasis,
    hypervolume_2d,
    pareto_mask,
    reference_point,
)
from kareus_fx.tuner.space import DEFAULT_CLOCK_STRIDE_MHZ, Encoding, SearchSpace, build_search_space
from kareus_fx.tuner.surrogate import PartitionSurrogate, XGBParams
from kareus_fx.workload import Measurement, MeasurementFailedError, PartitionConfig, PartitionType, Profiler

SOURCES = ("initial",) + PASSES + ("exhaustive", "random")

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(measured_so_far, planned_total)`` after every measurement."""


@dataclass(frozen=True)
class Budget:
    """Initial sample size, batch size and batch limit for one partition size class."""

    n_init: int
    batch_size: int
    max_batches: int

    @property
    def max_measurements(self) -> int:
        return self.n_init + self.batch_size * self.max_batches


DEFAULT_BUDGETS: dict[str, Budget] = {
    "small": Budget(n_init=16, batch_size=8, max_batches=5),
    "medium": Budget(n_init=24, batch_size=12, max_batches=6),
    "large": Budget(n_init=40, batch_size=10, max_batches=6),
}


def size_class(ptype: PartitionType) -> str:
    """``small`` (1 computation), ``medium`` (2-3) or ``large`` (more), by the number of slots."""
    n = len(ptype.slots)
    return "small" if n <= 1 else "medium" if n <= 3 else "large"


@dataclass(frozen=True)
class MBOSettings:
    """Everything that shapes a tuning run besides the seed (picklable, JSON-able)."""

    clock_stride_mhz: int = DEFAULT_CLOCK_STRIDE_MHZ
    supported_clocks_mhz: tuple[int, ...] | None = None
    encoding: Encoding = "ordinal"
    budgets: Mapping[str, Budget] = field(default_factory=lambda: dict(DEFAULT_BUDGETS))
    pass_fractions: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_PASS_FRACTIONS))
    max_fraction: float | None = 0.15
    """Cap on the measured share of the space (None: no cap): the budget is cut to fit."""
    window: int = 2
    threshold: float = 0.002
    ref_margin: float = REF_MARGIN
    ref_basis: RefBasis = "front"
    front_neighbours: bool = True
    """The total pass picks the measured front's grid neighbours first (``acquisition.select_batch``)."""
    xgb: XGBParams = field(default_factory=XGBParams)

    def budget_for(self, ptype: PartitionType) -> Budget:
        return self.budgets[size_class(ptype)]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["budgets"] = {k: asdict(v) for k, v in self.budgets.items()}
        out["pass_fractions"] = dict(self.pass_fractions)
        out["supported_clocks_mhz"] = list(self.supported_clocks_mhz) if self.supported_clocks_mhz is not None else None
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MBOSettings:
        d = dict(data)
        d["budgets"] = {k: Budget(**v) for k, v in d.get("budgets", {}).items()} or dict(DEFAULT_BUDGETS)
        if "xgb" in d:
            xgb_params = dict(d["xgb"])
            if "linear_features" in xgb_params:
                xgb_params["linear_features"] = tuple(xgb_params["linear_features"])
            d["xgb"] = XGBParams(**xgb_params)
        else:
            d["xgb"] = XGBParams()
        if d.get("supported_clocks_mhz") is not None:
            d["supported_clocks_mhz"] = tuple(d["supported_clocks_mhz"])
        return cls(**d)

    def space_for(self, ptype: PartitionType, gpu: GPUSpec) -> SearchSpace:
        return build_search_space(
            ptype,
            gpu,
            clock_stride_mhz=self.clock_stride_mhz,
            supported_clocks_mhz=self.supported_clocks_mhz,
            encoding=self.encoding,
        )


def capped_batch_size(budget: Budget, planned: int, n_init: int) -> int:
    """Batch size when at most ``planned`` measurements (``n_init`` of them initial) are allowed:
    the budget's, or smaller so that ``max_batches`` batches still fit (see module docstring)."""
    left = max(planned - n_init, 0)
    return max(1, min(budget.batch_size, -(-left // budget.max_batches)))


def converged(rel_improvements: Sequence[float], window: int, threshold: float) -> bool:
    """The stopping rule: mean of the last ``window`` relative HV improvements below ``threshold``."""
    if window <= 0 or len(rel_improvements) < window:
        return False
    return float(np.mean(rel_improvements[-window:])) < threshold


# ---------------------------------------------------------------------------------------------
# Results


def _config_to_dict(cfg: PartitionConfig) -> dict[str, Any]:
    return {
        "clock_mhz": cfg.clock_mhz,
        "comm_sms": cfg.comm_sms,
        "launch_slot": cfg.launch_slot,
        "comm_library": cfg.comm_library,
    }


def _config_from_dict(d: Mapping[str, Any]) -> PartitionConfig:
    slot = d["launch_slot"]
    library = d.get("comm_library", "mscclpp")  # written before the field: the tuned kernels'
    return PartitionConfig(int(d["clock_mhz"]), int(d["comm_sms"]), None if slot is None else int(slot), library)


@dataclass(frozen=True)
class MeasuredPoint:
    """One measured configuration, the pass that chose it and the batch it was measured in (0 = initial)."""

    config: PartitionConfig
    measurement: Measurement
    source: str
    batch: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": _config_to_dict(self.config),
            "measurement": asdict(self.measurement),
            "source": self.source,
            "batch": self.batch,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MeasuredPoint:
        return cls(
            config=_config_from_dict(d["config"]),
            measurement=Measurement(**{k: float(v) for k, v in d["measurement"].items()}),
            source=str(d["source"]),
            batch=int(d["batch"]),
        )


@dataclass(frozen=True)
class FailedPoint:
    """A configuration that could not run, why, the pass that chose it and its batch."""

    config: PartitionConfig
    reason: str
    source: str
    batch: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": _config_to_dict(self.config),
            "reason": self.reason,
            "source": self.source,
            "batch": self.batch,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FailedPoint:
        return cls(_config_from_dict(d["config"]), str(d["reason"]), str(d["source"]), int(d["batch"]))


@dataclass
class TuningStats:
    """How a run went. HV numbers are on normalised (time, total energy)."""

    space_size: int
    measured: int
    batches: int
    n_init: int
    batch_size: int
    max_batches: int
    stop_reason: str
    """``converged``, ``max_batches``, ``exhausted`` (nothing left), ``all_failed``, ``exhaustive`` or ``random``."""
    hv_history: list[float] = field(default_factory=list)
    """HV of the measured front after the initial sample and after each batch, all on the final
    normaliser and reference point."""
    rel_improvement_history: list[float] = field(default_factory=list)
    """Relative HV improvement of each batch as the stopping rule saw it."""
    acq_seconds: list[float] = field(default_factory=list)
    """Surrogate training + acquisition seconds of each batch."""
    measure_seconds: float = 0.0
    failed: int = 0
    """Configurations that could not run (not counted in ``measured``)."""

    @property
    def fraction_measured(self) -> float:
        return self.measured / self.space_size if self.space_size else 0.0

    @property
    def mean_acq_seconds(self) -> float:
        return float(np.mean(self.acq_seconds)) if self.acq_seconds else 0.0


@dataclass
class TuningResult:
    """The outcome of tuning one partition type: every measured point and the frontier among them."""

    type_id: str
    gpu_name: str
    mode: str
    """``mbo``, ``exhaustive`` or ``random``."""
    seed: int
    points: list[MeasuredPoint]
    stats: TuningStats
    settings: dict[str, Any] = field(default_factory=dict)
    failed: list[FailedPoint] = field(default_factory=list)
    """Configurations that could not run, with their reasons."""

    def objectives(self, energy: str = "total") -> np.ndarray:
        """``(n, 2)`` array of (time_s, energy) of every measured point; energy total/dynamic/static."""
        attr = {"total": "energy_j", "dynamic": "dynamic_energy_j", "static": "static_energy_j"}[energy]
        return np.array(
            [[p.measurement.time_s, getattr(p.measurement, attr)] for p in self.points], dtype=float
        ).reshape(-1, 2)

    @property
    def frontier(self) -> list[MeasuredPoint]:
        """Measured points on the (time, total energy) Pareto front, fastest first."""
        if not self.points:
            return []
        mask = pareto_mask(self.objectives())
        front = [p for p, keep in zip(self.points, mask) if keep]
        return sorted(front, key=lambda p: (p.measurement.time_s, p.measurement.energy_j))

    def frontier_sources(self) -> dict[str, float]:
        """Share of the frontier found by each source (initial sample, each pass, ...)."""
        front = self.frontier
        counts = dict.fromkeys(SOURCES, 0)
        for p in front:
            counts[p.source] = counts.get(p.source, 0) + 1
        n = len(front) or 1
        return {s: c / n for s, c in counts.items() if c}

    def to_dict(self) -> dict[str, Any]:
        return {
            "type_id": self.type_id,
            "gpu_name": self.gpu_name,
            "mode": self.mode,
            "seed": self.seed,
            "points": [p.to_dict() for p in self.points],
            "frontier": [p.to_dict() for p in self.frontier],
            "stats": asdict(self.stats),
            "settings": self.settings,
            "failed": [p.to_dict() for p in self.failed],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TuningResult:
        return cls(
            type_id=str(d["type_id"]),
            gpu_name=str(d["gpu_name"]),
            mode=str(d["mode"]),
            seed=int(d["seed"]),
            points=[MeasuredPoint.from_dict(p) for p in d["points"]],
            stats=TuningStats(**d["stats"]),
            settings=dict(d.get("settings", {})),
            failed=[FailedPoint.from_dict(p) for p in d.get("failed", [])],
        )


# ---------------------------------------------------------------------------------------------
# The run


class _Recorder:
    """Measures through the profiler, never twice for one config (a failed one included), and keeps
    provenance; ``rows``/``points`` hold the successful measurements, ``failed`` the others."""

    def __init__(
        self,
        space: SearchSpace,
        ptype: PartitionType,
        profiler: Profiler,
        planned: int,
        progress: ProgressCallback | None,
    ) -> None:
        self.space = space
        self.ptype = ptype
        self.profiler = profiler
        self.planned = planned
        self.progress = progress
        self.points: list[MeasuredPoint] = []
        self.failed: list[FailedPoint] = []
        self.rows: list[int] = []
        self.measured = np.zeros(len(space), dtype=bool)
        self.seconds = 0.0

    def measure(self, rows: Sequence[int], sources: Sequence[str], batch: int) -> None:
        prefetch = getattr(self.profiler, "prefetch", None)
        if prefetch is not None:  # a profiler measuring in parallel (process groups) takes the whole batch
            prefetch(partitions=[(self.ptype, self.space.configs[r]) for r in rows if not self.measured[r]])
        for row, source in zip(rows, sources):
            if self.measured[row]:
                continue
            cfg = self.space.configs[row]
            t0 = time.perf_counter()
            try:
                m = self.profiler.measure(self.ptype, cfg)
            except MeasurementFailedError as err:
                m = None
                self.failed.append(FailedPoint(cfg, err.reason, source, batch))
            self.seconds += time.perf_counter() - t0
            self.measured[row] = True
            if m is not None:
                self.rows.append(row)
                self.points.append(MeasuredPoint(cfg, m, source, batch))
            if self.progress is not None:
                self.progress(self.attempted, self.planned)

    @property
    def attempted(self) -> int:
        """Configurations measured or failed (what the budget counts)."""
        return len(self.points) + len(self.failed)

    def objectives(self) -> MeasuredObjectives:
        ms = [p.measurement for p in self.points]
        return MeasuredObjectives(
            time_s=np.array([m.time_s for m in ms]),
            energy_j=np.array([m.energy_j for m in ms]),
            dynamic_energy_j=np.array([m.dynamic_energy_j for m in ms]),
            static_energy_j=np.array([m.static_energy_j for m in ms]),
        )


def initial_sample(space: SearchSpace, n: int, rng: np.random.Generator) -> list[int]:
    """Rows of the initial sample (see module docstring): two anchors, then a balanced random design."""
    n = min(n, len(space))
    sms = space.comm_sms
    anchors = [PartitionConfig(space.max_clock_mhz, sms[-1], None)]
    if space.launch_options[0] is not None:
        anchors.append(PartitionConfig(space.max_clock_mhz, sms[len(sms) // 2], space.launch_options[0]))
    chosen = [space.index(cfg) for cfg in anchors][:n]
    taken = set(chosen)
    m = n - len(chosen)

    def balanced(values: Sequence) -> list:
        reps = -(-m // len(values))
        order = np.concatenate([rng.permutation(len(values)) for _ in range(reps)])[:m]
        return [values[int(i)] for i in order]

    clocks, comm, slots = balanced(space.clocks_mhz), balanced(sms), balanced(space.launch_options)
    for c, s, slot in zip(clocks, comm, slots):
        row = space.index(PartitionConfig(c, s, slot))
        if row in taken:  # collision: any untaken config instead
            free = np.array([i for i in range(len(space)) if i not in taken])
            row = int(free[rng.integers(len(free))])
        chosen.append(row)
        taken.add(row)
    return chosen


def _hv_history(result_points: list[MeasuredPoint], batches: int, margin: float, basis: RefBasis) -> list[float]:
    objs = np.array([[p.measurement.time_s, p.measurement.energy_j] for p in result_points])
    if len(objs) == 0:
        return []
    norm = Normalizer.from_points(objs)
    ref = reference_point(norm(objs), margin, basis)
    batch_of = np.array([p.batch for p in result_points])
    return [hypervolume_2d(norm(objs[batch_of <= b]), ref) for b in range(batches + 1)]


def tune_partition(
    ptype: PartitionType,
    profiler: Profiler,
    *,
    settings: MBOSettings | None = None,
    seed: int = 0,
    gpu: GPUSpec | None = None,
    progress: ProgressCallback | None = None,
) -> TuningResult:
    """Kareus MBO of one partition type: the measured (time, energy) frontier and how it was found."""
    settings = settings or MBOSettings()
    gpu = gpu or gpu_spec(profiler.gpu_name)
    space = settings.space_for(ptype, gpu)
    budget = settings.budget_for(ptype)
    cap = len(space)
    if settings.max_fraction is not None:
        cap = max(2, min(cap, int(settings.max_fraction * len(space))))
    planned = min(budget.max_measurements, cap)
    n_init = min(budget.n_init, (planned + 1) // 2)
    batch_size = capped_batch_size(budget, planned, n_init)
    rng = np.random.default_rng(seed)
    rec = _Recorder(space, ptype, profiler, planned, progress)
    rec.measure(initial_sample(space, n_init, rng), ["initial"] * n_init, batch=0)

    features = space.features()
    clocks = np.array([c.clock_mhz for c in space.configs], dtype=float)
    rel_hist: list[float] = []
    acq_seconds: list[float] = []
    batches = 0
    stop_reason = "max_batches"
    for batch in range(1, budget.max_batches + 1):
        if rec.measured.all():
            stop_reason = "exhausted"
            break
        if not rec.points:
            stop_reason = "all_failed"
            break
        size = min(batch_size, planned - rec.attempted)
        if size <= 0:
            stop_reason = "budget"
            break
        t0 = time.perf_counter()
        rows = np.array(rec.rows)
        surrogate = PartitionSurrogate(settings.xgb, gpu.static_power_w, seed=seed * 1009 + batch)
        surrogate.fit(features[rows], clocks[rows].astype(int), [p.measurement for p in rec.points])
        pred = surrogate.predict(features, clocks)
        before = rec.objectives()
        picks = select_batch(
            pred,
            before,
            ~rec.measured,
            size,
            settings.pass_fractions,
            settings.ref_margin,
            settings.ref_basis,
            neighbourhood=(space.grid_shape, rows) if settings.front_neighbours else None,
        )
        acq_seconds.append(time.perf_counter() - t0)
        rec.measure([r for r, _ in picks], [s for _, s in picks], batch=batch)
        batches = batch

        after = rec.objectives()
        tot_after = after.pair("total")
        norm = Normalizer.from_points(tot_after)
        ref = reference_point(norm(tot_after), settings.ref_margin, settings.ref_basis)
        hv_after = hypervolume_2d(norm(tot_after), ref)
        hv_before = hypervolume_2d(norm(before.pair("total")), ref)
        rel_hist.append((hv_after - hv_before) / hv_after if hv_after > 0 else 0.0)
        if converged(rel_hist, settings.window, settings.threshold):
            stop_reason = "converged"
            break
    else:
        if rec.measured.all():
            stop_reason = "exhausted"

    stats = TuningStats(
        space_size=len(space),
        measured=len(rec.points),
        batches=batches,
        n_init=n_init,
        batch_size=batch_size,
        max_batches=budget.max_batches,
        stop_reason=stop_reason,
        hv_history=_hv_history(rec.points, batches, settings.ref_margin, settings.ref_basis),
        rel_improvement_history=rel_hist,
        acq_seconds=acq_seconds,
        measure_seconds=rec.seconds,
        failed=len(rec.failed),
    )
    return TuningResult(ptype.type_id, gpu.name, "mbo", seed, rec.points, stats, settings.to_dict(), rec.failed)


def exhaustive_search(
    ptype: PartitionType,
    profiler: Profiler,
    *,
    settings: MBOSettings | None = None,
    gpu: GPUSpec | None = None,
    progress: ProgressCallback | None = None,
) -> TuningResult:
    """Measure every configuration of the space (the ground truth MBO is compared with)."""
    settings = settings or MBOSettings()
    gpu = gpu or gpu_spec(profiler.gpu_name)
    space = settings.space_for(ptype, gpu)
    rec = _Recorder(space, ptype, profiler, len(space), progress)
    rec.measure(range(len(space)), ["exhaustive"] * len(space), batch=0)
    stats = TuningStats(
        space_size=len(space),
        measured=len(rec.points),
        batches=0,
        n_init=len(space),
        batch_size=0,
        max_batches=0,
        stop_reason="exhaustive",
        hv_history=_hv_history(rec.points, 0, settings.ref_margin, settings.ref_basis),
        measure_seconds=rec.seconds,
        failed=len(rec.failed),
    )
    return TuningResult(ptype.type_id, gpu.name, "exhaustive", 0, rec.points, stats, settings.to_dict(), rec.failed)


def random_search(
    ptype: PartitionType,
    profiler: Profiler,
    n: int,
    *,
    settings: MBOSettings | None = None,
    seed: int = 0,
    gpu: GPUSpec | None = None,
    progress: ProgressCallback | None = None,
) -> TuningResult:
    """Measure ``n`` configurations drawn uniformly without replacement (the random baseline)."""
    settings = settings or MBOSettings()
    gpu = gpu or gpu_spec(profiler.gpu_name)
    space = settings.space_for(ptype, gpu)
    n = min(n, len(space))
    rows = np.random.default_rng(seed).choice(len(space), size=n, replace=False)
    rec = _Recorder(space, ptype, profiler, n, progress)
    rec.measure([int(r) for r in rows], ["random"] * n, batch=0)
    stats = TuningStats(
        space_size=len(space),
        measured=len(rec.points),
        batches=0,
        n_init=n,
        batch_size=0,
        max_batches=0,
        stop_reason="random",
        hv_history=_hv_history(rec.points, 0, settings.ref_margin, settings.ref_basis),
        measure_seconds=rec.seconds,
        failed=len(rec.failed),
    )
    return TuningResult(ptype.type_id, gpu.name, "random", seed, rec.points, stats, settings.to_dict(), rec.failed)


def frontier_hv_ratio(
    result: TuningResult, reference: TuningResult, *, strict: bool = True, margin: float = REF_MARGIN
) -> float:
    """HV of ``result``'s measured (time, total energy) front over ``reference``'s, same reference point.

    Both are normalised by the ``reference`` run's points (normally the exhaustive search: ideal =
    best, nadir = worst value in the space). The reference point is ``1 + margin`` beyond the worst
    value of the whole space (``strict=False``, lenient: the big box far from the front dominates
    the area), or beyond the worst value *on the exhaustive front* (``strict=True``, the default:
    only the region near the true frontier counts, so a miss there shows).
    """
    ref_objs = reference.objectives()
    norm = Normalizer.from_points(ref_objs)
    ref = reference_point(norm(ref_objs), margin, "front" if strict else "observed")
    denom = hypervolume_2d(norm(ref_objs), ref)
    return hypervolume_2d(norm(result.objectives()), ref) / denom if denom > 0 else 1.0
