"""``kareus bench``: the performance-regression runner.

Runs each case of a suite through the planner (``make_plan``) on the simulated profiler and
records, per case:

- ``kareus.*``: the four frontier metrics of Kareus against the baselines (``metrics.py``:
  reductions against Megatron-LM and Megatron-LM + Perseus; higher is better);
- ``mbo.hv_ratio_worst_type``: per partition type, the hypervolume of the tuner's measured
  (time, energy) front over that of an exhaustive search of the type's full space (every launch
  slot the partition pass allows) on the same simulated GPU (``frontier_hv_ratio``, strict
  reference point); the mean over the types and the worst type are compared;
- ``mbo.fraction_measured_worst_type``: the largest share of a type's space the tuner measured;
- ``wall.*_per_ref``: wall time of tracing (the passes run inside it), tuning, composing, and in
  total, in units of a fixed reference workload timed in the same process just before and after
  the case (:mod:`kareus_fx.regression.reference`), so the baseline holds on a slower or loaded machine.
  The seconds themselves go into the case's ``info``.

Every number but the wall times is a simulator prediction (a calibrated cost model), deterministic
for a given seed and code; wall times depend on the code, the machine and its load, and the ratio
to the reference cancels the machine and a steady load.

It compares each metric with the baseline file under the tolerance in :data:`RULES` (relative
for the quality metrics, with a small absolute floor for values near zero; wall times regress only
when more than twice as slow, relative to the reference, and at least 10 reference units slower),
prints a table marking each regression and returns exit status 1 if any metric regressed.
``--update`` records the run's cases in the baseline file instead (other cases in the file are
kept).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kareus_fx.errors import KareusError
from kareus_fx.plan.plan_schema import comm_library_of
from kareus_fx.plan.presets import PRESETS

__all__ = [
    "ABLATIONS",
    "RULES",
    "SUITES",
    "BenchCase",
    "BenchError",
    "Comparison",
    "MetricRule",
    "compare",
    "load_baseline",
    "run_bench_command",
    "run_case",
    "write_baseline",
]

BASELINE_FORMAT = "kareus-bench-baseline"
BASELINE_VERSION = 1


class BenchError(KareusError, ValueError):
    """A baseline file or suite the runner cannot use."""


@dataclass(frozen=True)
class BenchCase:
    """One workload of a suite: a preset with request fields overridden (e.g. fewer layers), or,
    with ``preset=None``, a request given in full by ``overrides`` (``PlanRequest`` fields)."""

    preset: str | None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def name(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.overrides.items()) if k != "model" or self.preset)
        base = self.preset or str(self.overrides.get("model"))
        return f"{base}[{extra}]" if extra else base

    def request(self, ablate: str | None = None) -> Any:
        """The ``PlanRequest`` of this case, with the ablation's fields applied."""
        from kareus_fx.plan.request import PlanRequest, plan_request_from_preset

        fields = {**self.overrides, **(ABLATIONS[ablate] if ablate else {})}
        return plan_request_from_preset(self.preset, **fields) if self.preset else PlanRequest(**fields)


SUITES: dict[str, tuple[BenchCase, ...]] = {
    # CI runs this after the tests: one testbed preset cut to 4 of its 28 layers (2 per pipeline
    # stage) so tracing, tuning and composing fit in the 5 minutes CI gives it on a 2-core machine.
    # Partition types repeat per layer, so the cut model has the full model's kinds of partitions
    # with smaller counts (not checked against a 28-layer trace). The even split keeps 2 layers a
    # stage: balancing 4 layers would trace the role slices and then the stages in full (its own
    # tests are tests/test_stage_balance.py).
    "smoke": (
        BenchCase(
            "qwen3-1.7b-tp8-mbs8-seq4k",
            {"layers": 4, "stage_layers": "even"},
            note="4 of 28 layers (2 per stage, even split) so the suite fits CI's 5 minutes on 2 cores",
        ),
    ),
    # Releases: every preset of the paper at full size (testbed, table 3; emulation, table 5).
    "paper": tuple(BenchCase(name) for name, preset in PRESETS.items() if preset.in_paper),
}

