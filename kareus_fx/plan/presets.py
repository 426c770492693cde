"""Named workloads: the paper's testbed configurations and its Llama-3.3-70B emulation.

The twelve testbed workloads (paper section 6.1, table 3) are two models (Llama-3.2-3B,
Qwen3-1.7B) x two parallel layouts (TP8; CP2 x TP4) x three microbatch shapes (8 x 4K, 8 x 8K,
16 x 4K), each with pipeline parallelism 2 and 8 microbatches per iteration (16 or 32 GPUs per
pipeline). The emulation (section 6.3, table 5) is Llama-3.3-70B with PP10 x TP8, microbatch 4 x
4K and 16 to 128 microbatches per pipeline (a global batch of 2048 over 128 to 16 pipelines).

The testbed presets split their 28 layers 15 + 13, as the paper's artifact configs do
(``num_layers_in_first_pipeline_stage: 15``, ``megatron_settings.py``; the paper says it partitions its
stages "such that stages are as balanced as possible, following Perseus", section 6.1), and carry
the artifact's other Megatron settings (``Preset.megatron``); the emulation's pipelines are
balanced by the planner (``stage_layers="balanced"``). Every dense
preset recomputes activations (``recompute="full"``): "We use activation checkpointing to reduce
memory pressure" (section 6.1), on Megatron-LM, whose checkpointing recomputes whole layers.

The emulation also runs interleaved 1F1B with 2 model chunks per GPU (``-v2``: 20 stages of 4
layers, balanced the same way; not in the paper), where the schedule can run the microbatch count:
``ScheduleInterleaved1F1B`` runs ``max(1, M // pp)`` equal rounds (Megatron-LM: ``M`` a multiple of
``pp``), so over 10 GPUs only 16 of the paper's counts (one round) qualifies: 32, 64 and 128 do not.

Llama 3.1 405B as its pre-training ran (Llama Team, "The Llama 3 Herd of Models", arXiv
2407.21783, section 3.3.2 and table 4): 126 layers, TP8 x PP16 on H100-80GB GPUs, sequences of
8,192 tokens, a microbatch of one sequence (16 sequences per data-parallel group per step at
16M tokens over DP128), interleaved 1F1B, and "to balance the pipeline, we reduce one Transformer
layer each from the first and the last stages". Presets ``llama3.1-405b-pp16tp8-v<V>-mb<N>``:
``V = 1`` (16 stages: 7, 8 x 14, 7 layers) and ``V = 4`` (64 chunks: 1, 2 x 62, 1), each with
``N`` = 64 or 128 microbatches per pipeline (the paper's own count per step is 16; more
microbatches per pipeline is what a smaller data-parallel degree gives).

Mixture-of-experts jobs with expert parallelism (EP), each on H100-SXM5-80GB with attention
data-parallel (``tp = 1``) and the expert-parallel group made of ``ep`` data-parallel replicas'
GPUs of one stage, placed node by node:

- ``qwen3-30b-a3b-ep8pp2-mbs2-seq4k``: Qwen3-30B-A3B, EP8 inside one node (NVLink), two stages.
- ``deepseek-v3-ep64pp16-mbs2-seq4k``: a DeepSeek-V3-shaped model as its pre-training ran (DeepSeek-AI,
  "DeepSeek-V3 Technical Report", arXiv 2412.19437, section 3.2: 16-way pipeline, 64-way expert
  parallelism across 8 nodes, ZeRO-1 data parallelism, 2048 H800 GPUs; section 4.2: 4K sequences, a
  batch of 15360). The first stage holds the 3 dense layers, the last 2 layers and the LM head, the 14
  others 4 MoE layers each. The H800 is an H100 with less NVLink bandwidth; the plan prices an H100.
  Its pipeline schedule is 1F1B (not DualPipe), and its attention is priced as standard attention
  (``kareus_fx.models.configs``).
- Routing is priced at uniform expert load (``expert_imbalance = 1``; ``--expert-imbalance``).
- Neither recomputes activations (``recompute="none"``): DeepSeek-V3 recomputes only its RMSNorms and
  MLA up-projections (section 3.2.3), which the standard attention priced here does not have.

Names read ``<model>-<layout>-mbs<M>-seq<S>k`` (testbed, MoE), ``llama3.3-70b-pp10tp8[-v2]-mb<N>``
(emulation) and ``llama3.1-405b-pp16tp8-v<V>-mb<N>``, for example ``qwen3-1.7b-tp8-mbs8-seq4k``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from kareus_fx.compose.pipeline_schedule import CompositionError, check_interleaving
from kareus_fx.cost_models.hardware import DEFAULT_GPU
from kareus_fx.errors import KareusError
from kareus_fx.frameworks.megatron_settings import (
    HF_DEFAULTS,
    TESTBED_SETTINGS,
    MegatronSettings,
    artifact_stage_layers,
)
from kareus_fx.models.configs import get_config


class UnknownPresetError(KareusError, ValueError):
    """A preset name that is not in :data:`PRESETS`."""


@dataclass(frozen=True)
class Preset:
    """One training workload: model, parallel layout, pipeline and microbatch shape."""

    name: str
    model: str
    tp: int
    cp: int
    pp: int
    microbatches: int
    mbs: int
    seq: int
    source: str
    """Where in the paper the workload comes from."""
    stage_layers: str | tuple[int, ...] = "balanced"
    """The paper balances its pipeline stages by hand (section 6.1); see ``plan/stage_balance.py``.
    A tuple: the layers of each of the ``pp x virtual_stages`` stages."""
    virtual_stages: int = 1
    """Model chunks per GPU (interleaved 1F1B above 1)."""
    gpu: str = DEFAULT_GPU
    in_paper: bool = True
    """A workload of the Kareus paper (``kareus bench --suite paper`` runs these)."""
    recompute: str = "full"
    """The testbed ran with activation checkpointing (section 6.1) on Megatron-LM: its full recompute
    (``kareus_fx.models.recompute``)."""
    dp: int = 1
    """Data-parallel replicas (``--dp`` overrides it); the paper's testbed runs one."""
    megatron: MegatronSettings = HF_DEFAULTS
    """Training settings outside the traced model (tied embeddings, distributed optimizer, dropout);
    the testbed presets carry the artifact's (``megatron_settings.py``)."""
    ep: int = 1
    """Expert-parallel degree of a mixture-of-experts model (1: dense, or experts not split)."""
    expert_imbalance: float = 1.0
    """The routing's load on the busiest expert-parallel rank over the uniform share (1: uniform)."""

    @property
    def gpus_per_pipeline(self) -> int:
        return self.tp * self.cp * self.pp


