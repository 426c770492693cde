"""The Megatron-LM settings a plan prices beyond the traced model: what the paper's testbed ran.

The paper's artifact (ml-energy/kareus, ``tests/artifact/conf/megatron_qwen3_1.7b_config.yaml`` and
``megatron_llama3.2_3b_config.yaml``, launched by ``tests/artifact/run_megatron.sh``, which
overrides only ``tensor_model_parallel_size``, ``context_parallel_size``, ``micro_batch_size``,
``global_batch_size`` and ``encoder_seq_length`` per sweep row; ``run_kareus.sh`` and the other
methods' scripts load the same configs) trains with NeMo on Megatron-core. Of its settings, these
change what an iteration costs and are not in the traced HF-style model:

- ``num_layers_in_first_pipeline_stage: 15`` on both models: stages of 15 + 13 layers on every row
  (:data:`TESTBED_FIRST_STAGE_LAYERS`; the presets carry the split, ``presets.py``).
- ``share_embeddings_and_output_weights``: true on Qwen3-1.7B, false on Llama-3.2-3B (whose HF
  config ties them): no word-embedding gradient sync between the first and the last stage on the
  Llama rows (``step_tail.py``).
- ``optim.name: mcore_distributed_optim``: Megatron-core's distributed optimizer, which shards the
  step over the data x context group (``step_tail.py``).
- ``hidden_dropout: 0.1`` with ``bias_dropout_add_fusion``: a dropout mask per residual add
  (``megatron_dropout.py``).
- ``gradient_accumulation_fusion: false``: each microbatch's weight gradients added into the fp32
  ``main_grad`` buffer in a pass of their own (``megatron_main_grad.py``).
- ``transformer_engine: true`` with ``sequence_parallel: false``: the column-parallel linears'
  input-gradient all-reduces overlap their weight-gradient GEMMs (``megatron_async_dgrad.py``).

A user's workload (``kareus plan`` without a preset) gets :data:`HF_DEFAULTS`: the traced model's
own tying, Megatron-LM's default (non-distributed) optimizer, no dropout, no separate gradient
accumulation, and its collectives in the traced order (as kareus deploys the un-split step).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HF_DEFAULTS", "TESTBED_FIRST_STAGE_LAYERS", "TESTBED_SETTINGS", "MegatronSettings", "artifact_stage_layers"]


@dataclass(frozen=True)
class MegatronSettings:
    """Training settings outside the traced graphs that change an iteration's cost."""

    tie_embeddings: bool | None = None
    """Whether the output layer shares the word embedding; None: the model config's
    (``ModelConfig.tie_embeddings``, the HF ``tie_word_embeddings``)."""
    distributed_optimizer: bool = False
    """Megatron-core's distributed optimizer: gradients reduce-scattered and parameters
    all-gathered over the data x context group, each rank stepping its shard."""
    hidden_dropout: float = 0.0
    """Dropout probability of the fused bias-dropout-add after attention and after the MLP."""
    gradient_accumulation_fusion: bool | None = None
    """Megatron-core's weight-gradient accumulation into fp32 ``main_grad``: False adds each
    microbatch's bf16 gradient in a pass of its own (``megatron_main_grad.py``); True (fused into the
    GEMM) or None (not Megatron: the traced backward's own gradients) adds nothing."""
    te_async_dgrad: bool = False
    """Transformer Engine's linears without sequence parallelism (``transformer_engine: true``,
    ``sequence_parallel: false``): each column-parallel input-gradient all-reduce runs beside its
    weight-gradient GEMM (``megatron_async_dgrad.py``). False prices the traced order, which is how kareus
    deploys an un-split step (it adds no such overlap)."""
    source: str = ""
    """Where the settings come from."""


HF_DEFAULTS = MegatronSettings()

TESTBED_FIRST_STAGE_LAYERS = 15
"""``num_layers_in_first_pipeline_stage`` of both artifact configs (28 layers: 15 + 13)."""

_ARTIFACT = "ml-energy/kareus tests/artifact/conf/megatron_{}_config.yaml (the paper's testbed, NeMo on Megatron-core)"


def _artifact_settings(config: str, *, tie_embeddings: bool) -> MegatronSettings:
    """The settings both artifact configs share, with the model's own embedding tying."""
    return MegatronSettings(
        tie_embeddings=tie_embeddings,
        distributed_optimizer=True,
        hidden_dropout=0.1,
        gradient_accumulation_fusion=False,
        te_async_dgrad=True,
        source=_ARTIFACT.format(config),
    )


TESTBED_SETTINGS: dict[str, MegatronSettings] = {
    "qwen3-1.7b": _artifact_settings("qwen3_1.7b", tie_embeddings=True),
    "llama3.2-3b": _artifact_settings("llama3.2_3b", tie_embeddings=False),
}
"""The artifact's settings per testbed model (module docstring)."""


def artifact_stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """The artifact's split: :data:`TESTBED_FIRST_STAGE_LAYERS` on the first stage, the rest evenly
    over the others (Megatron-core's ``num_layers_in_first_pipeline_stage``)."""
    rest = num_layers - TESTBED_FIRST_STAGE_LAYERS
    if pp < 2 or rest < pp - 1 or rest % (pp - 1):
        raise ValueError(f"{num_layers} layers do not split as {TESTBED_FIRST_STAGE_LAYERS} + even over {pp} stages")
    return (TESTBED_FIRST_STAGE_LAYERS, *([rest // (pp - 1)] * (pp - 1)))