ABLATIONS: dict[str, dict[str, Any]] = {
    # Every partition launches its collective at slot 0: only clocks and SM counts are searched.
    "launch-timing": {"launch_search": False},
}


# ----- metrics and tolerances -------------------------------------------------------------------
@dataclass(frozen=True)
class MetricRule:
    """When a metric regressed: it moved the wrong way by more than
    ``max(rel_tol * |baseline|, abs_tol)``."""

    better: Literal["higher", "lower"]
    rel_tol: float
    abs_tol: float

    def allowance(self, baseline: float) -> float:
        return max(self.rel_tol * abs(baseline), self.abs_tol)

    def regressed(self, baseline: float | None, value: float | None) -> bool:
        if baseline is None:
            return False  # nothing to hold it to (a metric that was n/a)
        if value is None:
            return True  # had a value, now n/a
        worse = baseline - value if self.better == "higher" else value - baseline
        return worse > self.allowance(baseline)

    def describe(self) -> str:
        if self.better == "lower" and self.rel_tol >= 1.0:
            return f"slower than {1 + self.rel_tol:g}x and +{self.abs_tol:g} ref"
        sign = "-" if self.better == "higher" else "+"
        return f"{sign}{100 * self.rel_tol:g}% (min {self.abs_tol:g})"


_REDUCTION = MetricRule("higher", rel_tol=0.05, abs_tol=0.002)
# In reference units (one is about 0.2 s on the 2-core machine that recorded the baseline): tiny
# phases are held to at least 10 units (~2 s) slower.
_WALL = MetricRule("lower", rel_tol=1.0, abs_tol=10.0)
_WALL_PHASES = ("trace_s", "tune_s", "compose_s", "total_s")
RULES: dict[str, MetricRule] = {
    "kareus.max_throughput_time_reduction": _REDUCTION,
    "kareus.max_throughput_energy_reduction": _REDUCTION,
    "kareus.iso_time_energy_reduction": _REDUCTION,
    "kareus.iso_energy_time_reduction": _REDUCTION,
    "mbo.hv_ratio_mean": MetricRule("higher", rel_tol=0.01, abs_tol=0.0),
    "mbo.hv_ratio_worst_type": MetricRule("higher", rel_tol=0.02, abs_tol=0.0),
    "mbo.fraction_measured_worst_type": MetricRule("lower", rel_tol=0.10, abs_tol=0.005),
    **{f"wall.{phase.removesuffix('_s')}_per_ref": _WALL for phase in _WALL_PHASES},
}


# ----- running a case ---------------------------------------------------------------------------
def run_case(case: BenchCase, ablate: str | None = None) -> dict[str, Any]:
    """Plan ``case`` and return ``{"metrics": {name: value}, "info": {...}}`` (see module doc)."""
    from kareus_fx.plan.planner import make_plan
    from kareus_fx.regression.reference import ReferenceTiming, time_reference_s

    request = case.request(ablate)
    with tempfile.TemporaryDirectory(prefix="kareus-bench-") as work:
        before_s = time_reference_s()
        outcome = make_plan(request, work, progress=False)
        timing = ReferenceTiming(before_s, time_reference_s())
        started = time.perf_counter()
        per_type = _tuner_quality(outcome.data, Path(work) / "dumps", request.clock_stride_mhz)
        hv_check_s = time.perf_counter() - started
    kareus = outcome.data["methods"]["kareus"]["metrics"]
    metrics: dict[str, float | None] = {f"kareus.{k}": v for k, v in sorted(kareus.items())}
    ratios = [t["hv_ratio"] for t in per_type.values()]
    metrics["mbo.hv_ratio_mean"] = sum(ratios) / len(ratios) if ratios else None
    metrics["mbo.hv_ratio_worst_type"] = min(ratios, default=None)
    metrics["mbo.fraction_measured_worst_type"] = max((t["fraction_measured"] for t in per_type.values()), default=None)
    for phase in _WALL_PHASES:
        metrics[f"wall.{phase.removesuffix('_s')}_per_ref"] = timing.in_refs(outcome.wall_s[phase])
    fastest = min(outcome.data["iteration_frontier"], key=lambda p: (p["time_s"], p["energy_j"]))
    info = {
        "request": {k: v for k, v in dataclasses.asdict(request).items() if v is not None},
        "note": case.note,
        "ablate": ablate,
        "gpu": outcome.data["gpu"],
        "profiler": outcome.data["profiler"],
        "max_throughput": {"time_s": fastest["time_s"], "energy_j": fastest["energy_j"]},
        "frontier_points": len(outcome.data["iteration_frontier"]),
        "per_type": per_type,
        "hv_check_s": hv_check_s,
        "wall_s": {phase: outcome.wall_s[phase] for phase in _WALL_PHASES},
        "reference_s": {"before": timing.before_s, "after": timing.after_s},
        "load_changed": timing.load_changed,
    }
    return {"metrics": metrics, "info": info}


