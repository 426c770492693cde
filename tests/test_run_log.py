"""The run log: one record per iteration of a deployed plan, the drift warning, ``kareus inspect --run``.

Deployments on gloo/CPU: tiny-llama TP2 through ``torch.compile`` (conftest's session plan, 2
ranks, 2 microbatches) and TP1 x PP2 through ``torch.distributed.pipelining`` (Schedule1F1B, 2
ranks). On CPU a record's energy is the plan's price of the point run (``energy_source:
simulated``) and time is compared with the plan only when asked (``compare_time_on_cpu``), which
the compiled test does with a 1 % threshold so that the drift warning must fire, once. The drift
check itself, the reader's errors and the inspect command run on synthetic or committed records.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TINY_TP2_WORKLOAD, train_microbatches
from dist_harness import run_distributed

from kareus_fx import cli
from kareus_fx.deploy.plan_drift import DriftCheck, PlanDriftWarning
from kareus_fx.deploy.run_record import RunLogFormatError, RunRecord, read_run_log, record_line
from kareus_fx.plan.plan_format import write_plan

H200 = Path(__file__).resolve().parent.parent / "bench" / "results" / "gpu_h200"
ITERATIONS = 4
FIELDS = set(RunRecord.model_fields)


def _record(iteration: int, time_ratio: float, energy_ratio: float = 1.0, source: str = "zeus") -> RunRecord:
    return RunRecord(
        iteration=iteration,
        rank=0,
        stages=[0],
        plan="plan.json",
        gpu="A100-SXM4-40GB",
        point=0,
        clocks_mhz={"F0@S0": 1410},
        clocks_requested=True,
        time_s=0.2 * time_ratio,
        energy_j=100.0 * energy_ratio,
        energy_source=source,  # type: ignore[arg-type]
        gpus_measured=1,
        predicted_time_s=0.2,
        predicted_energy_j=100.0,
        predicted_gpus=1,
    )


def _warnings(check: DriftCheck, records: list[RunRecord]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlanDriftWarning)
        for record in records:
            check.observe(record)
    return [str(w.message) for w in caught if issubclass(w.category, PlanDriftWarning)]


def test_drift_warns_once_naming_the_ratio_and_not_on_a_matching_run():
    drifting = [_record(i, 50.0 if i == 0 else 1.3) for i in range(12)]  # iteration 0 compiles
    (message,) = _warnings(DriftCheck(threshold=0.15, window=5, warmup=1), drifting)
    assert "time 1.300x the plan's" in message and "iterations 1-5" in message
    matching = [_record(i, 50.0 if i == 0 else 1.05, 0.95) for i in range(12)]
    assert _warnings(DriftCheck(threshold=0.15, window=5, warmup=1), matching) == []
    (energy,) = _warnings(DriftCheck(window=3, warmup=0), [_record(i, 1.0, 0.7) for i in range(6)])
    assert "energy per GPU 0.700x" in energy


def test_on_cpu_time_is_compared_only_when_asked_and_simulated_energy_never():
    cpu = [_record(i, 40.0, 3.0, source="simulated") for i in range(8)]
    assert _warnings(DriftCheck(window=3, warmup=0), cpu) == []
    (message,) = _warnings(DriftCheck(window=3, warmup=0, compare_time_on_cpu=True), cpu)
    assert "time 40.000x" in message and "energy" not in message.split("measured")[1].split("(")[0]


def test_a_corrupt_run_file_names_its_line_and_the_fix(tmp_path):
    path = tmp_path / "run.jsonl"
    good = record_line(_record(0, 1.0))
    path.write_text(good + '{"version": 1, "iteration": 1, "rank"')
    with pytest.raises(RunLogFormatError, match=r"run.jsonl:2: not a run log record .*docs/formats.md"):
        read_run_log(path)
    path.write_text(good.replace('"time_s":0.2', '"time_s":-1.0'))
    with pytest.raises(RunLogFormatError, match=r"run.jsonl:1: .*time_s: Input should be greater than 0"):
        read_run_log(path)
    path.write_text(good.replace('"version":1', '"version":2'))
    with pytest.raises(RunLogFormatError, match=r":1: .*version"):
        read_run_log(path)
    path.write_text("\n")
    with pytest.raises(RunLogFormatError, match="no run log records"):
        read_run_log(path)


def test_inspect_run_prints_plots_and_gives_json_on_a_recorded_run(tmp_path, capsys):
    run, plan, page = H200 / "example_run1.jsonl", H200 / "example_plan.json", tmp_path / "run.html"
    assert cli.main(["inspect", "--run", str(run), "--plan", str(plan), "--json", "--html", str(page)]) == 0
    numbers = json.loads(capsys.readouterr().out)
    assert len(numbers["rows"]) == 6 and numbers["warmup"] == 1 and numbers["energy_source"] == "zeus"
    assert numbers["time"]["median"] == pytest.approx(220.0 / 178.046, abs=1e-3)  # median of iterations 1-5
    assert numbers["time"]["p10"] <= numbers["time"]["median"] <= numbers["time"]["p90"]
    assert 'id="ratios"' in page.read_text() and "data:image/png;base64," in page.read_text()
    assert cli.main(["inspect", "--run", str(run), "--plan", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "time median 1.236" in out and "energy per GPU median" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert cli.main(["inspect", "--run", str(bad), "--plan", str(plan)]) != 0
    assert "bad.jsonl:1" in capsys.readouterr().err


def _check_records(records: list[RunRecord], plan_data: dict, stages: list[int], rank: int) -> None:
    assert [r.iteration for r in records] == list(range(ITERATIONS))
    point = plan_data["iteration_frontier"][0]
    microbatches = plan_data["workload"]["microbatches"]
    for record in records:
        assert set(json.loads(record.model_dump_json())) == FIELDS
        assert record.rank == rank and record.stages == stages and record.point == 0
        assert record.energy_source == "simulated" and record.energy_j == point["energy_j"]
        assert record.predicted_time_s == point["time_s"] and record.time_s > 0
        assert set(record.clocks_mhz) == {f"{k}{mb}@S{s}" for s in stages for k in "FB" for mb in range(microbatches)}


def _compiled_worker(rank, world_size, plan_path, run_path):
    from kareus_fx.deploy.run_log import close_run_logs
    from kareus_fx.models import ParallelLayout, build_model

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = build_model("tiny-llama", ParallelLayout.from_default_group(tp=2, cp=1), num_layers=1, dtype=torch.float32)
    model.init_weights(seed=0)
    seq, mbs = TINY_TP2_WORKLOAD["seq"], TINY_TP2_WORKLOAD["mbs"]
    batches = [model.example_batch(mbs=mbs, seq=seq, seed=mb) for mb in range(TINY_TP2_WORKLOAD["microbatches"])]
    run_log = {"path": run_path, "compare_time_on_cpu": True, "drift_threshold": 0.01, "drift_window": 2}
    options = {"plan": plan_path, "inductor": False, "run_log": run_log}
    compiled = torch.compile(model, backend="kareus", fullgraph=True, options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlanDriftWarning)
        for _ in range(ITERATIONS):
            train_microbatches(model, compiled, batches)
        close_run_logs()
    return [str(w.message) for w in caught if issubclass(w.category, PlanDriftWarning)]


def test_a_plan_deployed_through_torch_compile_logs_every_iteration(tiny_tp2_plan_data, tmp_path):
    plan_path = write_plan(tmp_path / "plan.json", tiny_tp2_plan_data)
    drift = run_distributed(_compiled_worker, 2, str(plan_path), str(tmp_path / "run-{rank}.jsonl"), timeout_s=600)
    for rank, messages in enumerate(drift):
        _check_records(read_run_log(tmp_path / f"run-{rank}.jsonl"), tiny_tp2_plan_data, [0], rank)
        (message,) = messages  # CPU time against the simulated GPU: far off, warned once
        assert f"rank {rank} drifts" in message and "time" in message


PP2_WORKLOAD = {"model": "tiny-llama", "tp": 1, "cp": 1, "pp": 2, "microbatches": 2, "mbs": 2, "seq": 128, "layers": 2}


@pytest.fixture(scope="module")
def pp2_plan_data(tmp_path_factory):
    from kareus_fx.plan.planner import PlanRequest, make_plan

    request = PlanRequest(**PP2_WORKLOAD, clock_stride_mhz=120, dtype="float32")
    return make_plan(request, tmp_path_factory.mktemp("pp2-plan"), progress=False).data


def _pipelined_worker(rank, world_size, plan_path, run_path):
    from torch.distributed.pipelining import Schedule1F1B

    from kareus_fx.deploy.pipelining import follow_plan, kareus_stage, stage_loss
    from kareus_fx.models import ParallelLayout, PipelineStage, build_model
    from kareus_fx.models.stage_module import StageModule

    torch._dynamo.reset()
    layout = ParallelLayout.from_default_group(tp=1, pp=2)
    torch.manual_seed(0)
    model = build_model(
        "tiny-llama", layout, num_layers=PP2_WORKLOAD["layers"], dtype=torch.float32, stage=PipelineStage(rank, 2)
    )
    model.init_weights(seed=0)
    module = StageModule(model)
    mbs, seq, microbatches = PP2_WORKLOAD["mbs"], PP2_WORKLOAD["seq"], PP2_WORKLOAD["microbatches"]
    parts = [module.model.example_batch(mbs=mbs, seq=seq, seed=mb) for mb in range(microbatches)]
    batch = {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels") if k in parts[0]}
    cpu = torch.device("cpu")
    stage = kareus_stage(module, rank, 2, cpu, plan=plan_path, options={"inductor": False, "run_log": run_path})
    schedule = Schedule1F1B(stage, microbatches, loss_fn=stage_loss)
    with follow_plan(schedule, plan_path):
        for _ in range(ITERATIONS):
            if rank == 0:
                schedule.step(batch["input_ids"])
            else:
                schedule.step(labels=batch["labels"], target=batch["labels"], losses=[], return_outputs=False)
    return rank


def test_a_plan_followed_under_pipelining_logs_every_iteration_per_rank(pp2_plan_data, tmp_path):
    plan_path = write_plan(tmp_path / "plan.json", pp2_plan_data)
    run_distributed(_pipelined_worker, 2, str(plan_path), str(tmp_path / "run.jsonl"), timeout_s=600)
    for rank in range(2):  # no {rank} in the path: each rank writes run.rank<R>.jsonl
        _check_records(read_run_log(tmp_path / f"run.rank{rank}.jsonl"), pp2_plan_data, [rank], rank)
