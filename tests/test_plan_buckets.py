"""Bucketed plans: one plan holding a frontier per sequence-length bucket, deployed
per call on a graph whose sequence length is symbolic.

The plan is made once per module by the real planner for tiny-llama, TP=2, 1 layer, fp32, with
buckets of 128 and 256 tokens. Each bucket's options are then replaced by one option with a clock
of its own (bucket 128: 1200 MHz, bucket 256: 990 MHz) and every partition type sequential, so
the dry-run clock controller's requests tell which bucket ran each call. One decoder layer:
which bucket a call runs, and parity, do not depend on depth (the deployed model takes the plan's).
The deployment and run-log tests read one 2-rank run of that plan, op by op, with the run log on.

Parity tolerance: rtol=1e-5, atol=1e-6 (fp32), as tests/test_parity.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import sharing_traces
from dist_harness import run_distributed
from eager_parity import assert_matches_eager, eager_reference, mark_sequence_dynamic

from kareus_fx.plan.plan_format import PlanFormatError, instruction_key, load_plan, validate_plan, write_plan

TOL = {"rtol": 1e-5, "atol": 1e-6}
WORKLOAD = {"model": "tiny-llama", "tp": 2, "cp": 1, "pp": 1, "microbatches": 1, "mbs": 2, "layers": 1}
BUCKET_CLOCKS_MHZ = {128: 1200, 256: 990}


@pytest.fixture(scope="module")
def bucketed_plan(tmp_path_factory, session_traces):
    """A real plan of WORKLOAD's two buckets; the 256-token bucket's stage graphs are those of
    conftest's ``tiny_tp2_plan_data`` when the session traced them (the same graphs: the tracer
    does not read the microbatch count; ``sharing_traces``); tuning and composing run per bucket."""
    from kareus_fx.plan.bucketed_plan import make_bucketed_plan
    from kareus_fx.plan.request import PlanRequest

    request = PlanRequest(**WORKLOAD, seq=256, clock_stride_mhz=120, dtype="float32")
    with sharing_traces(session_traces):
        outcome = make_bucketed_plan(request, (256, 128), tmp_path_factory.mktemp("plan-work"), progress=False)
    return outcome.data


def _with_bucket_clocks(data):
    """Each bucket on one option at its own clock, every partition type sequential."""
    data = copy.deepcopy(data)
    for bucket in data["buckets"]:
        for name in ("forward", "backward"):
            key = instruction_key(0, name)
            types = sorted(set(bucket["stages"][0]["graphs"][name]["partition_types"].values()))
            option = {
                **bucket["microbatch_options"][key][0],
                "clock_mhz": BUCKET_CLOCKS_MHZ[bucket["seq"]],
                "sequential": False,
                "configs": {tid: {"comm_sms": 4, "launch_slot": None} for tid in types},
            }
            bucket["microbatch_options"][key] = [option]
            for point in bucket["iteration_frontier"]:
                point["choices"][key] = [0]
    largest = data["buckets"][-1]
    data.update({name: largest[name] for name in ("microbatch_options", "iteration_frontier")})
    return data


def test_bucketed_plan_holds_a_frontier_per_bucket_and_old_plans_still_load(bucketed_plan, tmp_path, capsys):
    from kareus_fx.cli import main

    plan = load_plan(write_plan(tmp_path / "plan.json", bucketed_plan))
    assert plan.buckets == (128, 256) and plan.workload["seq"] == 256
    assert plan.bucket_for(1) == 128 and plan.bucket_for(129) == 256 and plan.bucket_for(257) is None
    small = plan.bucket(128)
    assert small.workload["seq"] == 128 and small.frontier
    assert (
        small.data["stages"][0]["graphs"]["forward"]["fingerprint"]
        != plan.data["stages"][0]["graphs"]["forward"]["fingerprint"]
    )
    capsys.readouterr()
    main(["inspect", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert "sequence-length buckets 128, 256 (tables: the largest)" in out
    assert "seq 128: Kareus iteration frontier" in out and "seq 256: Kareus iteration frontier" in out
    one_length = {k: v for k, v in bucketed_plan.items() if k != "buckets"}
    assert load_plan(write_plan(tmp_path / "old.json", one_length)).buckets == ()


def test_bucketed_plan_with_unordered_or_wrong_buckets_is_refused(bucketed_plan):
    swapped = copy.deepcopy(bucketed_plan)
    swapped["buckets"].reverse()
    with pytest.raises(PlanFormatError, match="buckets: expected at least one bucket, in increasing distinct seq"):
        validate_plan(swapped)
    broken = copy.deepcopy(bucketed_plan)
    broken["buckets"][0]["microbatch_options"] = {}
    with pytest.raises(PlanFormatError, match=r"buckets\[0\]\.microbatch_options"):
        validate_plan(broken)


def _deployed_model(plan_path, run_log=None):
    """tiny-llama TP=2 (fp32, seeded) and its compile with ``plan_path`` deployed on a dry-run
    clock controller, op by op, writing ``run_log`` when given: (model, controller, compiled)."""
    from kareus_fx.models import ParallelLayout, build_model
    from kareus_fx.runtime.clock_controller import ClockController

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = build_model(
        WORKLOAD["model"],
        ParallelLayout.from_default_group(tp=2, cp=1),
        num_layers=load_plan(plan_path).workload["layers"],
        dtype=torch.float32,
    )
    model.init_weights(seed=0)
    controller = ClockController.open("dry-run", handle_sigterm=False)
    # Op by op: which bucket a call runs does not depend on the code generator, and Inductor's
    # code of a graph with a symbolic sequence length is tests/test_dynamic_shapes.py's.
    options = {"plan": plan_path, "clock_controller": controller, "run_log": run_log, "inductor": False}
    compiled = torch.compile(model, backend="kareus", fullgraph=True, options=options)
    return model, controller, compiled


def _run_call(compiled, controller, batch):
    """One compiled forward and backward: its loss and the clocks it requested."""
    before = len(controller.requests)
    loss = compiled(**batch)
    loss.backward()
    return loss, [r.clock_mhz for r in controller.requests[before:]]


def _bucket_messages(caught) -> list[str]:
    """The caught warnings that name a bucket, less the run log's drift warnings."""
    from kareus_fx.deploy.plan_drift import PlanDriftWarning

    return [str(w.message) for w in caught if "bucket" in str(w.message) and w.category is not PlanDriftWarning]


