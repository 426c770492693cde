"""Mixture-of-experts routing under the nanobatch split (passes/batch_dims/routing.py).

Hugging Face Mixtral and Qwen3-MoE from tiny configs (no weights; one decoder layer, 4 experts,
top-2; Mixtral normalises the top-k weights in place) on one process, and (slow) with
tensor-parallel attention on 2 gloo ranks through ``backend="kareus"``: each must split into two
nanobatches with no ``NanobatchFallbackWarning``, each nanobatch routing its own tokens, and match
eager (fp32; loss rtol 1e-5, gradients rtol 1e-4 atol 1e-6). Routings the split cannot make
exact (an expert capacity, a descending sort, counts that are not one bin per expert) fall back
with one warning naming why, and still match eager.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from eager_parity import assert_matches_eager, eager_reference
from split_recording import record_splits
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop

from kareus_fx.passes.nanobatch import NanobatchFallbackWarning, NanobatchResult, split_nanobatches

pytest.importorskip("transformers")

LOSS_TOL = {"rtol": 1e-5, "atol": 0.0}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}


def _tiny_moe_config(arch: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "num_experts_per_tok": 2,
    }
    if arch == "mixtral":
        return MixtralConfig(num_local_experts=4, **common)
    return Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, **common)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(128, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, :5] = 0  # left padding in one row of each nanobatch
    mask[3, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class _LossOf(nn.Module):
    """A Hugging Face causal LM returning its loss (what the parity helpers call)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return self.model(**batch).loss


def _compile_and_compare(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[list[NanobatchResult], list[str]]:
    """Eager, then compiled with the split and aot_autograd; loss and every gradient compared."""
    splits: list[NanobatchResult] = []

    def backend(gm, example_inputs):
        splits.append(split_nanobatches(gm, example_inputs))
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop)(splits[-1].gm, example_inputs)

    torch._dynamo.reset()
    eager_loss, eager_grads = eager_reference(model, batch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend=backend, fullgraph=True)(**batch)
        loss.backward()
    torch._dynamo.reset()
    torch.testing.assert_close(loss, eager_loss, **LOSS_TOL)
    assert_matches_eager(model, loss, eager_loss, eager_grads, GRAD_TOL, "compiled")
    fallbacks = [str(w.message) for w in record if issubclass(w.category, NanobatchFallbackWarning)]
    return splits, fallbacks


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_hf_moe_splits_without_fallback_and_matches_eager(arch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = _LossOf(AutoModelForCausalLM.from_config(_tiny_moe_config(arch)))
    splits, fallbacks = _compile_and_compare(model, _batch())
    assert not fallbacks, fallbacks
    assert [(s.split, s.halves) for s in splits] == [(True, (2, 2))], [s.reason for s in splits]
    graph = splits[0].gm.graph
    sorts = [n for n in graph.nodes if n.target is torch.sort]
    assert sorted(n.meta["kareus_nanobatch"] for n in sorts) == [0, 1]  # each nanobatch routes its own


class SortedMoE(nn.Module):
    """Top-2 of 4 experts, tokens sorted by expert and gathered back; the expert is a per-row
    product with its weight looked up by the row's expert id (any sort order is exact). Variants
    the split refuses: a capacity limit; per-expert counts of a descending sort (its groups are
    not in expert order); counts over bins that are not one per expert."""

    def __init__(self, variant: str = "exact", d: int = 8, experts: int = 4):
        super().__init__()
        self.variant = variant
        self.experts = experts
        self.gate = nn.Linear(d, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts, d, d) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, 1)
        weights, ids = torch.topk(self.gate(tokens).softmax(-1), 2, dim=-1)
        flat_ids = ids.reshape(-1)
        sorted_ids, perm = torch.sort(flat_ids, descending=self.variant == "descending")
        rows = tokens[perm // 2]
        if self.variant == "capacity":  # Switch-style capacity: a token's slot counts earlier tokens
            chosen = (flat_ids.unsqueeze(-1) == torch.arange(self.experts)).long()
            slot = (chosen.cumsum(0) * chosen).sum(-1)
            rows = rows * (slot[perm] <= 8).unsqueeze(-1)
        if self.variant in ("bins", "descending"):  # counts used as if they were group sizes
            bins = self.experts + (self.variant == "bins")
            counts = torch.histc(sorted_ids.float(), bins=bins, min=0, max=self.experts - 1)
            rows = rows * counts.sum()
        out = (rows.unsqueeze(1) @ self.w[sorted_ids]).squeeze(1) * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        return out[inverse].view(-1, 2, x.shape[-1]).sum(1).square().mean()


def test_sorted_routing_splits_exactly():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    splits, fallbacks = _compile_and_compare(SortedMoE(), {"x": x})
    assert not fallbacks and [s.split for s in splits] == [True], fallbacks


@pytest.mark.parametrize(
    "variant, reason",
    [
        ("capacity", "cumsum"),
        ("descending", "descending"),
        ("bins", "not one bin per expert"),
    ],
)
def test_routing_the_split_cannot_make_exact_falls_back(variant, reason):
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    splits, fallbacks = _compile_and_compare(SortedMoE(variant), {"x": x})
    assert len(fallbacks) == 1 and reason in fallbacks[0], fallbacks
    assert [s.split for s in splits] == [False]


def _tp_attention_worker(rank: int, world_size: int, arch: str) -> tuple[list[bool], list[str]]:
    """Rank ``rank`` of tensor-parallel attention (q/k/v column-parallel, o row-parallel; the
    experts replicated) compiled with ``backend="kareus"``; eager parity on this rank's shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    splits = record_splits()
    torch.manual_seed(0)
    model = _LossOf(AutoModelForCausalLM.from_config(_tiny_moe_config(arch)))
    mesh = init_device_mesh("cpu", (world_size,))
    plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"} | {"self_attn.o_proj": RowwiseParallel()}
    for layer in model.model.model.layers:
        parallelize_module(layer, mesh, plan)
    batch = _batch()
    eager_loss, eager_grads = eager_reference(model, batch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend="kareus", fullgraph=True, options={"inductor": False})(**batch)
        loss.backward()
    torch.testing.assert_close(loss, eager_loss, **LOSS_TOL)
    for name, p in model.named_parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        want = eager_grads[name].to_local() if hasattr(eager_grads[name], "to_local") else eager_grads[name]
        torch.testing.assert_close(grad, want, **GRAD_TOL, msg=lambda m, name=name: f"rank {rank}, {name}: {m}")
    return splits, [str(w.message) for w in record if issubclass(w.category, NanobatchFallbackWarning)]


@pytest.mark.slow  # about 50 s a case on a loaded machine (two ranks import transformers and compile)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_hf_moe_with_tensor_parallel_attention_splits_on_two_ranks(arch):
    from dist_harness import run_distributed

    for splits, fallbacks in run_distributed(_tp_attention_worker, 2, arch, timeout_s=600):
        assert not fallbacks, fallbacks
        assert splits == [True]
