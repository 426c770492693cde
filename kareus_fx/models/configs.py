"""Architecture configs of the reference models, copied from their published ``config.json``.

Only the architecture is used (no weights are ever downloaded). Each entry cites the model card
whose ``config.json`` it was copied from; the Hugging Face field each value comes from is named in
:class:`ModelConfig`'s field comments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kareus_fx.errors import KareusError, ParallelConfigError


class UnknownModelError(KareusError, ValueError):
    """A model name that is not in the registry."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """A ``rope_scaling`` block with ``"rope_type": "llama3"`` (frequency-dependent scaling)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: {self.num_heads} heads is not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: RoPE needs an even head_dim, got {self.head_dim}")

    def check_parallel(self, tp: int = 1, cp: int = 1) -> None:
        """Raise :class:`ParallelConfigError` unless ``tp`` x ``cp`` can shard this model.

        TP shards attention heads, KV heads, FFN channels and the vocabulary, so ``tp`` must
        divide each; CP shards only the sequence (checked against a batch, not here).
        """
        if tp < 1 or cp < 1:
            raise ParallelConfigError(f"tp and cp must be >= 1, got tp={tp}, cp={cp}")
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
                    f"tp={tp} does not divide {count} {what} of {self.name}; "
                    f"choose tp in {{{choices}}}"
                )

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
}


def model_names() -> list[str]:
    """Names accepted by :func:`get_config` and ``build_model``."""
    return list(_REGISTRY)


def get_config(name: str) -> ModelConfig:
    """The published config of ``name`` (see :func:`model_names`)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; choose one of {', '.join(_REGISTRY)}"
        ) from None
