"""Architecture configs of the reference models, copied from their published ``config.json``.

Only the architecture is used (no weights are ever downloaded). Each entry cites the model card
whose ``config.json`` it was copied from; the Hugging Face field each value comes from is named in
:class:`ModelConfig`'s field comments.

A user's own architecture: ``get_config("hf:PATH")`` reads the Hugging Face ``config.json`` at
``PATH`` (:func:`config_from_hf_file`; needs ``transformers``, the ``[hf]`` extra) into the same
:class:`ModelConfig`, so it is built, traced and planned like the registry's models. Accepted are
the model types the reference transformer reproduces (``llama``, ``qwen3``), whose transformers
tensor-parallel plan is the one it implements (q/k/v and gate/up column-parallel, o and down
row-parallel; Qwen3's q/k-norm), with SiLU, no linear biases and default or ``llama3`` RoPE, and the
mixture-of-experts types ``mixtral`` and ``qwen3_moe`` (the same attention; their sparse layers map
onto :class:`MoEConfig`, whose layout is: every layer from ``dense_layers`` on is sparse).

``deepseek-v3`` is shaped, not exact: its multi-head latent attention is approximated by standard
attention of the same head count (128 heads of head_dim 128, 128 KV heads), which misses the
low-rank query and key-value projections and the compressed KV cache, and its router by a softmax
top-k without the node-limited group routing (see its registry entry).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from kareus_fx.errors import KareusError, ParallelConfigError


class UnknownModelError(KareusError, ValueError):
    """A model name that is not in the registry."""


class HFConfigError(KareusError, ValueError):
    """A Hugging Face ``config.json`` that is missing, unreadable, or not a plannable architecture."""


HF_CONFIG_PREFIX = "hf:"
"""``get_config("hf:PATH")`` reads the Hugging Face ``config.json`` at ``PATH``."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """A ``rope_scaling`` block with ``"rope_type": "llama3"`` (frequency-dependent scaling)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts layers of a model: layers ``dense_layers`` and later replace the
    MLP with ``experts`` routed SwiGLU experts of hidden size ``expert_ffn_size``, ``top_k`` chosen
    per token by a softmax router (the chosen weights renormalised to sum to 1 when
    ``normalize_top_k``), plus, when ``shared_ffn_size`` > 0, a shared SwiGLU expert of that hidden
    size that every token passes through (several shared experts of one size add up to one)."""

    experts: int
    top_k: int
    expert_ffn_size: int
    shared_ffn_size: int = 0
    dense_layers: int = 0
    normalize_top_k: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in 1..{self.experts} (the experts), got {self.top_k}")
        if self.expert_ffn_size < 1 or self.shared_ffn_size < 0 or self.dense_layers < 0:
            raise ValueError(
                f"expert_ffn_size must be positive and shared_ffn_size, dense_layers non-negative, got "
                f"{self.expert_ffn_size}, {self.shared_ffn_size}, {self.dense_layers}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (Llama / Qwen3 family). Field <- ``config.json`` key."""

    name: str
    hidden_size: int  # hidden_size
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim
    ffn_size: int  # intermediate_size
    vocab_size: int  # vocab_size
    norm_eps: float  # rms_norm_eps
    rope_theta: float  # rope_theta
    tie_embeddings: bool  # tie_word_embeddings
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_scaling: Llama3RopeScaling | None = None  # rope_scaling (llama3 type only)
    init_std: float = 0.02  # initializer_range
    moe: MoEConfig | None = None  # the sparse layers (None: a dense model)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} heads is not a multiple of {self.num_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: RoPE needs an even head_dim, got {self.head_dim}")

    def check_parallel(self, tp: int = 1, cp: int = 1, ep: int = 1) -> None:
        """Raise :class:`ParallelConfigError` unless ``tp`` x ``cp`` (and ``ep``) can shard this model.

        TP shards attention heads, KV heads, FFN channels and the vocabulary, so ``tp`` must
        divide each; CP shards only the sequence (checked against a batch, not here). Expert
        parallelism (``ep`` > 1) splits the routed experts evenly over ``ep`` ranks made of
        ``ep // tp`` whole TP groups, so ``ep`` must divide the experts and be a multiple of
        ``tp``; it is not combined with CP (the expert group would mix context-parallel ranks,
        whose tokens are chunks of the same sequences, with data-parallel ones).
        """
        if tp < 1 or cp < 1 or ep < 1:
            raise ParallelConfigError(f"tp, cp and ep must be >= 1, got tp={tp}, cp={cp}, ep={ep}")
        sharded = [
            (self.num_heads, "attention heads"),
            (self.num_kv_heads, "KV heads"),
            (self.ffn_size, "FFN channels"),
            (self.vocab_size, "vocabulary entries"),
        ]
        for count, what in sharded:
            if count % tp:
                g = math.gcd(*(c for c, _ in sharded))
                choices = ",".join(str(d) for d in range(1, g + 1) if g % d == 0)
                raise ParallelConfigError(
                    f"tp={tp} does not divide {count} {what} of {self.name}; choose tp in {{{choices}}}"
                )
        if ep == 1:
            return
        if self.moe is None:
            raise ParallelConfigError(f"ep={ep} needs a mixture-of-experts model; {self.name} is dense (use ep=1)")
        if self.moe.experts % ep:
            raise ParallelConfigError(
                f"ep={ep} does not divide the {self.moe.experts} experts of {self.name}; choose ep in "
                f"{{{','.join(str(d) for d in range(1, self.moe.experts + 1) if self.moe.experts % d == 0)}}}"
            )
        if ep % tp:
            raise ParallelConfigError(
                f"ep={ep} is not a multiple of tp={tp}: the expert-parallel group is made of whole TP groups"
            )
        if cp > 1:
            raise ParallelConfigError(f"ep={ep} with cp={cp}: expert parallelism is not combined with CP here")

    def with_layers(self, num_layers: int | None) -> ModelConfig:
        """This config with ``num_layers`` decoder layers (``None``: unchanged)."""
        if num_layers is None:
            return self
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        return replace(self, num_layers=num_layers)


