"""torchtitan 0.3.0's llama3 debugmodel on CPU, parallelized through kareus, for tests.

The debugmodel cut to its first ``layers`` layers, torchtitan's ``ScaledDotProductAttention``
as inner attention (FlexAttention has no backward on CPU), torchtitan's TP/SP sharding config on
a partial-DTensor backend, fp32 (torchtitan's default bf16 FSDP mixed precision set to fp32), the
blocks compiled through :func:`kareus_fx.integrations.torchtitan.kareus_parallelize` with the
options of ``KAREUS_OPTIONS``. Runs inside a rank of ``dist_harness.run_distributed``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DebugLlama:
    """A parallelized model, the mesh it runs on and how to build another unparallelized copy."""

    model: torch.nn.Module
    dims: Any
    built: Callable[[], torch.nn.Module]
    """A new unparallelized model of the same config, on the meta device."""


def debug_llama(world_size: int, layers: int, dp: int = 1) -> DebugLlama:
    """``dp`` FSDP2 replicas x ``world_size // dp``-way TP of the debugmodel (module docstring),
    materialised on CPU with torchtitan's initial weights (seeded by the caller)."""
    from torchtitan_import import import_torchtitan

    llama3 = import_torchtitan()
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    from kareus_fx.integrations.torchtitan import kareus_parallelize

    parallel_dims_module.device_type = "cpu"  # torchtitan picks "cuda" on a machine without a GPU
    spec = llama3.model_registry("debugmodel")
    config = spec.model
    config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=True)
    parallelism = ParallelismConfig(
        tensor_parallel_degree=world_size // dp, data_parallel_shard_degree=dp, spmd_backend="partial_dtensor"
    )
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()

    def built() -> torch.nn.Module:
        with torch.device("meta"):
            model = config.build()
        return model

    model = kareus_parallelize(spec.parallelize_fn)(
        built(),
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(enable=True, backend="kareus"),
        ac_config=None,
        dump_folder="",
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):  # gloo has no PREMUL_SUM: SUM, then FSDP2 divides apart
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return DebugLlama(model, dims, built)
