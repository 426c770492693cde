"""``kareus bench``: tolerances, comparison, a real run of a tiny case, and (slow) the smoke suite
against the committed baseline and with launch-timing search turned off."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from kareus_fx.cli import main
from kareus_fx.regression import reference
from kareus_fx.regression.reference import ReferenceTiming
from kareus_fx.regression.runner import (
    RULES,
    SUITES,
    BenchCase,
    BenchError,
    MetricRule,
    compare,
    load_baseline,
    run_bench_command,
    run_case,
    write_baseline,
)

REPO = Path(__file__).resolve().parents[1]
COMMITTED_BASELINE = REPO / "bench" / "baseline.json"
TINY = BenchCase(
    None, {"model": "tiny-llama", "tp": 2, "cp": 1, "pp": 2, "microbatches": 4, "mbs": 4, "seq": 64, "layers": 4}
)


@pytest.fixture(scope="module")
def tiny_result():
    """``run_case(TINY)`` with the reference workload timed once (after its warm-up run) on each
    side of the case instead of the median of 5: the tests check that the wall metrics are that
    timing's units and that every metric is recorded, not the median's spread (about 14 s less
    under load)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "time_reference_s", functools.partial(reference.time_reference_s, repeats=1))
        return run_case(TINY)


def test_rules_regress_only_in_the_worse_direction_beyond_the_tolerance():
    higher = MetricRule("higher", rel_tol=0.05, abs_tol=0.002)
    assert not higher.regressed(0.10, 0.096)  # -4 % of the value: within 5 %
    assert higher.regressed(0.10, 0.094)
    assert not higher.regressed(0.10, 0.5)  # better is never a regression
    assert not higher.regressed(0.0005, -0.001)  # near zero the absolute floor applies
    assert higher.regressed(0.0005, -0.002)
    assert higher.regressed(0.10, None) and not higher.regressed(None, 0.1)
    wall = RULES["wall.total_per_ref"]  # in reference-workload units
    assert not wall.regressed(60.0, 119.0) and wall.regressed(60.0, 121.0)
    assert not wall.regressed(2.0, 11.9)  # tiny phases: at least 10 units slower
    assert not wall.regressed(60.0, 1.0)  # faster is fine


def test_wall_metrics_are_in_units_of_the_reference_timed_around_the_case():
    """A machine 3x slower takes 3x longer on the case and on the reference: the same metric."""
    fast, slow = ReferenceTiming(0.2, 0.2), ReferenceTiming(0.6, 0.6)
    assert fast.in_refs(20.0) == pytest.approx(slow.in_refs(60.0)) == pytest.approx(100.0)
    assert ReferenceTiming(0.2, 0.4).reference_s == pytest.approx(0.3)
    assert not ReferenceTiming(0.2, 0.29).load_changed and ReferenceTiming(0.2, 0.31).load_changed
    assert ReferenceTiming(0.31, 0.2).load_changed


def test_compare_marks_regressions_new_and_missing_metrics():
    base = {
        "case": {
            "metrics": {
                "kareus.max_throughput_time_reduction": 0.10,
                "wall.total_per_ref": 10.0,
                "mbo.hv_ratio_worst_type": 0.95,
            }
        }
    }
    run = {
        "case": {
            "metrics": {
                "kareus.max_throughput_time_reduction": 0.05,
                "wall.total_per_ref": 12.0,
                "mbo.fraction_measured_worst_type": 0.1,
            }
        }
    }
    status = {row.metric: row.status for row in compare(run, base)}
    assert status == {
        "kareus.max_throughput_time_reduction": "REGRESSED",
        "wall.total_per_ref": "ok",
        "mbo.hv_ratio_worst_type": "missing",
        "mbo.fraction_measured_worst_type": "new",
    }
    with pytest.raises(BenchError, match="no entry for 'other'"):
        compare({"other": run["case"]}, base)


def test_bench_cli_rejects_a_missing_baseline_and_update_with_ablation(tmp_path, capsys):
    missing = tmp_path / "none.json"
    assert main(["bench", "--suite", "smoke", "--baseline", str(missing)]) == 2
    assert "does not exist; record one with `kareus bench --update`" in capsys.readouterr().err
    assert main(["bench", "--baseline", str(missing), "--update", "--ablate", "launch-timing"]) == 2
    assert "would record a deliberately worse planner" in capsys.readouterr().err
    assert not missing.exists()