def _tuner_quality(plan: Mapping[str, Any], dump_root: Path, clock_stride_mhz: int) -> dict[str, dict[str, Any]]:
    """Per plan partition type: HV ratio of the tuner's front against an exhaustive search of the
    type's full space (every launch slot the partition pass allows, so a planner that searches
    less of it, like the launch-timing ablation, scores lower), and the measured fraction of the
    space it searched. The types are rebuilt exactly from the planner's nanobatched dumps (the plan
    keeps only per-slot totals) and checked against the plan's fingerprints."""
    from kareus_fx.capture.dump import load_dump, partition_types_from_dump
    from kareus_fx.cost_models.profile_db import fingerprint
    from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
    from kareus_fx.tuner.mbo import (
        MBOSettings,
        MeasuredPoint,
        TuningResult,
        TuningStats,
        exhaustive_search,
        frontier_hv_ratio,
    )
    from kareus_fx.workload import Measurement, PartitionConfig

    records = plan["partition_types"]
    # Per pipeline stage: a local type id names different plan types on different stages (the
    # first layer of the last stage reads the activation it received, not one it computed).
    local_to_plan = {
        stage["stage"]: {
            local: plan_id for graph in stage["graphs"].values() for local, plan_id in graph["partition_types"].items()
        }
        for stage in plan["stages"]
    }
    ptypes = {}
    for path in sorted(dump_root.glob("stage*-nanobatched*/kareus_graph_*.json")):  # also the layer slices
        stage = int(path.parent.name.removeprefix("stage").split("-")[0])
        for local, ptype in partition_types_from_dump(load_dump(path)).items():
            plan_id = local_to_plan.get(stage, {}).get(local)
            if plan_id is None or plan_id in ptypes:
                continue
            rebuilt = dataclasses.replace(ptype, type_id=plan_id)  # every launch slot the pass allows
            if fingerprint(rebuilt) == records[plan_id]["fingerprint"]:
                ptypes[plan_id] = rebuilt
    missing = sorted(set(records) - set(ptypes))
    if missing:
        raise BenchError(
            f"could not rebuild partition types {', '.join(missing)} from the planner's dumps "
            f"in {dump_root}; the dump and plan formats disagree (a bug: report it)"
        )

    profiler = SimulatedProfiler(plan["gpu"])
    settings = MBOSettings(clock_stride_mhz=clock_stride_mhz)
    out = {}
    for tid, record in records.items():
        tuning = record["tuning"]
        points = [
            MeasuredPoint(
                PartitionConfig(p["clock_mhz"], p["comm_sms"], p["launch_slot"], comm_library_of(p)),
                Measurement(p["time_s"], p["energy_j"], p["dynamic_energy_j"], p["static_energy_j"]),
                p["found_by"],
                0,
            )
            for p in record["frontier"]
        ]
        stats = TuningStats(
            space_size=tuning["space_size"],
            measured=tuning["measured"],
            batches=tuning["batches"],
            n_init=0,
            batch_size=0,
            max_batches=0,
            stop_reason=tuning["stop_reason"],
        )
        tuned = TuningResult(tid, plan["gpu"], "mbo", 0, points, stats)
        exhaustive = exhaustive_search(ptypes[tid], profiler, settings=settings)
        if exhaustive.stats.space_size < tuning["space_size"]:
            raise BenchError(
                f"{tid}: the full space has {exhaustive.stats.space_size} configs, fewer than the "
                f"{tuning['space_size']} the tuner searched; the runner and the planner use "
                f"different settings"
            )
        out[tid] = {
            "hv_ratio": frontier_hv_ratio(tuned, exhaustive),
            "fraction_measured": tuning["fraction_measured"],
            "measured": tuning["measured"],
            "space_size": tuning["space_size"],
            "count": record["count"],
        }
    return out


