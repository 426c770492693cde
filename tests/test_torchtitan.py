"""torchtitan 0.3.0's llama3 debugmodel with its own TP/SP sharding, blocks compiled through kareus
by :func:`kareus_fx.integrations.torchtitan.kareus_parallelize` with options from ``KAREUS_OPTIONS``.

2 gloo ranks, TP=2 with sequence parallelism (torchtitan's ``set_llama3_sharding_config`` and
``parallelize_llama``, partial-DTensor backend), 2 of the debugmodel's layers, fp32 (torchtitan's
default bf16 FSDP mixed-precision policy set to fp32). The inner attention is torchtitan's own
``ScaledDotProductAttention`` (causal, exact): FlexAttention has no backward on CPU (its split is
tested forward-only in test_flex_nanobatch.py). Reference: the same model unparallelized, eager,
same weights. Tolerances: loss rtol 1e-5; gradients rtol 1e-4, atol 1e-6 (the split sums each
parameter gradient over two nanobatches and TP sums partial products: a few ulps apart).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from dist_harness import run_distributed

from kareus_fx.errors import OptionsError

LAYERS, BATCH, SEQ, VOCAB = 2, 4, 32, 2048


def _llama_parity(rank: int, world_size: int, options: dict, dp: int = 1) -> dict:
    """Rank ``rank`` of ``dp`` FSDP2 replicas x ``world_size // dp``-way TP; each replica trains on
    its own rows of one global batch. Reference: the unparallelized eager model on the global
    batch (the gradient of its loss is the sum of the replicas', which FSDP2 reduces to)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan_llama import debug_llama

    import kareus_fx.capture.compile_step as compile_step
    import kareus_fx.plan.live_tuning as live_tuning
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    os.environ["KAREUS_OPTIONS"] = json.dumps(options)
    llama = debug_llama(world_size, LAYERS, dp)
    model, dims = llama.model, llama.dims
    reference = llama.built()
    reference.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        reference.init_weights(buffer_device=torch.device("cpu"))
        full = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full[name].detach(), p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full[name])

    splits = []
    split = compile_step.split_nanobatches

    def recording_split(gm, example_inputs, **kwargs):
        result = split(gm, example_inputs, **kwargs)
        splits.append(result.split)
        return result

    compile_step.split_nanobatches = live_tuning.split_nanobatches = recording_split
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (dp * BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (dp * BATCH, SEQ), generator=g)
    replica = dims.get_mesh("fsdp").get_local_rank() if dp > 1 else 0
    mine = slice(replica * BATCH, (replica + 1) * BATCH)

    def loss_of(m: torch.nn.Module, rows: slice) -> torch.Tensor:
        out = m(tokens[rows])
        out = out.full_tensor() if isinstance(out, DTensor) else out
        # torchtitan's normalisation: FSDP2 sums the replicas' gradients (torchtitan disables its
        # division), the loss divides by the global token count
        ce = torch.nn.functional.cross_entropy(out.flatten(0, 1), labels[rows].flatten(), reduction="sum")
        return ce / labels.numel()

    with warnings.catch_warnings():
        warnings.simplefilter("error", NanobatchFallbackWarning)
        loss = loss_of(model, mine)
        loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(loss, loss_of(reference, mine), rtol=1e-5, atol=0)
    loss_of(reference, slice(None)).backward()
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, full[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    return {"splits": splits, "loss": loss.item()}


@pytest.mark.slow  # about 200 s on a loaded machine (compile-time tuning on rank 0); fast siblings below
def test_torchtitan_llama_tp_sp_blocks_split_tune_and_match_eager(tmp_path):
    plan_out = tmp_path / "block_plan.json"
    options = {"inductor": False, "tune": "simulated", "plan_out": str(plan_out)}
    results = run_distributed(_llama_parity, 2, options, timeout_s=600)
    for result in results:
        # one Dynamo graph for both blocks (compile_blocks settles their inputs), split in two
        # nanobatches (no fallback warning), tuned once
        assert result["splits"] == [True], result
    plan = json.loads(plan_out.read_text())  # tuned at compile time on the block graph: a per-block plan
    assert plan["workload"]["model"] == "live-graph" and plan["workload"]["tp"] == 2
    assert len(plan["stages"]) == 1 and plan["partition_types"], plan["stages"]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


@pytest.mark.slow  # 4 ranks; minutes on a loaded 2-core machine. Fast sibling: test_fsdp_blocks.py (2 replicas)
def test_fsdp2_over_kareus_blocks_with_tp_matches_eager():
    """2 FSDP2 replicas (torchtitan's fully_shard of each block and the model) x 2-way TP/SP."""
    results = run_distributed(_llama_parity, 4, {"inductor": False}, 2, timeout_s=900)
    for result in results:
        assert result["splits"] and all(result["splits"]), result


def test_kareus_parallelize_turns_torchtitan_compile_off_and_compiles_blocks(monkeypatch):
    """Fast sibling of the torchtitan test: the wrapper's contract on a stand-in parallelize_fn."""
    from torchtitan.config import CompileConfig

    from kareus_fx.integrations.torchtitan import kareus_parallelize

    seen = []

    def parallelize_fn(model, *, parallel_dims, compile_config):
        seen.append((parallel_dims, compile_config.enable, compile_config.backend))
        return model

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): _Block() for i in range(2)})
    x = torch.randn(4, 8)
    eager = [block(x) for block in model.layers.values()]
    monkeypatch.setenv("KAREUS_OPTIONS", json.dumps({"inductor": False}))
    out = kareus_parallelize(parallelize_fn)(
        model, parallel_dims="dims", compile_config=CompileConfig(enable=True, backend="kareus")
    )
    assert out is model and seen == [("dims", False, "kareus")]
    for block, want in zip(model.layers.values(), eager):
        assert block._compiled_call_impl is not None
        torch.testing.assert_close(block(x), want)
    monkeypatch.setenv("KAREUS_OPTIONS", json.dumps({"nanobatch": 1}))  # fails before training, naming both
    with pytest.raises(OptionsError, match=r"KAREUS_OPTIONS.*'nanobatch'"):
        kareus_parallelize(parallelize_fn)(model, parallel_dims="dims", compile_config=CompileConfig(enable=True))


