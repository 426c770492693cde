"""The run log of a plan deployed through the torchtitan integration.

torchtitan 0.3.0's llama3 debugmodel (2 layers, TP=2 with sequence parallelism, 2 gloo ranks, fp32,
``tests/torchtitan_llama.py``) trained ITERATIONS steps (SGD) with its blocks compiled by
:func:`kareus_fx.integrations.torchtitan.kareus_parallelize`, options from ``KAREUS_OPTIONS``: the
block graph tuned at its first call (``tune: simulated``, the plan written to ``plan_out``) and
that plan deployed with ``run_log``. Both blocks run one Dynamo graph, so each reports its calls
to the rank's one run log: a record per training step per rank. On CPU the energy is the plan's
price (``energy_source: simulated``); time is compared with the simulated GPU's only because
``compare_time_on_cpu`` asks, with a 1 % threshold, so the drift warning must fire, once per rank.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from dist_harness import run_distributed

from kareus_fx import cli
from kareus_fx.deploy.run_record import RunRecord, read_run_log
from kareus_fx.plan.plan_format import load_plan

LAYERS, BATCH, SEQ, VOCAB, ITERATIONS = 2, 4, 32, 2048, 4


def _train(rank: int, world_size: int, plan_out: str, run_path: str) -> list[str]:
    """ITERATIONS training steps; the PlanDriftWarning messages of this rank."""
    from torch.distributed.tensor import DTensor
    from torchtitan_llama import debug_llama

    from kareus_fx.deploy.plan_drift import PlanDriftWarning
    from kareus_fx.deploy.run_log import close_run_logs

    run_log = {"path": run_path, "compare_time_on_cpu": True, "drift_threshold": 0.01, "drift_window": 2}
    options = {"inductor": False, "tune": "simulated", "plan_out": plan_out, "run_log": run_log}
    os.environ["KAREUS_OPTIONS"] = json.dumps(options)
    torch.manual_seed(0)
    model = debug_llama(world_size, LAYERS).model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlanDriftWarning)
        for _ in range(ITERATIONS):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            out = model(tokens)
            out = out.full_tensor() if isinstance(out, DTensor) else out
            torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
        close_run_logs()
    return [str(w.message) for w in caught if issubclass(w.category, PlanDriftWarning)]


def test_a_plan_deployed_through_torchtitan_logs_every_step_per_rank(tmp_path, capsys):
    plan_out = tmp_path / "block_plan.json"
    drift = run_distributed(_train, 2, str(plan_out), str(tmp_path / "run.jsonl"), timeout_s=900)
    plan = load_plan(plan_out)
    predicted = plan.frontier[plan.point_index("max-throughput")]
    runs = [tmp_path / f"run.rank{rank}.jsonl" for rank in range(2)]
    for rank, (path, messages) in enumerate(zip(runs, drift)):
        records = read_run_log(path)
        assert [r.iteration for r in records] == list(range(ITERATIONS))  # one line per step
        for record in records:
            assert set(json.loads(record.model_dump_json())) == set(RunRecord.model_fields)
            assert record.rank == rank and record.stages == [0] and record.plan == str(plan_out)
            assert record.energy_source == "simulated" and record.energy_j == predicted["energy_j"]
            assert record.predicted_time_s == predicted["time_s"] and record.predicted_gpus == 2
            assert record.bucket is None and set(record.clocks_mhz) == {"F0@S0", "B0@S0"}
        (message,) = messages  # CPU time against the simulated GPU: far off, warned once
        assert f"rank {rank} drifts" in message and "time" in message
    capsys.readouterr()
    assert cli.main(["inspect", "--run", *map(str, runs), "--plan", str(plan_out), "--json"]) == 0
    comparison = json.loads(capsys.readouterr().out)
    assert len(comparison["rows"]) == 2 * ITERATIONS and comparison["energy_source"] == "simulated"
    assert comparison["energy"]["median"] == pytest.approx(1.0)  # the simulated price is the plan's
