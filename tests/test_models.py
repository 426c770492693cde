"""Reference models: TP / CP / DTensor parity with the unsharded model, traced collectives, errors.

Parity tolerance (float32 throughout): ``rtol=1e-4, atol=1e-6`` on the loss and every gradient
(observed differences are ~1e-7). The unsharded reference always uses PyTorch's SDPA; the
sharded models use ``kareus::attention`` (the default) or SDPA. Multi-process tests run 2 gloo ranks on CPU (``dist_harness``).

"Compiled" means ``torch.compile(..., backend=RecordingBackend())``: ``aot_eager`` with forward
and backward compilers that keep the aten graphs for inspection; it also counts Dynamo graphs
(one graph = zero graph breaks).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed

from kareus_fx.errors import ParallelConfigError
from kareus_fx.models import ParallelLayout, UnknownModelError, build_model, get_config, model_names

TOL = {"rtol": 1e-4, "atol": 1e-6}
C10D = torch.ops._c10d_functional
ALL_REDUCE = C10D.all_reduce.default
ALL_GATHER = C10D.all_gather_into_tensor.default
REDUCE_SCATTER = C10D.reduce_scatter_tensor.default
WAIT = C10D.wait_tensor.default
COLLECTIVES = {ALL_REDUCE: "all_reduce", ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter"}


class RecordingBackend:
    """``aot_eager`` that keeps the Dynamo graphs and the aten forward / backward graphs."""

    def __init__(self) -> None:
        self.dynamo_graphs: list[torch.fx.GraphModule] = []
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        self.dynamo_graphs.append(gm)

        def keep(graphs):
            def compiler(g, inputs):
                graphs.append(g)
                return boxed_nop(g, inputs)

            return compiler

        return aot_eager(gm, example_inputs, fw_compiler=keep(self.forward), bw_compiler=keep(self.backward))


def module_path(node: torch.fx.Node) -> str:
    """The innermost module of ``node`` as a model-relative path (``layers.0.mlp.down_proj``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    fqn = list(stack.values())[-1][0]
    return re.sub(r"^L\['self'\]\.?", "", fqn)


def collectives(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """(collective kind, module path) of each collective in ``gm``, in graph order."""
    return [
        (COLLECTIVES[n.target], module_path(n))
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in COLLECTIVES
    ]


def layer_of(path: str) -> str:
    m = re.match(r"layers\.(\d+)\.", path)
    return f"layer{m.group(1)}" if m else path.split(".")[0]


def per_owner(colls: list[tuple[str, str]]) -> Counter:
    """Counts keyed by (kind, layerN or top-level module)."""
    return Counter((kind, layer_of(path)) for kind, path in colls)


def expected_grads(full, sharded) -> dict[str, torch.Tensor]:
    return sharded.shard_full_state_dict({n: p.grad for n, p in full.named_parameters()})


def assert_grads_match(full, sharded, what: str) -> None:
    expected = expected_grads(full, sharded)
    for name, p in sharded.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **TOL, msg=lambda m, name=name: f"{what} {name}: {m}")


def _reference_and_sharded(name: str, tp: int, cp: int, attention: str = "kareus", mbs: int = 2, seq: int = 16):
    """Seeded unsharded model with SDPA attention (with grads of one step) and its shard on a
    (tp, cp) layout with ``attention``."""
    torch.manual_seed(0)
    full = build_model(name, attention="sdpa")
    batch = full.example_batch(mbs, seq)
    loss = full(**batch)
    loss.backward()
    layout = ParallelLayout.from_default_group(tp=tp, cp=cp)
    sharded = build_model(name, layout, attention=attention)
    sharded.load_full_state_dict(full.state_dict())
    return full, loss.detach(), sharded, sharded.example_batch(mbs, seq)


def _step(model, batch, backend=None) -> torch.Tensor:
    """One forward/backward (optionally compiled); returns the full-sequence loss."""
    fn = model if backend is None else torch.compile(model, backend=backend)
    loss = fn(**batch)
    loss.backward()
    model.finalize_grads()
    loss = loss.detach().clone()
    if model.layout.cp_group is not None:  # the full-sequence mean is the mean of chunk means
        dist.all_reduce(loss, group=model.layout.cp_group)
        loss /= model.layout.cp
    return loss


# ---------------------------------------------------------------- (a), (b): eager parity


def _parity_worker(rank, world_size, tp, cp):
    for name in ("tiny-llama", "tiny-qwen"):
        for attention in ("kareus", "sdpa"):
            full, ref_loss, sharded, batch = _reference_and_sharded(name, tp, cp, attention)
            torch.testing.assert_close(_step(sharded, batch), ref_loss, **TOL)
            assert_grads_match(full, sharded, f"{name} {attention} tp={tp} cp={cp} rank {rank}")


def test_tp2_matches_unsharded():
    run_distributed(_parity_worker, 2, 2, 1)


def test_cp2_matches_unsharded():
    run_distributed(_parity_worker, 2, 1, 2)


# ---------------------------------------------------------------- (d): compiled graphs


def _compiled_worker(rank, world_size, name, tp, cp):
    full, ref_loss, sharded, batch = _reference_and_sharded(name, tp, cp)
    backend = RecordingBackend()
    torch.testing.assert_close(_step(sharded, batch, backend), ref_loss, **TOL)
    assert_grads_match(full, sharded, f"compiled {name} tp={tp} cp={cp} rank {rank}")
    (fw,), (bw,) = backend.forward, backend.backward
    gathers = [n for n in fw.graph.nodes if n.target is ALL_GATHER]
    between = [  # call_function nodes between consecutive all-gathers of the forward graph
        [n.target for n in _nodes_between(a, b) if n.op == "call_function"] for a, b in itertools.pairwise(gathers)
    ]
    return {
        "dynamo_graphs": len(backend.dynamo_graphs),
        "forward": collectives(fw),
        "backward": collectives(bw),
        "between_gathers": [[str(t) for t in ts] for ts in between],
    }


def _nodes_between(a: torch.fx.Node, b: torch.fx.Node) -> list[torch.fx.Node]:
    out, n = [], a.next
    while n is not b:
        out.append(n)
        n = n.next
    return out


def test_tp2_compiled_collectives():
    """tiny-qwen, TP=2: 2 all-reduces per layer each way; embedding / LM head / loss named."""
    results = run_distributed(_compiled_worker, 2, "tiny-qwen", 2, 1)
    layers = get_config("tiny-qwen").num_layers
    for r in results:
        assert r["dynamo_graphs"] == 1  # no graph break
        fw, bw = per_owner(r["forward"]), per_owner(r["backward"])
        expect_fw = {("all_reduce", f"layer{i}"): 2 for i in range(layers)}
        expect_fw |= {("all_reduce", "embed_tokens"): 1, ("all_gather", "loss_fn"): 1}
        assert fw == Counter(expect_fw)
        expect_bw = {("all_reduce", f"layer{i}"): 2 for i in range(layers)}
        expect_bw |= {("all_reduce", "lm_head"): 1}
        assert bw == Counter(expect_bw)
        assert [p for _, p in r["forward"] if p.startswith("layers.0.")] == [
            "layers.0.self_attn.o_proj",
            "layers.0.mlp.down_proj",
        ]
        assert [p for _, p in r["backward"] if p.startswith("layers.0.")] == [
            "layers.0.mlp.gate_up_proj",
            "layers.0.self_attn.qkv_proj",
        ]


def test_cp2_compiled_collectives():
    """tiny-llama, CP=2: per layer 2 adjacent all-gathers forward (K, V), 2 reduce-scatters back."""
    results = run_distributed(_compiled_worker, 2, "tiny-llama", 1, 2)
    layers = get_config("tiny-llama").num_layers
    for r in results:
        assert r["dynamo_graphs"] == 1
        assert per_owner(r["forward"]) == Counter({("all_gather", f"layer{i}"): 2 for i in range(layers)})
        assert per_owner(r["backward"]) == Counter({("reduce_scatter", f"layer{i}"): 2 for i in range(layers)})
        # K's and V's all-gathers of one layer have only K's wait between them
        assert r["between_gathers"][0::2] == [[str(WAIT)]] * layers


# ---------------------------------------------------------------- (c): DTensor model


def _dtensor_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from kareus_fx.models.dtensor_model import DTensorTransformer, parallelize_dtensor_model

    torch.manual_seed(0)
    full = DTensorTransformer(num_layers=1)
    sharded = DTensorTransformer(num_layers=1)
    sharded.load_state_dict(full.state_dict())
    parallelize_dtensor_model(sharded, init_device_mesh("cpu", (world_size,)))
    ids = torch.randint(256, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    ref = full(**batch)
    ref.backward()
    eager = sharded(**batch)
    assert type(eager) is torch.Tensor
    eager.backward()
    torch.testing.assert_close(eager, ref, **TOL)
    _assert_dtensor_grads_match(full, sharded, "eager")

    sharded.zero_grad()
    backend = RecordingBackend()
    compiled = torch.compile(sharded, backend=backend, fullgraph=True)(**batch)
    compiled.backward()
    torch.testing.assert_close(compiled, ref, **TOL)
    _assert_dtensor_grads_match(full, sharded, "compiled")
    return {
        "dynamo_graphs": len(backend.dynamo_graphs),
        "forward": collectives(backend.forward[0]),
        "backward": collectives(backend.backward[0]),
    }


def _assert_dtensor_grads_match(full, sharded, what: str) -> None:
    expected = dict(full.named_parameters())
    for name, p in sharded.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, expected[name].grad, **TOL, msg=lambda m, name=name: f"{what} {name}: {m}")


def test_dtensor_model_matches_unsharded_and_compiles():
    for r in run_distributed(_dtensor_worker, 2):
        assert r["dynamo_graphs"] == 1
        # one block: forward, after attn.wo and ffn.w2; backward, one per column-parallel linear
        # (wq, wk, wv, w1, w3): DTensor reduces each module's input gradient separately
        assert per_owner(r["forward"]) == Counter({("all_reduce", "layer0"): 2})
        # (DTensor's backward redistributions carry no nn_module_stack, so count them per graph)
        assert Counter(kind for kind, _ in r["backward"]) == Counter({"all_reduce": 5})


# ---------------------------------------------------------------- (e): errors


def test_tp_must_divide_heads():
    message = r"tp=5 does not divide 24 attention heads of llama3.2-3b; choose tp in \{1,2,4,8\}"
    with pytest.raises(ParallelConfigError, match=message):
        with torch.device("meta"):
            build_model("llama3.2-3b", ParallelLayout(tp=5), num_layers=1)
    with pytest.raises(ParallelConfigError, match=r"tp=3 does not divide 16 attention heads"):
        get_config("qwen3-1.7b").check_parallel(tp=3, cp=2)  # checked before building anything
    get_config("qwen3-1.7b").check_parallel(tp=8, cp=2)
    with pytest.raises(ParallelConfigError, match=r"tp=3 does not divide 8 KV heads of llama3.2-3b"):
        with torch.device("meta"):
            build_model("llama3.2-3b", ParallelLayout(tp=3), num_layers=1)


@pytest.fixture
def fake_world():
    """A fake process group of 8 ranks in this process (rank 0); no communication happens."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield 8
    finally:
        dist.destroy_process_group()


def test_world_must_equal_tp_times_cp(fake_world):
    with pytest.raises(ParallelConfigError, match=r"world size 8 != tp\*cp\*pp = 2\*2\*1 = 4"):
        ParallelLayout.from_default_group(tp=2, cp=2)


def test_parallel_layout_without_dist():
    assert ParallelLayout.from_default_group() == ParallelLayout()
    with pytest.raises(ParallelConfigError, match="not initialised"):
        ParallelLayout.from_default_group(tp=2)


def test_unknown_model_and_registry():
    names = {"llama3.2-3b", "qwen3-1.7b", "llama3.3-70b", "tiny-llama", "tiny-qwen"}
    assert names <= set(model_names())
    with pytest.raises(UnknownModelError, match="unknown model 'gpt5'"):
        get_config("gpt5")


def test_example_batch_needs_seq_divisible_by_cp():
    model = build_model("tiny-llama", ParallelLayout(cp=2, cp_rank=1))
    with pytest.raises(ParallelConfigError, match="seq=15 is not divisible by cp=2"):
        model.example_batch(1, 15)


# ---------------------------------------------------------------- (f): full size on meta


@pytest.mark.parametrize("tp,cp", [(8, 1), (4, 2)])
def test_full_size_meta_build_under_fake_pg(fake_world, tp, cp):
    layout = ParallelLayout.from_default_group(tp=tp, cp=cp)
    with torch.device("meta"):
        model = build_model("llama3.2-3b", layout, num_layers=2, dtype=torch.bfloat16)
    batch = model.example_batch(mbs=8, seq=4096, device="meta")
    assert batch["input_ids"].shape == (8, 4096 // cp)
    cfg = get_config("llama3.2-3b")
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
    assert model.layers[0].self_attn.qkv_proj.weight.shape == (qkv_rows, cfg.hidden_size)
    assert model.embed_tokens.weight.shape == (cfg.vocab_size // tp, cfg.hidden_size)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied
    loss = model(**batch)
    loss.backward()
    assert loss.device.type == "meta" and loss.dtype == torch.float32
    assert model.layers[1].mlp.down_proj.weight.grad.shape == (cfg.hidden_size, cfg.ffn_size // tp)

    explanation = torch._dynamo.explain(model)(**batch)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_rope_llama3_scaling_matches_reference_values():
    from kareus_fx.models.transformer import rope_inv_freq

    inv = rope_inv_freq(get_config("llama3.2-3b"))
    assert inv.shape == (64,)
    assert inv[0].item() == 1.0  # high frequencies are not scaled
    # lowest frequency: theta^(-126/128) / factor 32
    lowest = torch.tensor(500000.0 ** (-126 / 128) / 32)
    torch.testing.assert_close(inv[-1], lowest, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen"])
def test_meta_build_materialises_like_a_seeded_build(name):
    """Build on meta, ``to_empty``, ``init_weights(seed)``: the model ``manual_seed`` builds."""
    with torch.device("meta"):
        model = build_model(name)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    torch.manual_seed(3)
    reference = build_model(name)
    assert (model.lm_head.weight is model.embed_tokens.weight) == get_config(name).tie_embeddings
    for (key, value), (ref_key, ref_value) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert key == ref_key and torch.equal(value, ref_value), key
    assert torch.equal(model.rotary.inv_freq, reference.rotary.inv_freq)