_LLAMA3_SCALING_32 = Llama3RopeScaling(32.0, 1.0, 4.0, 8192)
_LLAMA3_SCALING_8 = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)

_REGISTRY: dict[str, ModelConfig] = {
    # https://huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json
    "llama3.2-3b": ModelConfig(
        name="llama3.2-3b",
        hidden_size=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        head_dim=128,
        ffn_size=8192,
        vocab_size=128256,
        norm_eps=1e-5,
        rope_theta=500000.0,
        tie_embeddings=True,
        rope_scaling=_LLAMA3_SCALING_32,
    ),
    # https://huggingface.co/Qwen/Qwen3-1.7B/blob/main/config.json
    "qwen3-1.7b": ModelConfig(
        name="qwen3-1.7b",
        hidden_size=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        ffn_size=6144,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_embeddings=True,
        qk_norm=True,
    ),
    # https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct/blob/main/config.json
    "llama3.3-70b": ModelConfig(
        name="llama3.3-70b",
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        ffn_size=28672,
        vocab_size=128256,
        norm_eps=1e-5,
        rope_theta=500000.0,
        tie_embeddings=False,
        rope_scaling=_LLAMA3_SCALING_8,
    ),
    # https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json
    "llama3.1-405b": ModelConfig(
        name="llama3.1-405b",
        hidden_size=16384,
        num_layers=126,
        num_heads=128,
        num_kv_heads=8,
        head_dim=128,
        ffn_size=53248,
        vocab_size=128256,
        norm_eps=1e-5,
        rope_theta=500000.0,
        tie_embeddings=False,
        rope_scaling=_LLAMA3_SCALING_8,
    ),
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    # (num_local_experts, num_experts_per_tok; every layer sparse, the expert FFN is intermediate_size)
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_size=14336,
        vocab_size=32000,
        norm_eps=1e-5,
        rope_theta=1000000.0,
        tie_embeddings=False,
        moe=MoEConfig(experts=8, top_k=2, expert_ffn_size=14336),
    ),
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    # (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob; decoder_sparse_step 1
    # and no mlp_only_layers: every layer sparse, so intermediate_size 6144 sizes no layer)
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b",
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_size=6144,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_embeddings=False,
        qk_norm=True,
        moe=MoEConfig(experts=128, top_k=8, expert_ffn_size=768, normalize_top_k=True),
    ),
    # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json, shaped: the sizes of its
    # layers with two approximations. Multi-head latent attention (q_lora_rank 1536, kv_lora_rank 512,
    # qk_nope_head_dim 128 + qk_rope_head_dim 64, v_head_dim 128) is standard attention with 128
    # heads of head_dim 128 and 128 KV heads: it misses the low-rank q/kv down- and up-projections
    # (and their norms), the 192-wide query-key dot products and the compressed KV, so attention's
    # GEMM and core FLOPs are close but not equal; its YaRN RoPE scaling is plain RoPE (same cost).
    # The router is a softmax over the experts; DeepSeek-V3 scores with a sigmoid, picks within
    # n_group 8 / topk_group 4 expert groups (the node limit of its routing, not modelled: the
    # exchange is priced as if any rank may receive any token) and scales by routed_scaling_factor
    # 2.5, none of which changes a shape. Dense layers: first_k_dense_replace 3 of intermediate_size
    # 18432; n_shared_experts 1 of moe_intermediate_size 2048; no multi-token prediction layer.
    "deepseek-v3": ModelConfig(
        name="deepseek-v3",
        hidden_size=7168,
        num_layers=61,
        num_heads=128,
        num_kv_heads=128,
        head_dim=128,
        ffn_size=18432,
        vocab_size=129280,
        norm_eps=1e-6,
        rope_theta=10000.0,
        tie_embeddings=False,
        moe=MoEConfig(
            experts=256, top_k=8, expert_ffn_size=2048, shared_ffn_size=2048, dense_layers=3, normalize_top_k=True
        ),
    ),
    # Test-sized models (not published): an untied Llama with llama3 RoPE scaling and a tied
    # Qwen3 with QK-norm, so the tests cover both LM-head variants.
    "tiny-llama": ModelConfig(
        name="tiny-llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_size=128,
        vocab_size=256,
        norm_eps=1e-5,
        rope_theta=500000.0,
        tie_embeddings=False,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64),
    ),
    "tiny-qwen": ModelConfig(
        name="tiny-qwen",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_size=128,
        vocab_size=256,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_embeddings=True,
        qk_norm=True,
    ),
    # A test-sized mixture of experts: one dense layer, then sparse ones with a shared expert.
    "tiny-moe": ModelConfig(
        name="tiny-moe",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_size=128,
        vocab_size=256,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_embeddings=False,
        moe=MoEConfig(experts=8, top_k=2, expert_ffn_size=32, shared_ffn_size=32, dense_layers=1),
    ),
}