DEPLOYED_SEQS = (100, 200, 128, 300, 310, 120)  # buckets 128, 256, 128, none, none, 128


def _bucket_worker(rank, world_size, plan_path, run_path):
    """Every length of DEPLOYED_SEQS, compiled with the run log on and checked against eager:
    per call, the clocks requested and the bucket warnings; the plan-drift warnings of the run."""
    import warnings

    from kareus_fx.deploy.plan_drift import PlanDriftWarning
    from kareus_fx.deploy.run_log import close_run_logs

    run_log = {"path": run_path, "compare_time_on_cpu": True, "drift_threshold": 0.01, "drift_window": 2, "warmup": 1}
    model, controller, compiled = _deployed_model(plan_path, run_log)
    requests, bucket_warnings = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seq in DEPLOYED_SEQS:
            batch = model.example_batch(mbs=WORKLOAD["mbs"], seq=seq, seed=seq)
            mark_sequence_dynamic(batch)
            eager_loss, eager_grads = eager_reference(model, batch)
            before = len(caught)
            loss, clocks = _run_call(compiled, controller, batch)
            bucket_warnings += _bucket_messages(caught[before:])
            requests.append(clocks)
            assert_matches_eager(model, loss, eager_loss, eager_grads, TOL, f"seq {seq}")
        close_run_logs()
    controller.close()
    drift = [str(w.message) for w in caught if issubclass(w.category, PlanDriftWarning)]
    return {"requests": requests, "bucket_warnings": bucket_warnings, "drift": drift}


@pytest.fixture(scope="module")
def deployed_buckets(bucketed_plan, tmp_path_factory):
    """One 2-rank run of the bucketed plan (each bucket on its own clock) over DEPLOYED_SEQS,
    logging its iterations: (plan path, run log paths, each rank's result). The deployment and
    run-log tests read the same run: compiling the dynamic-shape graph on 2 gloo ranks is most of
    each test's time (about 50 s on 2 cores)."""
    root = tmp_path_factory.mktemp("deployed-buckets")
    plan_path = write_plan(root / "plan.json", _with_bucket_clocks(bucketed_plan))
    results = run_distributed(_bucket_worker, 2, str(plan_path), str(root / "run-{rank}.jsonl"), timeout_s=600)
    return plan_path, [root / f"run-{rank}.jsonl" for rank in range(2)], results


def test_bucketed_plan_deploys_each_bucket_clocks_per_call(deployed_buckets):
    plan_path, _runs, results = deployed_buckets
    for result in results:
        low, high = BUCKET_CLOCKS_MHZ[128], BUCKET_CLOCKS_MHZ[256]
        # forward and backward of each call at its bucket's clock; 300 and 310 fit no bucket.
        assert result["requests"] == [[low, low], [high, high], [low, low], [], [], [low, low]]
        caught = result["bucket_warnings"]
        assert len(caught) == 2, caught  # one warning per length
        assert "sequence length 300 is in no bucket" in caught[0] and "--seq 128,256,300" in caught[0]
        assert json.loads(plan_path.read_text())["buckets"][0]["seq"] == 128


def _one_length_worker(rank, world_size, plan_path):
    import warnings

    model, controller, compiled = _deployed_model(plan_path)
    requests = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seq in (100, 200):
            batch = model.example_batch(mbs=WORKLOAD["mbs"], seq=seq, seed=seq)
            mark_sequence_dynamic(batch)
            model.zero_grad(set_to_none=True)
            eager_loss = model(**batch)
            model.zero_grad(set_to_none=True)
            loss, clocks = _run_call(compiled, controller, batch)
            requests.append(clocks)
            torch.testing.assert_close(loss, eager_loss, **TOL)
    controller.close()
    return requests, _bucket_messages(caught)


