"""The ``kareus`` torch.compile backend: capture, analyse, optionally dump, run.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="kareus")`` works in a fresh interpreter. Data flow per Dynamo
graph: Dynamo FX graph -> aot_autograd (min-cut partitioner, like ``aot_eager``) -> aten forward
and backward graphs -> :func:`kareus_fx.passes.analysis.analyse_graph` against the GPU spec ->
dump (``options={"dump_dir": ...}``) -> run the graph unchanged.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import min_cut_rematerialization_partition

from kareus_fx.config import KareusOptions
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.dump import GraphDumpFile
from kareus_fx.passes.analysis import analyse_graph

_graph_counter = itertools.count()


def kareus_backend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: Any = None
) -> Callable[..., Any]:
    """Compile one Dynamo graph. ``options`` is what ``torch.compile(..., options=...)`` received."""
    opts = KareusOptions.from_user(options)
    gpu = gpu_spec(opts.gpu)
    dump = _dump_file(opts, next(_graph_counter))

    def compile_aten(name: str) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
        def compiler(aten_gm: torch.fx.GraphModule, aten_inputs: list[Any]) -> Callable[..., Any]:
            analyse_graph(aten_gm, gpu)
            if dump is not None:
                dump.add(name, aten_gm)
            return boxed_nop(aten_gm, aten_inputs)

        return compiler

    return aot_autograd(
        fw_compiler=compile_aten("forward"),
        bw_compiler=compile_aten("backward"),
        inference_compiler=compile_aten("forward"),
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def _dump_file(opts: KareusOptions, index: int) -> GraphDumpFile | None:
    if opts.dump_dir is None:
        return None
    rank, world_size = _rank_and_world()
    graph_id = f"{index}"
    path = Path(opts.dump_dir) / f"kareus_graph_{index}_rank{rank}.json"
    return GraphDumpFile(path, gpu=opts.gpu, rank=rank, world_size=world_size, graph_id=graph_id)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
