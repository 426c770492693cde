"""Mixture-of-experts configs: the registry's MoE models build with their sparse layers where the
model cards put them, their sizes add up to the published parameter counts, Hugging Face
``mixtral`` / ``qwen3_moe`` configs map onto :class:`MoEConfig` (and sparse layouts the model
cannot reproduce are refused naming the field), and invalid expert-parallel layouts are refused."""

from __future__ import annotations

import pytest
import torch

from kareus_fx.capture.tracing import TraceSpec, validate_trace_spec
from kareus_fx.errors import ParallelConfigError
from kareus_fx.models import build_model, get_config
from kareus_fx.models.configs import HFConfigError, MoEConfig
from kareus_fx.models.moe_pricing import CountPricedMoE, MetaOnlyError
from kareus_fx.models.transformer import MLP


def _meta_model(name: str, layers: int):
    with torch.device("meta"):
        return build_model(name, num_layers=layers, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("name", "dense_layers", "shared"),
    [("mixtral-8x7b", 0, False), ("qwen3-30b-a3b", 0, False), ("deepseek-v3", 3, True)],
)
def test_moe_registry_models_build_with_sparse_layers_after_the_dense_ones(name, dense_layers, shared):
    model = _meta_model(name, dense_layers + 1)
    kinds = [type(layer.mlp) for layer in model.decoder_layers]
    assert kinds == [MLP] * dense_layers + [CountPricedMoE]
    moe = model.decoder_layers[-1].mlp
    assert isinstance(moe, CountPricedMoE)
    assert (moe.shared_gate_up is not None) == shared
    assert moe.local_experts == get_config(name).moe.experts  # ep=1: every expert on this rank


@pytest.mark.parametrize(("name", "billions"), [("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5)])
def test_moe_registry_models_have_the_published_parameter_counts(name, billions):
    count = sum(p.numel() for p in _meta_model(name, None).parameters())
    assert count / 1e9 == pytest.approx(billions, rel=0.01)


def test_sparse_layers_follow_the_global_layer_index_in_a_pipeline_stage():
    from kareus_fx.models import PipelineStage

    with torch.device("meta"):
        stage = build_model("deepseek-v3", num_layers=61, stage=PipelineStage(0, 3, (4, 4, 53)))
    assert [type(layer.mlp) for layer in stage.decoder_layers] == [MLP, MLP, MLP, CountPricedMoE]


def test_the_count_priced_block_refuses_real_tensors():
    model = build_model("tiny-moe", dtype=torch.float32)
    batch = model.example_batch(mbs=1, seq=8, device="cpu")
    with pytest.raises(MetaOnlyError, match="ExpertParallelMoE"):
        model(**batch)


@pytest.mark.parametrize(
    ("model", "tp", "cp", "ep", "message"),
    [
        ("tiny-llama", 1, 1, 2, "dense"),
        ("tiny-moe", 1, 1, 3, "does not divide the 8 experts"),
        ("deepseek-v3", 8, 1, 4, "not a multiple of tp=8"),
        ("tiny-moe", 1, 2, 2, "not combined with CP"),
    ],
)
def test_invalid_expert_parallel_layouts_are_refused(model, tp, cp, ep, message):
    with pytest.raises(ParallelConfigError, match=message):
        get_config(model).check_parallel(tp=tp, cp=cp, ep=ep)


def test_trace_spec_checks_expert_imbalance_and_the_tp_token_split():
    validate_trace_spec(TraceSpec(model="tiny-moe", tp=2, ep=4, seq=64, expert_imbalance=1.5))
    with pytest.raises(ParallelConfigError, match="expert_imbalance"):
        validate_trace_spec(TraceSpec(model="tiny-moe", ep=2, expert_imbalance=0.5))
    with pytest.raises(ParallelConfigError, match="not divisible by tp=2"):
        validate_trace_spec(TraceSpec(model="tiny-moe", tp=2, ep=2, seq=63))
    assert TraceSpec(model="tiny-moe", tp=2, ep=8).world_size == 8
    assert TraceSpec(model="tiny-moe", tp=2, ep=2).world_size == 2


_SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "num_experts_per_tok": 2,
}


def _saved(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return f"hf:{tmp_path}"


def test_mixtral_hf_config_round_trip(tmp_path):
    from transformers import MixtralConfig

    config = get_config(_saved(tmp_path, MixtralConfig(**_SMALL, intermediate_size=96, num_local_experts=8)))
    assert config.moe == MoEConfig(experts=8, top_k=2, expert_ffn_size=96)
    assert (config.hidden_size, config.num_layers, config.num_kv_heads, config.qk_norm) == (64, 3, 2, False)


def test_qwen3_moe_hf_config_round_trip(tmp_path):
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeConfig(
        **_SMALL,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        mlp_only_layers=[0],
        norm_topk_prob=False,
    )
    config = get_config(_saved(tmp_path, hf))
    assert config.moe == MoEConfig(experts=8, top_k=2, expert_ffn_size=32, dense_layers=1, normalize_top_k=False)
    assert (config.ffn_size, config.qk_norm) == (128, True)


@pytest.mark.parametrize(
    ("kind", "fields", "named"),
    [
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("mixtral", {"sliding_window": 4096}, "sliding_window"),
    ],
)
def test_sparse_layouts_the_model_cannot_reproduce_are_refused(tmp_path, kind, fields, named):
    from transformers import MixtralConfig, Qwen3MoeConfig

    cls = {"qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}[kind]
    with pytest.raises(HFConfigError, match=named):
        get_config(_saved(tmp_path, cls(**_SMALL, num_local_experts=8, **fields)))


def test_expert_parallel_group_spans_whole_tp_groups():
    from kareus_fx.capture.tracing import fake_process_group
    from kareus_fx.models import ParallelLayout

    with fake_process_group(8):
        layout = ParallelLayout.from_default_group(tp=2, ep=8)
        assert (layout.world_size, layout.ep_replicas, layout.ep_rank) == (8, 4, 0)
        assert (layout.tp_group.size(), layout.ep_group.size()) == (2, 8)
        with pytest.raises(ParallelConfigError, match=r"world size 8 != tp\*cp\*pp\*\(ep/tp\) = 2\*1\*1\*2 = 4"):
            ParallelLayout.from_default_group(tp=2, ep=4)
    with pytest.raises(ParallelConfigError, match="cp=1"):
        ParallelLayout.from_default_group(tp=2, cp=2, ep=4)


def test_stages_with_dense_and_sparse_layers_trace_apart():
    from kareus_fx.capture.tracing import distinct_stages

    spec = TraceSpec(model="deepseek-v3", ep=8, pp=5, stage_layers=(2, 2, 2, 2, 53))
    groups = [(g.role, g.num_layers, g.dense_layers, g.stages) for g in distinct_stages(spec)]
    assert groups == [("first", 2, 2, (0,)), ("middle", 2, 1, (1,)), ("middle", 2, 0, (2, 3)), ("last", 53, 0, (4,))]


def test_the_model_cards_config_reads_as_the_registry_entry(tmp_path):
    from dataclasses import replace

    from transformers import Qwen3MoeConfig

    card = Qwen3MoeConfig(  # Qwen/Qwen3-30B-A3B's config.json architecture fields
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    assert replace(get_config(_saved(tmp_path, card)), name="qwen3-30b-a3b") == get_config("qwen3-30b-a3b")