class _NumberedBlock(_Block):
    """A block whose forward reads its ``layer_id``: Dynamo guards on the number, so each block
    compiles into its own Dynamo graph, all of one structure (as torchtitan's blocks did before
    ``compile_blocks`` settled their inputs: see ``test_blocks_of_one_structure_tune_once``)."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1.0 if self.layer_id >= 0 else 2.0)


def test_blocks_of_one_structure_tune_once(tmp_path, monkeypatch):
    """Compile-time tuning runs once per distinct graph: two Dynamo graphs with the same
    fingerprints (one per block) share one tuning run and one plan; eager parity."""
    import kareus_fx.plan.live_tuning as live_tuning
    import kareus_fx.plan.planner as planner
    from kareus_fx.integrations.torchtitan import compile_blocks

    runs, graphs = [], []
    plan_traced = planner.plan_traced
    monkeypatch.setattr(planner, "plan_traced", lambda *a, **k: runs.append(1) or plan_traced(*a, **k))
    monkeypatch.setattr(live_tuning, "_TUNED_GRAPHS", {})
    init = live_tuning.LiveTuning.__init__
    monkeypatch.setattr(live_tuning.LiveTuning, "__init__", lambda self, *a: graphs.append(1) or init(self, *a))
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(_NumberedBlock(i) for i in range(3))
    x = torch.randn(4, 8, requires_grad=True)
    want = x
    for block in model.layers:
        want = block(want)
    plan_out = tmp_path / "block_plan.json"
    compile_blocks(model, {"tune": "simulated", "plan_out": str(plan_out), "inductor": False})
    got = x
    for block in model.layers:
        got = block(got)
    torch.testing.assert_close(got, want)
    assert len(graphs) == 3 and len(runs) == 1  # three Dynamo graphs, one tuning run
    assert json.loads(plan_out.read_text())["workload"]["model"] == "live-graph"
