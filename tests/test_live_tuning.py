"""Compile-time tuning on the live graph (``kareus_fx/plan/live_tuning.py``), 2 gloo processes.

tiny-llama, TP=2, 2 layers, fp32, microbatches of [2, 256] tokens: ``options={"tune": "simulated",
"plan_out": ..., "microbatches": 2}`` traces the live Dynamo graph (no reference model), tunes it
on the simulated A100, writes the plan and deploys it. Parity tolerance as tests/test_codegen.py:
rtol=1e-5, atol=1e-6 (fp32; the nanobatch split sums weight gradients from two halves).
At this size the tuned max-throughput point runs every microbatch un-split (too little to
overlap); which graph runs each microbatch is checked against the plan, whatever it chose.
"""

from __future__ import annotations

import pytest
import torch
from conftest import train_microbatches
from dist_harness import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-6}
MBS, SEQ, LAYERS = 2, 256, 2


def _live_worker(rank, world_size, plan_out):
    from kareus_fx.deploy.variants import deployed_graphs
    from kareus_fx.models import ParallelLayout, build_model

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(
        "tiny-llama", ParallelLayout.from_default_group(tp=world_size), num_layers=LAYERS, dtype=torch.float32
    )
    model.init_weights(seed=0)
    batches = [model.example_batch(mbs=MBS, seq=SEQ, seed=mb) for mb in range(2)]

    eager_losses, eager_grads = train_microbatches(model, model, batches)
    compiled = torch.compile(
        model,
        backend="kareus",
        fullgraph=True,
        options={"tune": "simulated", "plan_out": plan_out, "microbatches": 2, "inductor": False},
    )
    for _ in range(2):
        losses, grads = train_microbatches(model, compiled, batches)
        for loss, eager in zip(losses, eager_losses):
            torch.testing.assert_close(loss, eager, **TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    return [(g.name, list(g.microbatches), g.nanobatched, len(g.partitions)) for g in deployed_graphs()]


# About 30 s on 2 cores. Fast coverage: tests/test_hf_models.py tunes live TP2 graphs on 2 ranks
# and deploys them; tests/test_codegen.py deploys a plan per microbatch and tunes at compile time.
@pytest.mark.slow
def test_tuning_the_live_graph_writes_and_deploys_a_plan(tmp_path):
    from kareus_fx.plan.plan_format import load_plan

    plan_out = tmp_path / "live" / "plan.json"
    results = run_distributed(_live_worker, 2, str(plan_out), timeout_s=600)
    plan = load_plan(plan_out)
    assert plan.workload | {"layers": plan.workload["layers"]} == {
        "model": "live-graph",
        "tp": 2,
        "cp": 1,
        "pp": 1,
        "microbatches": 2,
        "mbs": MBS,
        "seq": SEQ,
        "layers": None,
        "stage_layers": None,
        "world_size": 2,
        "preset": None,
        "dtype": "float32",
        "dp": 1,
        "recompute": "none",
        "virtual_stages": 1,
        "compile_unit": "stage",
        "ep": 1,
        "expert_imbalance": 1.0,
    }
    assert plan.data["simulated"] and plan.data["partition_types"]
    point = plan.point_index("max-throughput")
    for graphs in results:
        # Both instructions were compiled from the plan: each microbatch by the graph its option names.
        for name in ("forward", "backward"):
            runs = {mb: nanobatched for g, mbs, nanobatched, _ in graphs if g == name for mb in mbs}
            assert sorted(runs) == [0, 1], graphs
            for mb, nanobatched in runs.items():
                assert nanobatched == (not plan.option(point, 0, "forward", mb)["sequential"])
    assert results[0] == results[1]


def test_live_tuning_refuses_a_pipeline_stage_and_a_missing_output(tmp_path):
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(4, 2), backend="kareus", options={"tune": "simulated"})
    with pytest.raises(Exception, match=r"option 'tune' needs 'plan_out'"):
        compiled(torch.randn(3, 4))
    torch._dynamo.reset()
    compiled = torch.compile(
        torch.nn.Linear(4, 2),
        backend="kareus",
        options={"tune": "simulated", "plan_out": str(tmp_path / "p.json"), "stage": 1},
    )
    with pytest.raises(Exception, match=r"plans the live graph as one pipeline stage, but options stage=1"):
        compiled(torch.randn(3, 4))