@pytest.mark.slow
def test_one_length_plan_on_a_symbolic_graph_is_its_one_bucket(bucketed_plan, tmp_path):
    from kareus_fx.plan.plan_format import Plan

    data = _with_bucket_clocks(bucketed_plan)
    one_length = dict(Plan(data=validate_plan(data)).bucket(128).data)
    one_length.pop("buckets")
    plan_path = write_plan(tmp_path / "plan.json", one_length)
    for requests, caught in run_distributed(_one_length_worker, 2, str(plan_path), timeout_s=600):
        assert requests == [[BUCKET_CLOCKS_MHZ[128]] * 2, []]
        assert len(caught) == 1 and "sequence length 200 is in no bucket" in caught[0], caught


def test_bucketed_plan_logs_each_iterations_bucket_against_its_prediction(deployed_buckets, tmp_path, capsys):
    """Each record names the bucket its iteration ran and holds that bucket's prediction and
    clocks; the calls no bucket holds end the iteration before them and are not recorded; ``kareus
    inspect`` compares each row with its bucket's frontier; the forced drift warns once per rank."""
    from kareus_fx.cli import main
    from kareus_fx.deploy.run_record import read_run_log

    plan_path, runs, results = deployed_buckets
    plan = load_plan(plan_path)
    drift = [result["drift"] for result in results]
    for rank, (path, messages) in enumerate(zip(runs, drift)):
        records = read_run_log(path)
        assert [(r.iteration, r.bucket) for r in records] == [(0, 128), (1, 256), (2, 128), (3, 128)]
        for record in records:
            bucket = plan.bucket(record.bucket)
            predicted = bucket.frontier[bucket.point_index("max-throughput")]
            assert record.rank == rank and record.point == bucket.point_index("max-throughput")
            assert record.predicted_time_s == predicted["time_s"] and record.energy_j == predicted["energy_j"]
            assert record.clocks_mhz == dict.fromkeys(("B0@S0", "F0@S0"), BUCKET_CLOCKS_MHZ[record.bucket])
            assert record.energy_source == "simulated" and record.clocks_requested
        (message,) = messages
        assert f"rank {rank} drifts" in message
    capsys.readouterr()
    assert main(["inspect", "--run", *map(str, runs), "--plan", str(plan_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [row["bucket"] for row in rows] == [128, 256, 128, 128] * 2
    assert all(row["energy_ratio"] == pytest.approx(1.0) for row in rows)
    one_length = dict(plan.bucket(128).data)
    one_length.pop("buckets")
    assert main(["inspect", "--run", str(runs[0]), "--plan", str(write_plan(tmp_path / "128.json", one_length))]) != 0
    assert "of bucket seq=128 of a" in capsys.readouterr().err


def test_an_iteration_of_several_buckets_is_logged_at_the_largest(bucketed_plan, tmp_path):
    """The run log's bookkeeping alone (no graph runs): an iteration whose calls ran buckets 128
    and 256 is recorded at 256's point and prediction; a call without the plan ends the open iteration and
    no iteration is recorded until a planned call opens one."""
    from kareus_fx.compose.pipeline_schedule import PipelineNode
    from kareus_fx.deploy.run_log import RunLog, RunLogOptions
    from kareus_fx.deploy.run_record import read_run_log
    from kareus_fx.plan.plan_format import Plan

    data = _with_bucket_clocks(bucketed_plan)
    frontier = data["buckets"][-1]["iteration_frontier"]  # a second point, so that 256's point is not 128's
    frontier.append({**frontier[0], "time_s": frontier[0]["time_s"] * 1.1, "energy_j": frontier[0]["energy_j"] * 0.9})
    plan = Plan(data=validate_plan(data), source="plan.json")
    log = RunLog(RunLogOptions(path=tmp_path / "run.jsonl"), plan, clocks_requested=False)
    point = {128: 0, 256: len(frontier) - 1}
    forward, backward = PipelineNode(0, "forward", 0), PipelineNode(0, "backward", 0)
    for node, seq in ((forward, 128), (forward, 256), (backward, 256), (backward, 128), (forward, 128)):
        log.called(node, point[seq], seq)
    log.unplanned()
    log.unplanned()
    log.close()
    records = read_run_log(tmp_path / "run.jsonl")
    assert [(r.iteration, r.bucket) for r in records] == [(0, 256), (1, 128)]
    for record in records:
        predicted = plan.bucket(record.bucket).frontier[point[record.bucket]]
        assert record.point == point[record.bucket] and record.predicted_energy_j == predicted["energy_j"]
    assert records[1].clocks_mhz == {"F0@S0": BUCKET_CLOCKS_MHZ[128]}
