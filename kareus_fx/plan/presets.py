"""Named workloads: the paper's testbed configurations and its Llama-3.3-70B emulation.

The twelve testbed workloads (paper section 6.1, table 3) are two models (Llama-3.2-3B,
Qwen3-1.7B) x two parallel layouts (TP8; CP2 x TP4) x three microbatch shapes (8 x 4K, 8 x 8K,
16 x 4K), each with pipeline parallelism 2 and 8 microbatches per iteration (16 or 32 GPUs per
pipeline). The emulation (section 6.3, table 5) is Llama-3.3-70B with PP10 x TP8, microbatch 4 x
4K and 16 to 128 microbatches per pipeline (a global batch of 2048 over 128 to 16 pipelines).

Every preset's pipeline is balanced (``stage_layers="balanced"``): the paper partitions its stages
"such that stages are as balanced as possible, following Perseus" (section 6.1), not evenly. Every
preset recomputes activations (``recompute="full"``): "We use activation checkpointing to reduce
memory pressure" (section 6.1), on Megatron-LM, whose checkpointing recomputes whole layers.

Names read ``<model>-<layout>-mbs<M>-seq<S>k`` (testbed) and ``llama3.3-70b-pp10tp8-mb<N>``
(emulation), for example ``qwen3-1.7b-tp8-mbs8-seq4k``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from kareus_fx.errors import KareusError


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
    stage_layers: str = "balanced"
    """The paper balances its pipeline stages by hand (section 6.1); see ``plan/stage_balance.py``."""
    recompute: str = "full"
    """The testbed ran with activation checkpointing (section 6.1) on Megatron-LM: its full recompute
    (``kareus_fx.models.recompute``)."""
    dp: int = 1
    """Data-parallel replicas (``--dp`` overrides it); the paper's testbed runs one."""

    @property
    def gpus_per_pipeline(self) -> int:
        return self.tp * self.cp * self.pp


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
            )
        )
    return presets


def _emulation_presets() -> list[Preset]:
    return [
        Preset(
            name=f"llama3.3-70b-pp10tp8-mb{microbatches}",
            model="llama3.3-70b",
            tp=8,
            cp=1,
            pp=10,
            microbatches=microbatches,
            mbs=4,
            seq=4096,
            source="paper section 6.3, table 5 (large-scale emulation)",
        )
        for microbatches in (16, 32, 64, 128)
    ]


PRESETS: dict[str, Preset] = {p.name: p for p in _testbed_presets() + _emulation_presets()}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; an unknown name raises an error listing the close matches."""
    try:
        return PRESETS[name]
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UnknownPresetError(f"unknown preset {name!r}; {hint}known presets: {', '.join(PRESETS)}") from None
