"""Variable sequence lengths: the nanobatch split under Dynamo's dynamic shapes.

A TP=2 tiny Llama over gloo (2 processes) is fed a different sequence length every step, as
fine-tuning batches padded to their longest sample are. After Dynamo's recompile with a symbolic
sequence length (automatic dynamic, ``mark_dynamic`` on the sequence dim, or ``dynamic=True``),
the graph must still be split (no fallback warning), must not be specialised again on the
sequence length (no further recompiles), and the loss and every gradient must equal eager.

Tolerance: fp32, rtol=1e-5, atol=1e-6 (as tests/test_parity.py): the split sums each weight
gradient from two nanobatch halves, a different summation order than eager.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from eager_parity import assert_matches_eager, eager_reference, mark_sequence_dynamic

TOL = {"rtol": 1e-5, "atol": 1e-6}
SEQ_LENS = (12, 10, 16, 9)  # a new length every step


def _dynamic_seq_worker(rank, world_size, mode, dump_dir):
    import warnings

    import kareus_fx.capture.compile_step as compile_step
    from kareus_fx.models import ParallelLayout, build_model
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    torch.manual_seed(0)
    torch._dynamo.reset()
    # One decoder layer: the split under dynamic shapes, the recompile count and the parity do not
    # depend on depth.
    model = build_model("tiny-llama", ParallelLayout.from_default_group(tp=2, cp=1), num_layers=1, dtype=torch.float32)
    model.init_weights(seed=0)

    splits = []  # (split applied, graph has symbolic sizes) per Dynamo graph compiled
    real_split = compile_step.split_nanobatches

    def recording_split(gm, example_inputs, **kwargs):
        result = real_split(gm, example_inputs, **kwargs)
        symbolic = any(isinstance(x, torch.SymInt) for x in example_inputs)
        splits.append((result.split, symbolic, result.reason))
        return result

    compile_step.split_nanobatches = recording_split
    compiled = torch.compile(
        model,
        backend="kareus",
        fullgraph=True,
        options={"dump_dir": dump_dir},
        dynamic=True if mode == "dynamic_true" else None,
    )
    fallbacks = []
    for seq in SEQ_LENS:
        batch = model.example_batch(mbs=4, seq=seq)
        if mode == "mark_dynamic":
            mark_sequence_dynamic(batch)
        eager_loss, eager_grads = eager_reference(model, batch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = compiled(**batch)
            loss.backward()
        fallbacks += [str(w.message) for w in caught if issubclass(w.category, NanobatchFallbackWarning)]
        assert_matches_eager(model, loss, eager_loss, eager_grads, TOL, f"seq {seq}")
    if mode == "dynamic_true":  # the split specialised the batch size: another one recompiles
        batch = model.example_batch(mbs=2, seq=11)
        model.zero_grad(set_to_none=True)
        compiled(**batch).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        model(**batch).backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, **TOL)
    compile_step.split_nanobatches = real_split
    return splits, fallbacks


@pytest.mark.parametrize(
    "mode",
    [
        "automatic",
        pytest.param("mark_dynamic", marks=pytest.mark.slow),
        pytest.param("dynamic_true", marks=pytest.mark.slow),
    ],
)
def test_split_applies_and_matches_eager_when_sequence_length_changes_every_step(mode, tmp_path, capsys):
    for splits, fallbacks in run_distributed(_dynamic_seq_worker, 2, mode, str(tmp_path)):
        assert fallbacks == []
        assert all(applied for applied, _, _ in splits), splits
        # Automatic dynamic: one static compile, then one symbolic one; the others compile
        # symbolically at once. Never one graph per sequence length.
        assert [symbolic for _, symbolic, _ in splits] == (
            [False, True] if mode == "automatic" else [True] if mode == "mark_dynamic" else [True, True]
        )
    if mode == "automatic":
        _check_symbolic_dump(tmp_path, capsys)


def _check_symbolic_dump(dump_dir, capsys):
    """The dump of the symbolic graph names its symbol with its range; `kareus inspect` shows it."""
    from kareus_fx.capture.dump import load_dump
    from kareus_fx.cli import main

    dumps = [load_dump(p) for p in sorted(dump_dir.glob("kareus_graph_*_rank0.json"))]
    symbolic = [d for d in dumps if any(g.get("symbols") for g in d["graphs"])]
    assert len(symbolic) == 1
    forward = next(g for g in symbolic[0]["graphs"] if g["name"] == "forward")
    ((name, sequence),) = forward["symbols"].items()
    assert sequence["min"] == 2 and sequence["max"] is None and sequence["hint"] in SEQ_LENS
    assert any(n["symbolic_shape"] and name in n["symbolic_shape"] for n in forward["nodes"])
    capsys.readouterr()
    main(
        [
            "inspect",
            str(next(p for p, d in zip(sorted(dump_dir.glob("kareus_graph_*_rank0.json")), dumps) if d is symbolic[0])),
        ]
    )
    assert f"forward: symbolic sizes {name}[2, inf] = {sequence['hint']}" in capsys.readouterr().out


def _live_tuning_worker(rank, world_size, plan_out):
    from kareus_fx.deploy.variants import deployed_graphs
    from kareus_fx.models import ParallelLayout, build_model

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = build_model("tiny-llama", ParallelLayout.from_default_group(tp=2, cp=1), num_layers=2, dtype=torch.float32)
    model.init_weights(seed=0)
    compiled = torch.compile(
        model,
        backend="kareus",
        fullgraph=True,
        options={"tune": "simulated", "plan_out": plan_out, "tune_seq": [128, 256]},
    )
    for seq in (100, 200, 128):
        batch = model.example_batch(mbs=2, seq=seq, seed=seq)
        mark_sequence_dynamic(batch)
        eager_loss, eager_grads = eager_reference(model, batch)
        loss = compiled(**batch)
        loss.backward()
        assert_matches_eager(model, loss, eager_loss, eager_grads, TOL, f"seq {seq}")
    return sorted({g.name for g in deployed_graphs()}), len(deployed_graphs())


@pytest.mark.slow
def test_compile_time_tuning_of_a_symbolic_graph_plans_and_deploys_its_buckets(tmp_path):
    from kareus_fx.plan.plan_format import load_plan

    plan_out = tmp_path / "live" / "plan.json"
    results = run_distributed(_live_tuning_worker, 2, str(plan_out), timeout_s=600)
    plan = load_plan(plan_out)
    assert plan.buckets == (128, 256) and plan.workload["seq"] == 256
    assert (
        plan.bucket(128).data["stages"][0]["graphs"]["forward"]["fingerprint"]
        != plan.data["stages"][0]["graphs"]["forward"]["fingerprint"]
    )
    for names, count in results:
        assert names == ["backward", "forward"] and count >= 4  # forward and backward of both buckets
