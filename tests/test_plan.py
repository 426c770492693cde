"""``kareus plan`` end to end: bad input, a small real plan, and (slow) a paper preset.

Every time and energy here comes from the simulated A100 (a calibrated cost model).
"""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import torch

from kareus_fx import cli
from kareus_fx.plan.plan_format import load_plan

RTOL = 1e-6
"""Relative slack when checking frontier dominance (sums of floats)."""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "qwen3-1.7b-tp9"], "unknown preset 'qwen3-1.7b-tp9'; did you mean"),
        (["--preset", "qwen3-1.7b-tp8-mbs8-seq4k", "--gpu", "V100"], "unknown GPU"),
        (
            ["--model", "qwen3-1.7b", "--tp", "3", "--mbs", "8", "--seq", "4096"],
            "tp=3 does not divide 16 attention heads",
        ),
        (
            ["--model", "llama3.2-3b", "--tp", "8", "--pp", "4", "--microbatches", "2", "--mbs", "8", "--seq", "4096"],
            "2 microbatches cannot fill a 4-stage 1F1B pipeline",
        ),
        (
            [
                "--model",
                "llama3.2-3b",
                "--tp",
                "8",
                "--pp",
                "40",
                "--microbatches",
                "64",
                "--mbs",
                "8",
                "--seq",
                "4096",
            ],
            "pp=40 pipeline stages need at least 40 decoder layers",
        ),
        (["--model", "llama3.2-3b", "--mbs", "8"], "--model needs --seq"),
        (["--preset", "qwen3-1.7b-tp8-mbs8-seq4k", "--dp", "0"], "--dp must be a number of data-parallel replicas"),
        (["--preset", "qwen3-1.7b-tp8-mbs8-seq4k", "--profiler", "cuda"], "on-device"),
        (["--preset", "qwen3-1.7b-tp8-mbs8-seq4k", "--nproc", "8"], "--nproc starts the processes of a distributed"),
        (["--preset", "qwen3-1.7b-tp8-mbs8-seq4k", "--peer-timeout", "5"], "--peer-timeout applies to"),
        (
            ["--preset", "qwen3-1.7b-tp8-mbs8-seq4k", "--profiler", "cpu-replay", "--workers", "2"],
            "cpu-replay measures with its process groups",
        ),
    ],
)
def test_bad_input_is_refused_before_tracing(no_tracing, monkeypatch, tmp_path, capsys, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the cuda case also on a GPU node
    assert cli.main(["plan", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def _dominates(front, other) -> bool:
    """Every point of ``other`` is matched by a point of ``front`` no slower and no costlier."""
    return all(any(t <= ot * (1 + RTOL) and e <= oe * (1 + RTOL) for t, e in front) for ot, oe in other)


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    """A real plan: Llama-3.2-3B's shapes at TP8 with 2 layers over 2 pipeline stages."""
    out = tmp_path_factory.mktemp("plan")
    argv = [
        "plan",
        "--model",
        "llama3.2-3b",
        "--tp",
        "8",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--mbs",
        "4",
        "--seq",
        "2048",
        "--layers",
        "2",
        "--out",
        str(out),
        "--json",
    ]
    assert cli.main(argv) == 0
    return out


def test_small_plan_writes_a_valid_plan_csv_and_report(small_plan, capsys):
    plan = load_plan(small_plan / "plan.json")
    assert plan.workload["pp"] == 2 and plan.workload["world_size"] == 16
    assert plan.workload["stage_layers"] == [1, 1]  # a --model request: Megatron-LM's even split
    written = json.loads((small_plan / "plan.json").read_text())["workload"]
    assert "ep" not in written and "expert_imbalance" not in written  # a dense plan's file as before
    assert (plan.workload["ep"], plan.workload["expert_imbalance"]) == (1, 1.0)  # the schema's defaults
    assert set(plan.data["methods"]) == {
        "megatron",
        "megatron+perseus",
        "nanobatching",
        "nanobatching+perseus",
        "kareus",
        "megatron+power-limit",
    }
    with open(small_plan / "frontier.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} == set(plan.data["methods"])
    html = (small_plan / "report.html").read_text()
    assert 'src="data:image/png;base64,' in html and "iso-time energy reduction" in html
    assert (small_plan / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # about 115 s on a loaded machine (the trace runs again); fast sibling: the --dp 0 case above
def test_dp_plan_counts_every_gpu_of_the_job(small_plan, tmp_path, capsys):
    """``--dp 2``: the same schedule per replica, so times are equal and energies double; the plan
    and its report say the energies are the job's (2 replicas x 16 GPUs). Resumes the small plan's
    profile database, so nothing is measured again."""
    out = tmp_path / "dp2"
    shutil.copytree(small_plan / "work", out / "work")
    argv = ["plan", "--model", "llama3.2-3b", "--tp", "8", "--pp", "2", "--microbatches", "4", "--mbs", "4"]
    argv += ["--seq", "2048", "--layers", "2", "--dp", "2", "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    one, two = load_plan(small_plan / "plan.json").data, load_plan(out / "plan.json").data
    assert (one["workload"]["dp"], two["workload"]["dp"]) == (1, 2)
    assert two["workload"]["world_size"] == 16  # one pipeline's GPUs
    assert "2 data-parallel replicas x 16 GPUs (tp x cp x pp) = 32 GPUs" in two["energy_scope"]
    assert len(two["iteration_frontier"]) == len(one["iteration_frontier"])
    for a, b in zip(one["iteration_frontier"], two["iteration_frontier"]):
        assert b["time_s"] == a["time_s"] and b["choices"] == a["choices"]
        assert b["energy_j"] == pytest.approx(2 * a["energy_j"], rel=1e-12)
    for method, record in two["methods"].items():
        for (t1, e1), (t2, e2) in zip(one["methods"][method]["frontier"], record["frontier"]):
            assert t2 == t1 and e2 == pytest.approx(2 * e1, rel=1e-12)
    assert "DP2" in (out / "report.html").read_text()


def test_small_plan_reports_what_its_profiling_costs_on_the_device(small_plan):
    """Every measurement the plan used, once: the tuned and baseline partition configurations (each
    stored once in the profile database and logged once) and the sequences at each of 18 clocks."""
    import sqlite3

    profiling = load_plan(small_plan / "plan.json").data["profiling"]
    with sqlite3.connect(small_plan / "work" / "profile.sqlite") as conn:
        stored = conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
    with sqlite3.connect(small_plan / "work" / "profile-queue.sqlite") as conn:
        logged = conn.execute("SELECT COUNT(*), COUNT(DISTINCT key), SUM(inserted) FROM log").fetchone()
    assert logged == (stored, stored, stored)  # each measured and stored exactly once
    sequences = profiling["measurements"] - stored
    assert sequences > 0 and sequences % 18 == 0
    # Nanobatching's configuration of each type at each of 18 clocks (NCCL's default SMs, the collective
    # launched first) is stored once, under NCCL: the tuner's configurations are MSCCL++'s, never the same key.
    from kareus_fx.cost_models.sim_params import gpu_params

    split = profiling["by_purpose"]
    types = load_plan(small_plan / "plan.json").data["partition_types"]
    default_sms = gpu_params("A100-SXM4-40GB").params.default_comm_sms
    with sqlite3.connect(small_plan / "work" / "profile.sqlite") as conn:
        nanobatching_configs = conn.execute(
            "SELECT COUNT(*) FROM measurements WHERE comm_sms = ? AND launch_slot = 0 AND comm_library = 'nccl'",
            (default_sms,),
        ).fetchone()[0]
        libraries = {row[0] for row in conn.execute("SELECT DISTINCT comm_library FROM measurements")}
    assert nanobatching_configs == 18 * len(types) and libraries == {"nccl", "mscclpp"}
    assert split["sequences"] == sequences and split["tuning"] + split["nanobatching"] == stored
    assert split["nanobatching"] == 18 * len(types) and split["tuning"] == stored - 18 * len(types)
    assert profiling["duplicates"] == 0 and profiling["groups"] == 1 and profiling["gpus_per_group"] == 8
    assert profiling["wall_s_on_device"] == pytest.approx(profiling["measurements"] * (5.0 + 5.0))
    assert profiling["gpu_hours"] == pytest.approx(profiling["wall_s_on_device"] * 8 / 3600)
    assert "GPU-hours" in (small_plan / "report.html").read_text()


def test_small_plan_exports_a_perseus_profile_the_composer_reads_back(small_plan):
    """perseus_profile.csv: the sequential microbatch per stage, instruction and clock; composed
    again it gives the Megatron-LM + Perseus frontier of the plan (per GPU, so scaled by tp x cp)."""
    from kareus_fx.compose.iteration import compose_iteration
    from kareus_fx.compose.perseus_csv import read_perseus_profile

    plan = load_plan(small_plan / "plan.json")
    profile = read_perseus_profile(small_plan / "perseus_profile.csv")
    assert sorted(profile) == [(0, "backward"), (0, "forward"), (1, "backward"), (1, "forward")]
    assert all(len(options) == 18 for options in profile.values())  # 900-1410 MHz by 30
    w = plan.workload
    fastest = min(p.time_s for p in compose_iteration(profile, w["microbatches"], blocking_power_w=80.0).points)
    tail_s = plan.data["step_tail"]["time_s"]  # the gradient sync and optimizer step after the pipeline
    assert fastest + tail_s == pytest.approx(
        min(t for t, _ in plan.data["methods"]["megatron+perseus"]["frontier"]), rel=1e-6
    )


def test_small_plan_kareus_frontier_dominates_the_baselines(small_plan):
    methods = load_plan(small_plan / "plan.json").data["methods"]
    kareus = methods["kareus"]["frontier"]
    for baseline in ("megatron", "megatron+perseus", "nanobatching", "nanobatching+perseus"):
        assert _dominates(kareus, methods[baseline]["frontier"]), baseline
    k, n = methods["kareus"]["metrics"], methods["nanobatching+perseus"]["metrics"]
    for key in ("iso_time_energy_reduction", "iso_energy_time_reduction"):
        assert k[key] is not None
        assert n[key] is None or k[key] >= n[key] - RTOL, key


def test_small_plan_frontier_points_replay_from_their_choices(small_plan):
    """Each Kareus frontier point's time is the 1F1B critical path of the options it chose, then the
    step after the last microbatch (``step_tail``)."""
    from kareus_fx.compose.pipeline_schedule import build_1f1b_dag, makespan_s

    plan = load_plan(small_plan / "plan.json")
    w = plan.workload
    dag = build_1f1b_dag(w["pp"], w["microbatches"])
    for index, point in enumerate(plan.frontier):
        durations = {
            node: plan.option(index, node.stage, node.instruction, node.microbatch)["time_s"] for node in dag.nodes
        }
        assert makespan_s(dag, durations) + plan.data["step_tail"]["time_s"] == pytest.approx(point["time_s"], rel=1e-9)


@pytest.mark.slow
def test_qwen_preset_json_reports_the_four_methods(tmp_path, capsys):
    """The acceptance run (under 10 minutes on the 2-core machine; wall_s is reported)."""
    assert cli.main(["plan", "--preset", "qwen3-1.7b-tp8-mbs8-seq4k", "--json", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    methods = result["methods"]
    for name in ("megatron", "megatron+perseus", "nanobatching+perseus", "kareus"):
        assert methods[name]["frontier"] and set(methods[name]["metrics"]) == {
            "max_throughput_time_reduction",
            "max_throughput_energy_reduction",
            "iso_time_energy_reduction",
            "iso_energy_time_reduction",
        }
    assert _dominates(methods["kareus"]["frontier"], methods["megatron+perseus"]["frontier"])
    assert _dominates(methods["kareus"]["frontier"], methods["nanobatching+perseus"]["frontier"])
    assert result["wall_s"] > 0
