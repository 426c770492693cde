"""``kareus plan --hf-config PATH``: a user's Hugging Face ``config.json`` planned like a reference model.

The Llama-3.2-3B-shaped config is the published ``config.json`` of meta-llama/Llama-3.2-3B as users
have it (transformers 4.x layout: top-level ``rope_theta`` and a ``rope_scaling`` block).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest

from kareus_fx.cli import main
from kareus_fx.models.configs import HFConfigError, get_config

pytest.importorskip("transformers")

LLAMA_3B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 24,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}


def _write(tmp_path, config: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_llama_3b_shaped_config_is_the_builtin_architecture(tmp_path):
    path = _write(tmp_path, LLAMA_3B_CONFIG)
    config = get_config(f"hf:{path}")
    assert replace(config, name="llama3.2-3b") == get_config("llama3.2-3b")
    assert get_config(f"hf:{tmp_path}") == config  # the directory that holds config.json


def test_qwen3_config_keeps_qk_norm(tmp_path):
    from transformers import Qwen3Config

    Qwen3Config(
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ).save_pretrained(tmp_path)
    config = get_config(f"hf:{tmp_path}")
    assert replace(config, name="qwen3-1.7b") == get_config("qwen3-1.7b")


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"hidden_size": 2560, "num_attention_heads": 20, "num_key_value_heads": 5},
            "tp=8 does not divide 20 attention heads",
        ),
        (
            {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
            "no tensor-parallel plan for gpt2 (GPT2LMHeadModel)",
        ),
        (
            {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
            "qwen2 (Qwen2ForCausalLM) is not a model type the reference transformer reproduces",
        ),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"model_type": "unknown-arch"}, "is not a readable Hugging Face config"),
        ({"num_attention_heads": 20}, "hidden size (3072) is not a multiple of the number of attention heads (20)"),
    ],
)
def test_bad_hf_config_fails_before_tracing(change, message, tmp_path, capsys, no_tracing):
    path = _write(tmp_path, {**LLAMA_3B_CONFIG, **change})
    out = tmp_path / "out"
    code = main(["plan", "--hf-config", str(path), "--tp", "8", "--mbs", "1", "--seq", "512", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.startswith("kareus plan: error: ") and len(err.strip().splitlines()) == 1
    assert not out.exists()  # nothing written, nothing overwritten


def test_missing_or_conflicting_hf_config_is_refused(tmp_path, capsys, no_tracing):
    missing = tmp_path / "nope" / "config.json"
    assert (
        main(
            [
                "plan",
                "--hf-config",
                str(missing),
                "--tp",
                "8",
                "--mbs",
                "1",
                "--seq",
                "512",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert f"no Hugging Face config file at {missing}" in capsys.readouterr().err
    not_json = _write(tmp_path, {}, "config.json")
    not_json.write_text("{not json")
    assert main(["plan", "--hf-config", str(not_json), "--mbs", "1", "--seq", "512"]) == 2
    assert "is not a readable Hugging Face config" in capsys.readouterr().err
    assert main(["plan", "--hf-config", str(not_json), "--model", "llama3.2-3b", "--mbs", "1", "--seq", "8"]) == 2
    assert "give one of --preset, --model and --hf-config, not --model and --hf-config" in capsys.readouterr().err
    with pytest.raises(HFConfigError, match="no model_type"):
        get_config(f"hf:{_write(tmp_path, {'hidden_size': 8}, 'other.json')}")


def _partition_types(plan_dir) -> Counter:
    plan = json.loads((plan_dir / "plan.json").read_text())
    return Counter(
        (t["graph"], t["collective"]["kind"], t["count"], len(t["slots"]), t["fingerprint"])
        for t in plan["partition_types"].values()
    )


@pytest.mark.slow  # two full-size traces and tunings, ~30 s each on 2 shared cores
def test_plan_hf_config_gives_the_builtin_partition_types_and_counts(tmp_path, capsys):
    path = _write(tmp_path, LLAMA_3B_CONFIG)
    shape = ["--tp", "8", "--mbs", "2", "--seq", "1024", "--layers", "4", "--json"]
    assert main(["plan", "--hf-config", str(path), *shape, "--out", str(tmp_path / "hf")]) == 0
    assert main(["plan", "--model", "llama3.2-3b", *shape, "--out", str(tmp_path / "builtin")]) == 0
    capsys.readouterr()
    hf, builtin = _partition_types(tmp_path / "hf"), _partition_types(tmp_path / "builtin")
    assert hf == builtin and sum(hf.values()) > 0, (hf, builtin)
    hf_plan = json.loads((tmp_path / "hf" / "plan.json").read_text())
    assert hf_plan["workload"]["model"] == f"hf:{path.resolve()}"
