"""Nanobatch split of the ``flex_attention`` higher-order op (passes/batch_dims/attention.py, passes/nanobatch.py).

Each nanobatch runs flex_attention on its rows of q/k/v and of every batched BlockMask tensor; its
score and mask functions read captured full-batch buffers at global batch indices. Forward only:
FlexAttention has no backward on CPU. The split graph runs through aot_autograd with no-op
compilers (the HOP's dense reference implementation), compared with the same function unsplit.

Tolerance: fp32, rtol=1e-5, atol=1e-6 (each batch row is computed by the same kernel on the same
values; only the batch extent changes). Also here: the complex views of torchtitan's ComplexRoPE
(forward and backward, the same tolerance).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from kareus_fx.passes.batch_dims import op_name
from kareus_fx.passes.nanobatch import NanobatchFallbackWarning
from tests.test_nanobatch import Capture, assert_same, run_eager_and_compiled

RTOL, ATOL = 1e-5, 1e-6
B, H, S, D = 5, 2, 256, 8  # odd batch: nanobatches of 3 and 2; two 128-token blocks per sequence


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class FlexBlock(nn.Module):
    """Projections around flex_attention with an additive per-batch bias in the score function."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, block_mask: BlockMask, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, h]

        return self.out(flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask))


def _document_mask(doc_ids: torch.Tensor) -> BlockMask:
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(mask_mod, B, None, S, S, device="cpu")


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, S, D, generator=g)
    bias = torch.randn(B, H, generator=g)
    doc_ids = torch.randint(0, 4, (B, S), generator=g).sort(dim=1).values
    doc_ids[0] = 0  # batch rows with different block patterns: row 0 one document, others several
    return x, bias, doc_ids


def _run(block_mask_of, split: bool):
    torch.manual_seed(0)
    model = FlexBlock()
    x, bias, doc_ids = _inputs()
    capture = Capture(split=split)
    with warnings.catch_warnings(), torch.no_grad():  # no FlexAttention backward on CPU
        warnings.simplefilter("error", NanobatchFallbackWarning)
        out = torch.compile(model, backend=capture, fullgraph=True)(x, block_mask_of(doc_ids), bias)
    with torch.no_grad():
        eager = model(x, block_mask_of(doc_ids), bias)
    return out, eager, capture


def _flex_nodes(gm):
    return [n for n in gm.graph.nodes if op_name(n) == "hop.flex_attention"]


@pytest.mark.parametrize(
    "block_mask_of",
    [
        pytest.param(_document_mask, id="batched-document-mask"),
        pytest.param(
            lambda _: create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, S, S, device="cpu"),
            id="broadcast-causal-mask",
        ),
    ],
)
def test_flex_attention_splits_per_nanobatch_and_matches(block_mask_of):
    out, eager, capture = _run(block_mask_of, split=True)
    result = capture.result
    assert result.split, result.reason
    assert result.halves == (3, 2)
    flex = _flex_nodes(result.gm)
    assert len(flex) == 2, "one flex_attention per nanobatch"
    block_rows = [n.args[4][2].meta["example_value"].shape[0] for n in flex]
    batched = block_mask_of(_inputs()[2]).kv_num_blocks.shape[0] == B
    assert block_rows == ([3, 2] if batched else [1, 1]), "each nanobatch gets its rows of a batched BlockMask"
    torch.testing.assert_close(out, eager, rtol=RTOL, atol=ATOL)
    # nanobatch A uses the original functions; B's copies shift the batch index by A's size (3)
    a, b = flex
    assert a.args[3].target == "score_mod_0" and a.args[4][-1].target == "mask_fn_0"
    for fn_node in (b.args[3], b.args[4][-1]):
        fn = getattr(result.gm, fn_node.target)
        shifts = [n.args[1] for n in fn.graph.nodes if op_name(n) == "add" and n.args[1] == 3]
        assert shifts == [3], fn.code


class ComplexRope(nn.Module):
    """torchtitan's ComplexRoPE: view_as_complex, a product with a shared complex cache, view_as_real."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        angles = torch.outer(torch.arange(S, dtype=torch.float32), torch.rand(D // 2))
        self.register_buffer("cache", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (B, S, H, D)
        pairs = torch.view_as_complex(h.float().reshape(*h.shape[:-1], -1, 2))
        rotated = torch.view_as_real(pairs * self.cache.view(1, S, 1, D // 2)).flatten(3)
        return (rotated - h).square().mean()  # positive terms: no cancellation in the loss


def test_complex_rope_views_split_with_gradients():
    torch.manual_seed(0)
    x = torch.randn(B, S, H, D, requires_grad=True)
    capture = Capture()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NanobatchFallbackWarning)
        ref, got = run_eager_and_compiled(ComplexRope(), (x,), capture)
    assert capture.result.split, capture.result.reason
    assert_same(ref, got)
