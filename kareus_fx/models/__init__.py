"""Reference models of the Kareus paper, built from their published configs (no weights).

``build_model(name, layout, num_layers, dtype)`` gives a :class:`Transformer` whose
``forward(input_ids, labels)`` returns the mean token loss; ``model.example_batch(mbs, seq)``
gives this rank's inputs. See ``transformer.py`` for the collectives each layout issues.
``build_model(..., stage=PipelineStage(index, num_stages))`` builds one pipeline stage
(``stage_layers.py``: layer split, stage roles, groups of stages with the same graph structure).
Attention is the fused ``kareus::attention`` op (``attention_op.py``), which the analysis prices
and the on-device profiler replays. A mixture-of-experts config (``ModelConfig.moe``) builds sparse
layers whose expert-parallel exchange is priced by counts on the meta device (``moe_pricing.py``);
``moe.py`` holds the exact, runnable expert-parallel layer.
"""

from kareus_fx.models.configs import ModelConfig, MoEConfig, UnknownModelError, get_config, model_names
from kareus_fx.models.parallel import (
    ParallelLayout,
    copy_to_tp,
    cp_all_gather,
    gather_from_tp,
    reduce_from_tp,
)
from kareus_fx.models.stage_layers import (
    PipelineStage,
    StageGroup,
    group_stages,
    stage_layer_range,
)
from kareus_fx.models.transformer import Transformer, build_model

__all__ = [
    "MoEConfig",
    "ModelConfig",
    "ParallelLayout",
    "PipelineStage",
    "StageGroup",
    "Transformer",
    "UnknownModelError",
    "build_model",
    "copy_to_tp",
    "cp_all_gather",
    "gather_from_tp",
    "get_config",
    "group_stages",
    "model_names",
    "reduce_from_tp",
    "stage_layer_range",
]
