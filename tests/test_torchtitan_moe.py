"""torchtitan 0.3.0's Qwen3 MoE debug model with expert parallelism over 2 gloo ranks, each
transformer block compiled with ``backend="kareus"`` by torchtitan's own ``apply_compile`` (through
:func:`kareus_fx.integrations.torchtitan.kareus_parallelize`).

Setup: ``debugmodel_moe`` cut to 2 layers (64 experts, top-8), EP=2 with torchtitan's standard
all-to-all token dispatcher (``moe_comm_backend="standard"``; the Triton one needs a GPU) and its
``partial_dtensor`` SPMD backend (the ``spmd_types`` one reads a mesh that only torchtitan's
trainer installs). Data parallelism is left out (``skip_dp``): each rank trains on its own rows of
one global batch and the test sums the replicated parameters' gradients over the ranks itself,
as FSDP would. The inner attention is torchtitan's exact ``ScaledDotProductAttention``
(FlexAttention has no backward on CPU).

Reference: the same model unparallelized and eager, same weights, on the global batch; fp32,
loss rtol 1e-5, gradients rtol 1e-4 atol 1e-6. torchtitan's ``GroupedExperts`` casts tokens and
weights to bf16 for ``torch._grouped_mm`` (whose fake kernel accepts bf16 only), so any
one-ulp fp32 difference upstream flips bf16 roundings and no compiled run holds those
tolerances; the test swaps in an exact fp32 expert computation (every local expert on every
row, masked by the row's expert) with the same inputs, outputs and count semantics.

The split: torchtitan's dispatcher turns the exchanged token counts into split sizes with
``.tolist()``, which binds unbacked symbols in the Dynamo graph. Each block graph splits with no
``NanobatchFallbackWarning``: each nanobatch routes its own tokens (its own count exchange, its own
``.item()`` calls binding its own symbols, read by its own dispatch and combine all-to-alls), and
the loss and every gradient still match eager.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from dist_harness import run_distributed

LAYERS, BATCH, SEQ, VOCAB = 2, 2, 16, 2048


def _fp32_grouped_experts(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``GroupedExperts.forward`` in fp32: row ``r`` belongs to expert ``e`` by the
    counts (rows grouped in expert order); each expert's SwiGLU runs on every row and a 0/1 mask
    keeps the row's own (the other terms are exact zeros)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    experts = num_tokens_per_expert_E.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(experts), num_tokens_per_expert_E, output_size=x_RD.shape[0])
    mask = (expert_of_row[:, None] == torch.arange(experts)).to(x_RD.dtype)
    hidden = w1.shape[1]
    h1 = (x_RD @ w1.reshape(experts * hidden, -1).t()).view(-1, experts, hidden)
    h3 = (x_RD @ w3.reshape(experts * hidden, -1).t()).view(-1, experts, hidden)
    h = F.silu(h1) * h3
    out = torch.zeros_like(x_RD)
    for e in range(experts):  # 2-D products: Inductor lowers them with a data-dependent row count
        out = out + (h[:, e] @ w2[e].t()) * mask[:, e, None]
    return out


def _qwen3_moe_ep_parity(rank: int, world_size: int) -> dict:
    from torchtitan_import import import_torchtitan

    import_torchtitan()
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.distributed.utils as titan_utils
    import torchtitan.models.qwen3 as qwen3
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    from kareus_fx.integrations.torchtitan import kareus_parallelize
    from kareus_fx.passes.nanobatch import NANOBATCH_META, NanobatchFallbackWarning

    parallel_dims_module.device_type = "cpu"  # torchtitan picks "cuda" on a machine without a GPU
    titan_utils.set_spmd_backend("partial_dtensor")  # what torchtitan's trainer sets from the config
    GroupedExperts.forward = _fp32_grouped_experts
    spec = qwen3.model_registry("debugmodel_moe", moe_comm_backend="standard")
    config = spec.model
    config.layers = config.layers[:LAYERS]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_qwen3_sharding_config(config, enable_sp=False, enable_ep=True)
    parallelism = ParallelismConfig(
        expert_parallel_degree=world_size, data_parallel_shard_degree=world_size, spmd_backend="partial_dtensor"
    )
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()

    def built() -> Any:  # a torchtitan Decoder (its init_weights is untyped)
        with torch.device("meta"):
            model = config.build()
        return model

    reference = built()
    reference.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        reference.init_weights(buffer_device=torch.device("cpu"))
    model: Any = kareus_parallelize(spec.parallelize_fn)(
        built(),
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(enable=True, backend="kareus"),
        ac_config=None,
        dump_folder="",
        skip_dp=True,
    )
    model.to_empty(device="cpu")
    full = dict(reference.named_parameters())
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))  # buffers (RoPE cache, expert bias)
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):  # the experts, sharded over the EP mesh
                p.to_local().copy_(distribute_tensor(full[name].detach(), p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full[name])

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (world_size * BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (world_size * BATCH, SEQ), generator=g)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)

    def loss_of(m: torch.nn.Module, rows: slice) -> torch.Tensor:
        out = m(tokens[rows])
        ce = torch.nn.functional.cross_entropy(out.flatten(0, 1), labels[rows].flatten(), reduction="sum")
        return ce / labels.numel()  # normalised by the global token count, as torchtitan does

    splits = _record_splits()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", NanobatchFallbackWarning)
        loss = loss_of(model, mine)
        loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(loss, loss_of(reference, mine), rtol=1e-5, atol=0)
    loss_of(reference, slice(None)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if isinstance(p.grad, DTensor):
            grad = p.grad.full_tensor()  # an expert's gradient already holds every rank's tokens
        else:
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad)  # a replicated parameter: sum the ranks' gradients
        torch.testing.assert_close(grad, full[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    exchanges = []  # per split graph: (nanobatch of each all-to-all, nanobatches of the sizes it reads)
    for gm in splits:
        for n in gm.graph.nodes:
            if "all_to_all_single" in str(n.target):
                sizes = [s for s in [*(n.args[1] or ()), *(n.args[2] or ())] if isinstance(s, torch.fx.Node)]
                exchanges.append(
                    (n.meta.get(NANOBATCH_META), sorted({s.meta.get(NANOBATCH_META) for s in sizes}, key=str))
                )
    return {
        "fallbacks": [str(w.message) for w in record if issubclass(w.category, NanobatchFallbackWarning)],
        "splits": len(splits),
        "exchanges": exchanges,
    }


def _record_splits() -> list[Any]:
    """Make the compile step keep each split graph."""
    from kareus_fx.capture import compile_step
    from kareus_fx.passes.nanobatch import split_nanobatches

    graphs: list[Any] = []

    def recording(gm: Any, example_inputs: list[Any], **kwargs: Any) -> Any:
        result = split_nanobatches(gm, example_inputs, **kwargs)
        if result.split:
            graphs.append(result.gm)
        return result

    compile_step.split_nanobatches = recording
    return graphs


@pytest.mark.slow  # about 8 minutes on a loaded 2-core machine (Inductor compiles each rank's split block graph)
def test_torchtitan_qwen3_moe_ep_blocks_compile_and_match_eager():
    for result in run_distributed(_qwen3_moe_ep_parity, 2, timeout_s=1200):
        # one Dynamo graph for both blocks, split: each nanobatch's count exchange (equal sizes, no
        # size nodes), dispatch and combine read only that nanobatch's sizes
        assert result["fallbacks"] == [] and result["splits"] == 1, result
        per_graph = sorted(result["exchanges"])
        assert per_graph == [(0, []), (0, [0]), (0, [0]), (1, []), (1, [1]), (1, [1])], result