def _testbed_settings(model: str) -> dict[str, Any]:
    """The artifact's stage split (15 + 13) and Megatron settings of ``model`` (``megatron_settings.py``)."""
    return {
        "stage_layers": artifact_stage_layers(get_config(model).num_layers, 2),
        "megatron": TESTBED_SETTINGS[model],
    }


def _testbed_presets() -> list[Preset]:
    presets = []
    for model in ("llama3.2-3b", "qwen3-1.7b"):
        for layout, tp, cp in (("tp8", 8, 1), ("cp2tp4", 4, 2)):
            for mbs, seq in ((8, 4096), (8, 8192), (16, 4096)):
                presets.append(
                    Preset(
                        name=f"{model}-{layout}-mbs{mbs}-seq{seq // 1024}k",
                        model=model,
                        tp=tp,
                        cp=cp,
                        pp=2,
                        microbatches=8,
                        mbs=mbs,
                        seq=seq,
                        source="paper section 6.1, table 3 (testbed, PP2, 8 microbatches)",
                        **_testbed_settings(model),
                    )
                )
    # Tables 9 and 10: Qwen3-1.7B TP8 4K at microbatch sizes 12 and 20 (8 and 16 are above).
    for mbs in (12, 20):
        presets.append(
            Preset(
                name=f"qwen3-1.7b-tp8-mbs{mbs}-seq4k",
                model="qwen3-1.7b",
                tp=8,
                cp=1,
                pp=2,
                microbatches=8,
                mbs=mbs,
                seq=4096,
                source="paper section 6.5 (microbatch size), tables 9 and 10 (testbed, microbatch size sweep)",
                **_testbed_settings("qwen3-1.7b"),
            )
        )
    return presets