# ----- comparing --------------------------------------------------------------------------------
ComparisonStatus = Literal["ok", "REGRESSED", "new", "missing"]


@dataclass(frozen=True)
class Comparison:
    """One metric of one case against the baseline."""

    case: str
    metric: str
    baseline: float | None
    value: float | None
    status: ComparisonStatus
    tolerance: str


def compare(results: Mapping[str, Any], baseline: Mapping[str, Any]) -> list[Comparison]:
    """Every metric of every case in ``results`` against ``baseline`` (both ``{case: {"metrics"}}``).

    A case absent from the baseline is an error (record it with ``--update``); a metric absent
    from the baseline is ``new``; one the baseline has but the run lacks is ``missing`` (a
    regression: the runner stopped measuring it)."""
    rows = []
    for case, result in results.items():
        if case not in baseline:
            raise BenchError(
                f"the baseline has no entry for {case!r} (it has {', '.join(baseline) or 'none'}); "
                f"record one with `kareus bench --update`"
            )
        base_metrics = baseline[case]["metrics"]
        for metric in sorted(set(result["metrics"]) | set(base_metrics)):
            rule = RULES.get(metric)
            value, base = result["metrics"].get(metric), base_metrics.get(metric)
            status: ComparisonStatus
            if metric not in base_metrics:
                status = "new"
            elif metric not in result["metrics"]:
                status = "missing"
            elif rule is not None and rule.regressed(base, value):
                status = "REGRESSED"
            else:
                status = "ok"
            rows.append(Comparison(case, metric, base, value, status, rule.describe() if rule else "not checked"))
    return rows


def _number(value: float | None, metric: str) -> str:
    if value is None:
        return "n/a"
    if metric.startswith("wall."):
        return f"{value:.1f} ref"
    return f"{value:.4f}"


def comparison_table(rows: Sequence[Comparison], title: str) -> Table:
    table = Table(title=title)
    for column in ("case", "metric", "baseline", "this run", "change", "tolerance", "status"):
        table.add_column(column, justify="right" if column in ("baseline", "this run", "change") else "left")
    for row in rows:
        change = ""
        if row.baseline is not None and row.value is not None:
            change = (
                f"{row.value / row.baseline:.2f}x"
                if row.metric.startswith("wall.")
                else f"{row.value - row.baseline:+.4f}"
            )
        status = f"[bold red]{row.status}[/bold red]" if row.status in ("REGRESSED", "missing") else row.status
        table.add_row(
            escape(row.case),
            row.metric,
            _number(row.baseline, row.metric),
            _number(row.value, row.metric),
            change,
            row.tolerance,
            status,
        )
    return table