def model_names() -> list[str]:
    """Names accepted by :func:`get_config` and ``build_model``."""
    return list(_REGISTRY)


def get_config(name: str) -> ModelConfig:
    """The published config of ``name`` (see :func:`model_names`), or for ``"hf:PATH"`` the
    architecture of the Hugging Face ``config.json`` at ``PATH``."""
    if name.startswith(HF_CONFIG_PREFIX):
        return config_from_hf_file(name.removeprefix(HF_CONFIG_PREFIX))
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; choose one of {', '.join(_REGISTRY)}, "
            f"or {HF_CONFIG_PREFIX}PATH for a Hugging Face config.json"
        ) from None


# The tensor-parallel plan the reference transformer implements (transformers' base_model_tp_plan).
_LLAMA_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
# transformers model types whose decoder the reference transformer reproduces op for op.
_HF_MODEL_TYPES = ("llama", "qwen3")
# Mixture-of-experts types: the same attention, their sparse layers as an MoEConfig (_moe_from_hf).
_HF_MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
_QK_NORM_TP_PLAN = {
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}


@functools.lru_cache(maxsize=16)
def config_from_hf_file(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of the Hugging Face ``config.json`` at ``path`` (read locally
    with ``transformers.AutoConfig``; nothing is downloaded). Raises :class:`HFConfigError`
    naming the problem for a missing or unreadable file and for an architecture the reference
    transformer cannot express (no tensor-parallel plan, or another plan, activation, biases or
    RoPE type)."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise HFConfigError(
            f"no Hugging Face config file at {file}; give the path of a model's "
            "config.json (or of the directory that holds it)"
        )
    try:
        from transformers import AutoConfig
    except ImportError:
        raise HFConfigError("reading a Hugging Face config needs transformers: pip install 'kareus-fx[hf]'") from None
    try:
        raw = json.loads(file.read_text())
        hf = AutoConfig.for_model(**raw) if "model_type" in raw else None
    except Exception as err:  # noqa: BLE001 - transformers' validators raise their own types
        reason = str(err).strip().splitlines()[-1].strip() if str(err).strip() else type(err).__name__
        raise HFConfigError(f"{file} is not a readable Hugging Face config: {reason}") from None
    if hf is None:
        raise HFConfigError(f"{file} has no model_type; is it a Hugging Face model's config.json?")
    return _config_from_hf(hf, f"{HF_CONFIG_PREFIX}{file}")


