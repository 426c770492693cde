"""kareus::attention: exact causal attention, one node forward and backward, exact FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.models.attention_op import attention, attention_backward, attention_flops, causal_pair_fraction
from kareus_fx.passes.analysis import analyse_graph


def _explicit_lower_right_causal(q, k, v, scale):
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool).tril(diagonal=seq_k - seq_q)
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("seq_q, seq_k", [(8, 8), (4, 12)])
def test_matches_explicit_masked_attention_with_grads(seq_q, seq_k):
    torch.manual_seed(0)
    q = torch.randn(2, 4, seq_q, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, seq_k, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, seq_k, 16, dtype=torch.float64, requires_grad=True)
    out = attention(q, k, v, 0.25)
    ref = _explicit_lower_right_causal(q, k, v, 0.25)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_opcheck():
    q = torch.randn(1, 2, 4, 8)
    kv = torch.randn(1, 2, 6, 8)
    torch.library.opcheck(attention, (q, kv, kv.clone(), 0.5))


def test_opcheck_on_transposed_views_as_the_models_pass_them():
    """The fakes must give the real ops' strides: the models pass [b, s, h, d].transpose(1, 2)
    views, and a stride mismatch broke aot_autograd's views after the backward op (tp=1)."""
    q = torch.randn(2, 16, 4, 8).transpose(1, 2)
    k = torch.randn(2, 16, 2, 8).transpose(1, 2)
    v = torch.randn(2, 16, 2, 8).transpose(1, 2)
    torch.library.opcheck(attention, (q, k, v, 0.5))
    torch.library.opcheck(attention_backward, (torch.randn(2, 4, 16, 8), q, k, v, 0.5))


def test_tp1_model_compiles_forward_and_backward():
    from kareus_fx.models import ParallelLayout, build_model

    torch._dynamo.reset()
    model = build_model("tiny-llama", ParallelLayout(), num_layers=1)
    model.init_weights(seed=0)
    batch = model.example_batch(mbs=2, seq=16)
    eager_loss = model(**batch)
    eager_loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = torch.compile(model, backend="aot_eager", fullgraph=True)(**batch)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_one_node_each_way_on_meta_with_causal_flops():
    def step(q, k, v):
        return attention(q, k, v, 0.125).sum()

    shapes = [(2, 8, 1024, 128), (2, 2, 1024, 128), (2, 2, 1024, 128)]
    args = [torch.empty(s, device="meta", dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    gm = make_fx(lambda q, k, v: torch.autograd.grad(step(q, k, v), (q, k, v)), tracing_mode="fake")(*args)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.kareus.attention.default) == 1
    assert targets.count(torch.ops.kareus.attention_backward.default) == 1
    assert torch.ops.aten.bmm.default not in targets
    costs = analyse_graph(gm, gpu_spec())
    (fwd,) = [n for n in gm.graph.nodes if n.target == torch.ops.kareus.attention.default]
    dense = 2 * 2 * 8 * 1024 * 1024 * (128 + 128)
    assert costs[fwd].flops == pytest.approx(dense * (1024 * 1025 / 2) / 1024**2)
    assert costs[fwd].bound == "compute"


def test_causal_pair_fraction():
    assert causal_pair_fraction(4, 4) == pytest.approx(10 / 16)
    assert causal_pair_fraction(2, 6) == pytest.approx((5 + 6) / 12)
    assert attention_flops((1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)) == pytest.approx(2 * 16 * 16 * 10 / 16)