def _emulation_presets() -> list[Preset]:
    return [
        Preset(
            name=f"llama3.3-70b-pp10tp8{'' if v == 1 else f'-v{v}'}-mb{microbatches}",
            model="llama3.3-70b",
            tp=8,
            cp=1,
            pp=10,
            microbatches=microbatches,
            mbs=4,
            seq=4096,
            source="paper section 6.3, table 5 (large-scale emulation)"
            + ("" if v == 1 else f"; interleaved 1F1B with {v} chunks per GPU (not in the paper)"),
            virtual_stages=v,
            in_paper=v == 1,
        )
        for v in (1, 2)
        for microbatches in (16, 32, 64, 128)
        if v == 1 or interleaving_runs(10, v, microbatches)
    ]


def interleaving_runs(pp: int, virtual_stages: int, microbatches: int) -> bool:
    """Whether interleaved 1F1B can run ``microbatches`` over ``pp`` GPUs (``compose.pipeline_schedule``)."""
    try:
        check_interleaving(pp, virtual_stages, microbatches)
    except CompositionError:
        return False
    return True


def llama3_405b_stage_layers(pp: int, virtual_stages: int, layers: int = 126) -> tuple[int, ...]:
    """Layers per global stage as Llama 3's pre-training splits 405B: every stage the same, but
    one layer fewer on the first and on the last (arXiv 2407.21783, section 3.3.2)."""
    stages = pp * virtual_stages
    per_stage, rest = divmod(layers + 2, stages)
    if rest or per_stage < 2:
        raise ValueError(f"{layers} + 2 layers do not split evenly over {stages} stages of at least 2")
    return (per_stage - 1, *([per_stage] * (stages - 2)), per_stage - 1)


def _llama3_405b_presets() -> list[Preset]:
    return [
        Preset(
            name=f"llama3.1-405b-pp16tp8-v{v}-mb{microbatches}",
            model="llama3.1-405b",
            tp=8,
            cp=1,
            pp=16,
            microbatches=microbatches,
            mbs=1,
            seq=8192,
            source="Llama 3 pre-training (arXiv 2407.21783, section 3.3.2, table 4): TP8 x PP16 on H100, "
            "8K sequences, one sequence per microbatch, first and last stage one layer short",
            stage_layers=llama3_405b_stage_layers(16, v),
            virtual_stages=v,
            gpu="H100-SXM5-80GB",
            in_paper=False,
        )
        for v in (1, 4)
        for microbatches in (64, 128)
    ]


def _moe_presets() -> list[Preset]:
    """Expert-parallel mixture-of-experts training jobs (see the module docstring)."""
    return [
        Preset(
            name="qwen3-30b-a3b-ep8pp2-mbs2-seq4k",
            model="qwen3-30b-a3b",
            tp=1,
            cp=1,
            pp=2,
            microbatches=8,
            mbs=2,
            seq=4096,
            source="Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 128 experts, top-8, expert parallelism 8 "
            "inside one 8-GPU node, attention data-parallel (tp 1), 2 pipeline stages, 8 microbatches of 2 "
            "sequences (a layout chosen here, not a published job's)",
            stage_layers="balanced",
            gpu="H100-SXM5-80GB",
            in_paper=False,
            recompute="none",
            dp=8,
            ep=8,
        ),
        Preset(
            name="deepseek-v3-ep64pp16-mbs2-seq4k",
            model="deepseek-v3",
            tp=1,
            cp=1,
            pp=16,
            microbatches=60,
            mbs=2,
            seq=4096,
            source="DeepSeek-V3 (arXiv 2412.19437, section 3.2 and 4.2): 2048 GPUs, 16-way pipeline, 64-way "
            "expert parallelism over 8 nodes, data parallelism elsewhere (tp 1), 4K sequences, a batch of 15360 "
            "sequences (120 per pipeline over 128 replicas); microbatches of 2 sequences (not published: the "
            "least that splits into two nanobatches); 1F1B, not DualPipe",
            stage_layers=(3, *([4] * 14), 2),
            gpu="H100-SXM5-80GB",
            in_paper=False,
            recompute="none",
            dp=128,
            ep=64,
        ),
    ]


PRESETS: dict[str, Preset] = {
    p.name: p for p in _testbed_presets() + _emulation_presets() + _llama3_405b_presets() + _moe_presets()
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; an unknown name raises an error listing the close matches."""
    try:
        return PRESETS[name]
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UnknownPresetError(f"unknown preset {name!r}; {hint}known presets: {', '.join(PRESETS)}") from None