def _config_from_hf(hf, name: str) -> ModelConfig:
    arch = f"{hf.model_type} ({', '.join(getattr(hf, 'architectures', None) or []) or 'no architectures'})"
    plan = dict(getattr(hf, "base_model_tp_plan", None) or {})
    if not plan:
        raise HFConfigError(
            f"{name}: transformers has no tensor-parallel plan for {arch}; kareus "
            "plans architectures with a Llama-family TP plan (e.g. llama, qwen3)"
        )
    qk_norm = set(_QK_NORM_TP_PLAN) <= set(plan)
    expected = {**_LLAMA_TP_PLAN, **(_QK_NORM_TP_PLAN if qk_norm else {})}
    moe_type = hf.model_type in _HF_MOE_MODEL_TYPES
    if moe_type:  # the experts have their own plan; the attention must be the Llama family's
        plan, expected = _attention_entries(plan), _attention_entries(expected)
    if plan != expected:
        raise HFConfigError(
            f"{name}: the tensor-parallel plan of {arch} is not the Llama-family one "
            f"the reference transformer implements: {plan}"
        )
    if hf.model_type not in (*_HF_MODEL_TYPES, *_HF_MOE_MODEL_TYPES):  # same plan, other code (Qwen2's biases)
        raise HFConfigError(
            f"{name}: {arch} is not a model type the reference transformer reproduces; "
            f"supported: {', '.join((*_HF_MODEL_TYPES, *_HF_MOE_MODEL_TYPES))}"
        )
    unsupported = [
        f"{key}={getattr(hf, key)!r}"
        for key, ok in (
            ("hidden_act", lambda v: v == "silu"),
            ("attention_bias", lambda v: not v),
            ("mlp_bias", lambda v: not v),
            ("sliding_window", lambda v: v is None or not getattr(hf, "use_sliding_window", True)),
        )
        if hasattr(hf, key) and not ok(getattr(hf, key))
    ]
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        unsupported.append(f"rope_type={rope_type!r}")
    if unsupported:
        raise HFConfigError(
            f"{name}: {arch} has {', '.join(unsupported)}; the reference transformer "
            "implements SiLU MLPs without biases, full causal attention and default or llama3 RoPE"
        )
    scaling = None
    if rope_type == "llama3":
        scaling = Llama3RopeScaling(
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    heads = hf.num_attention_heads
    try:
        return ModelConfig(
            name=name,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            ffn_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
            tie_embeddings=bool(hf.tie_word_embeddings),
            qk_norm=qk_norm,
            rope_scaling=scaling,
            init_std=float(getattr(hf, "initializer_range", 0.02)),
            moe=_moe_from_hf(hf, name) if moe_type else None,
        )
    except ValueError as err:
        raise HFConfigError(str(err)) from None


def _attention_entries(plan: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in plan.items() if ".self_attn." in key}


def _moe_from_hf(hf, name: str) -> MoEConfig:
    """The sparse layers of a ``mixtral`` or ``qwen3_moe`` config. Mixtral: every layer sparse,
    experts of ``intermediate_size``, top-k weights always renormalised. Qwen3-MoE: experts of
    ``moe_intermediate_size``; layer ``i`` is sparse unless listed in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step`` is non-zero, which the model reproduces only as a prefix of
    dense layers (sparse step 1, ``mlp_only_layers`` = ``0 .. k - 1``)."""
    experts, top_k = int(hf.num_local_experts), int(hf.num_experts_per_tok)
    if hf.model_type == "mixtral":
        return MoEConfig(experts=experts, top_k=top_k, expert_ffn_size=int(hf.intermediate_size))
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    if step != 1:
        raise HFConfigError(
            f"{name}: decoder_sparse_step={step} interleaves dense and sparse layers; the reference "
            "transformer makes every layer from the first sparse one on sparse (decoder_sparse_step 1)"
        )
    dense = sorted(int(i) for i in getattr(hf, "mlp_only_layers", None) or [])
    if dense != list(range(len(dense))):
        raise HFConfigError(
            f"{name}: mlp_only_layers={dense} is not a prefix 0..k-1 of the layers; the reference "
            "transformer's dense layers are the first ones"
        )
    return MoEConfig(
        experts=experts,
        top_k=top_k,
        expert_ffn_size=int(hf.moe_intermediate_size),
        dense_layers=len(dense),
        normalize_top_k=bool(hf.norm_topk_prob),
    )