# ----- the command ------------------------------------------------------------------------------
def load_baseline(path: Path) -> dict[str, Any]:
    """The ``results`` of a baseline file, validated."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BenchError(f"baseline file {path} does not exist; record one with `kareus bench --update`") from None
    except (OSError, json.JSONDecodeError) as err:
        raise BenchError(
            f"cannot read baseline file {path} ({err}); fix it or record a new one with --update"
        ) from None
    if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT or data.get("version") != BASELINE_VERSION:
        raise BenchError(
            f"{path} is not a version-{BASELINE_VERSION} {BASELINE_FORMAT} file; "
            f"record a new one with `kareus bench --update`"
        )
    return data["results"]


def write_baseline(path: Path, results: Mapping[str, Any]) -> None:
    """Record ``results`` in the baseline file, keeping the other cases it holds (so one file
    can hold the smoke and the paper suites)."""
    try:
        kept = load_baseline(path)
    except BenchError:  # no file yet, or one this version cannot read: start afresh
        kept = {}
    data = {
        "format": BASELINE_FORMAT,
        "version": BASELINE_VERSION,
        "updated_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "note": "quality metrics are simulator predictions (deterministic); wall metrics are in units of a "
        "reference workload timed in the same process (kareus_fx/regression/reference.py) and only "
        "regress when more than 2x slower; info.wall_s has the seconds on the recording machine",
        "results": {**kept, **results},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n")


def run_bench_command(
    suite: str | Sequence[BenchCase],
    baseline_path: Path,
    *,
    update: bool = False,
    as_json: bool = False,
    ablate: str | None = None,
    console: Console | None = None,
) -> int:
    """``kareus bench``: run ``suite`` (a name in :data:`SUITES`, or cases), compare or update.

    Returns the exit status: 1 if any metric regressed, 0 otherwise."""
    if ablate is not None and ablate not in ABLATIONS:
        raise BenchError(f"unknown ablation {ablate!r}; choose one of {', '.join(ABLATIONS)}")
    if update and ablate:
        raise BenchError(
            "--update with --ablate would record a deliberately worse planner as the baseline; drop one of them"
        )
    suite_name = suite if isinstance(suite, str) else "custom"
    cases = SUITES[suite] if isinstance(suite, str) else tuple(suite)
    console = console or Console()
    log = Console(stderr=True) if as_json else console
    baseline = None if update else load_baseline(baseline_path)  # a bad baseline fails before any work

    results = {}
    for case in cases:
        log.print(f"bench {suite_name}: planning {case.name}" + (f" (ablation: {ablate})" if ablate else ""))
        started = time.perf_counter()
        results[case.name] = run_case(case, ablate)
        info = results[case.name]["info"]
        reference = info["reference_s"]
        log.print(
            f"  done in {time.perf_counter() - started:.1f} s (planning {info['wall_s']['total_s']:.1f} s; "
            f"reference workload {reference['before']:.3f} s before, {reference['after']:.3f} s after)"
        )
        if info["load_changed"]:
            log.print(
                "  [yellow]warning: the machine's speed changed by more than 1.5x while this case ran; "
                "its wall metrics are unreliable (rerun on a quieter machine)[/yellow]"
            )

    if baseline is None:  # --update: record the results instead of comparing them
        write_baseline(baseline_path, results)
        if as_json:
            print(json.dumps({"suite": suite_name, "results": results, "updated": str(baseline_path)}))
        else:
            console.print(f"wrote {baseline_path} ({len(results)} case(s))")
        return 0

    rows = compare(results, baseline)
    regressed = [r for r in rows if r.status in ("REGRESSED", "missing")]
    if as_json:
        print(
            json.dumps(
                {
                    "suite": suite_name,
                    "ablate": ablate,
                    "results": results,
                    "comparison": [dataclasses.asdict(r) for r in rows],
                    "regressed": [f"{r.case} {r.metric}" for r in regressed],
                },
                allow_nan=False,
            )
        )
    else:
        console.print(comparison_table(rows, title=f"kareus bench --suite {suite_name} against {baseline_path}"))
    for r in regressed:
        print(
            f"kareus bench: regression: {r.case} {r.metric}: {_number(r.baseline, r.metric)} -> "
            f"{_number(r.value, r.metric)} (tolerance {r.tolerance})",
            file=sys.stderr,
        )
    if not regressed:
        (log if as_json else console).print(f"no regressions ({len(rows)} metrics within tolerance)")
    return 1 if regressed else 0