def test_update_keeps_the_other_cases_of_the_baseline_file(tmp_path):
    path = tmp_path / "baseline.json"
    write_baseline(path, {"smoke-case": {"metrics": {"wall.total_per_ref": 1.0}}})
    write_baseline(path, {"paper-case": {"metrics": {"wall.total_per_ref": 2.0}}})
    assert set(load_baseline(path)) == {"smoke-case", "paper-case"}
    path.write_text("{}")
    with pytest.raises(BenchError, match="is not a version-1 kareus-bench-baseline file"):
        load_baseline(path)


def test_suites_define_smoke_as_one_cut_preset_and_paper_as_full_presets():
    (smoke,) = SUITES["smoke"]
    assert smoke.overrides == {"layers": 4, "stage_layers": "even"} and "28 layers" in smoke.note
    assert all(case.overrides == {} for case in SUITES["paper"])


def test_tiny_case_records_every_checked_metric(tiny_result):
    metrics = tiny_result["metrics"]
    assert set(metrics) == set(RULES)
    per_type = tiny_result["info"]["per_type"]
    assert per_type, "the tiny model has partition types"
    for record in per_type.values():
        # the tuner's front against the exhaustive front of the full space, same simulator (up to
        # 1e-3 above 1: the simulator's cached power-cap clock makes a prediction depend slightly
        # on the order configurations are asked in)
        assert 0.0 < record["hv_ratio"] <= 1.0 + 1e-3
        assert 0.0 < record["fraction_measured"] <= 0.15 + 1e-9
    assert metrics["mbo.hv_ratio_worst_type"] == min(r["hv_ratio"] for r in per_type.values())
    assert metrics["wall.total_per_ref"] >= metrics["wall.trace_per_ref"] + metrics["wall.tune_per_ref"] > 0
    wall_s, reference_s = tiny_result["info"]["wall_s"], tiny_result["info"]["reference_s"]
    assert reference_s["before"] > 0 and reference_s["after"] > 0
    mean_reference_s = (reference_s["before"] + reference_s["after"]) / 2
    assert metrics["wall.total_per_ref"] == pytest.approx(wall_s["total_s"] / mean_reference_s)


def test_tiny_case_against_a_baseline_it_regressed_from(tiny_result, tmp_path, capsys):
    """The comparison path of the command on real results: a baseline that records a better tuner
    (HV ratio +0.1 on every type's worst) flags exactly that metric."""
    better = {
        "metrics": {
            **tiny_result["metrics"],
            "mbo.hv_ratio_worst_type": tiny_result["metrics"]["mbo.hv_ratio_worst_type"] + 0.1,
        }
    }
    rows = compare({TINY.name: tiny_result}, {TINY.name: better})
    assert [r.metric for r in rows if r.status == "REGRESSED"] == ["mbo.hv_ratio_worst_type"]
    assert [r.metric for r in compare({TINY.name: tiny_result}, {TINY.name: tiny_result}) if r.status != "ok"] == []


@pytest.mark.slow
def test_committed_baseline_passes_the_smoke_suite(capsys):
    assert main(["bench", "--suite", "smoke", "--baseline", str(COMMITTED_BASELINE)]) == 0
    assert "no regressions" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason=(
        "on the current cost model the launch slot is worth little on the simulated GPU (it "
        "already failed on main before the balanced stages); the smoke case tuned without it (360 configurations a type instead of "
        "1,080-1,260, the same 15 % budget) scores higher, e.g. Kareus iso-energy time reduction 0.0758 "
        "against the baseline's 0.0715 (NCCL's 24 baseline SMs), so no quality metric regresses (kareus bench --suite smoke "
        "--baseline bench/baseline.json --ablate launch-timing --json)"
    ),
)
def test_smoke_suite_without_launch_timing_search_exits_1_naming_the_metric(capsys):
    assert (
        main(
            ["bench", "--suite", "smoke", "--baseline", str(COMMITTED_BASELINE), "--ablate", "launch-timing", "--json"]
        )
        == 1
    )
    captured = capsys.readouterr()
    regressed = json.loads(captured.out)["regressed"]
    case = "qwen3-1.7b-tp8-mbs8-seq4k[layers=4,stage_layers=even]"
    quality = [r for r in regressed if not r.startswith(f"{case} wall.")]
    assert quality, f"only wall times regressed: {regressed}"
    for entry in regressed:  # each regression is named on stderr
        assert f"regression: {entry}:" in captured.err


@pytest.mark.slow
def test_update_then_rerun_of_a_tiny_suite_passes(tmp_path):
    baseline = tmp_path / "baseline.json"
    assert run_bench_command([TINY], baseline, update=True) == 0
    assert json.loads(baseline.read_text())["results"][TINY.name]["metrics"]
    assert run_bench_command([TINY], baseline) == 0
