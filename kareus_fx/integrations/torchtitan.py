"""A kareus ``parallelize_fn`` for torchtitan's ``ModelSpec``.

torchtitan (0.3.0) compiles each ``TransformerBlock`` with ``block.compile(backend=..., fullgraph=True)``
and refuses every backend but ``inductor`` and ``aot_eager`` for a model with FlexAttention; its
TOML names a backend, never options. :func:`kareus_parallelize` wraps a model's own parallelize
function: it runs it with torchtitan's compile turned off (TP/SP, activation checkpointing, FSDP2
all as torchtitan applies them), then compiles every block of ``model.layers`` through the kareus
backend with the options given over those of the environment (``KAREUS_CONFIG`` / ``KAREUS_OPTIONS``).
Use it in a model spec::

    spec = llama3.model_registry("debugmodel")
    spec = dataclasses.replace(spec, parallelize_fn=kareus_parallelize(spec.parallelize_fn))

Per-block graphs. The blocks share their code, so Dynamo compiles it once per distinct guard set
and reuses it; :func:`compile_blocks` waits for a block input's pending collective before the
compiled block, so the first block (whose input holds a plain tensor) and the others (an
``AsyncCollectiveTensor``) share one graph. The nanobatch split, compile-time tuning (``tune`` +
``plan_out``, once per distinct graph) and a deployed plan all act on that graph. A plan made by
``tune`` on a block graph is a per-block plan (one stage whose partitions are the block's); a plan
made by ``kareus plan --compile-unit block`` holds the block's graphs and prices each stage as its
blocks, so it deploys here (with a ``StepContext`` or a pipelining schedule naming the microbatch
when there are several); a ``--compile-unit stage`` plan (the default) is for a whole stage graph
and the backend refuses it on a block graph, naming the flag. With the option ``run_log`` every
block reports to one run log per process (``deploy/run_log.py``: the first block's forward of
microbatch 0 opens an iteration), recorded at the next iteration and at exit.

Assumptions: ``model.layers`` is an ``nn.ModuleDict`` or ``nn.ModuleList`` of the blocks
(torchtitan's ``Decoder``); the wrapped function accepts torchtitan's keyword arguments
(``compile_config`` among them) and returns the model. FSDP2's hooks run outside the compiled
block graphs (torch's ``skip_fsdp_hooks``, on by default), as with torchtitan's own compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from kareus_fx.config_sources import resolve_options
from kareus_fx.errors import OptionsError

__all__ = ["compile_blocks", "kareus_parallelize"]


def compile_blocks(model: nn.Module, options: Mapping[str, Any] | None = None) -> int:
    """Compile every block of ``model.layers`` through the kareus backend; returns how many.

    ``options``: backend options, over those of the environment (``KAREUS_CONFIG`` /
    ``KAREUS_OPTIONS``, :mod:`kareus_fx.config_sources`), validated here so that a bad value fails
    before training starts, with an error naming the variable and the field."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise OptionsError(
            f"{type(model).__name__} has no `layers` ModuleDict/ModuleList of transformer blocks to compile "
            "(torchtitan's Decoder models have one)"
        )
    resolve_options(options)
    for block in layers.children():
        compiled = torch.compile(
            block._call_impl, backend="kareus", options=None if options is None else dict(options), fullgraph=True
        )
        block._compiled_call_impl = _settling(compiled)  # what nn.Module.compile sets, with settled inputs
    return len(layers)


def _settling(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` called with its DTensor inputs' pending collectives waited for first.

    A block's input is the previous block's output, a DTensor whose local tensor is still an
    ``AsyncCollectiveTensor`` (the pending reduce-scatter or all-reduce that ends a block), while
    the first block's input (the embedding's) holds a plain tensor. Dynamo guards on the local
    tensor's type, so without this the first block and the others compile as two Dynamo graphs
    (and compile-time tuning runs twice); their aten graphs also differ (the first one's backward
    saves other tensors). Waiting here costs nothing: the block's first op waits for it anyway.
    The local tensor is swapped in place for the waited one (the same values and storage; the
    DTensor's autograd history is on the DTensor, not on its local tensor)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, DTensor) and isinstance(value._local_tensor, AsyncCollectiveTensor):
                value._local_tensor = value._local_tensor.trigger_wait()
        return compiled(*args, **kwargs)

    return call


def kareus_parallelize(
    parallelize_fn: Callable[..., nn.Module], options: Mapping[str, Any] | None = None
) -> Callable[..., nn.Module]:
    """``parallelize_fn`` with its compile off, then the blocks compiled through kareus.

    The returned function takes torchtitan's arguments. The blocks are compiled when the job's
    ``compile_config`` enables compile for the model (``compile.enable`` and ``"model"`` in
    ``compile.components``); ``compile.backend`` is ignored (kareus compiles). ``options``: backend
    options over those of the environment, read when the function runs.
    """

    def parallelize(model: nn.Module, *args: Any, compile_config: Any, **kwargs: Any) -> nn.Module:
        wanted = compile_config.enable and "model" in compile_config.components
        off = dataclasses.replace(compile_config, enable=False)
        model = parallelize_fn(model, *args, compile_config=off, **kwargs)
        if wanted:
            torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan's apply_compile sets it
            compile_blocks(model, options)
        return model

    return parallelize
