"""The ``kareus`` torch.compile backend: capture, analyse, optionally dump, run.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="kareus")`` works in a fresh interpreter. Data flow per Dynamo
graph:

1. Dynamo FX graph -> nanobatch split of graphs that communicate (nothing to overlap otherwise;
   ``options={"nanobatch": False}`` turns it off; a graph the split cannot prove safe falls back
   to itself with one warning);
2. aot_autograd (min-cut partitioner, like ``aot_eager``) -> aten forward and backward graphs;
3. per aten graph: node analysis against the GPU spec, nanobatch labels, partitions and types,
   reorder to the nanobatching issue order (collective as soon as possible, waits at first use);
4. dump (``options={"dump_dir": ...}``);
5. with a plan (``options={"plan": PATH, "target": ..., "stage": s}``, or compile-time tuning
   with ``"tune"``): check the graph against the plan and compile the plan's stream-scheduled
   variants behind a microbatch dispatcher (``deploy.py``, ``passes/stream_schedule.py``; when
   the plan runs some microbatches un-split, the un-split Dynamo graph is compiled too and a
   Dynamo-level dispatcher picks per microbatch); without one, run the graph as it is.
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
from kareus_fx.cost_models.hardware import GPUSpec, gpu_spec
from kareus_fx.deploy import Deployment
from kareus_fx.dump import GraphDumpFile
from kareus_fx.passes.analysis import analyse_graph
from kareus_fx.passes.issue_order import apply_issue_order
from kareus_fx.passes.nanobatch import NANOBATCH_META, NanobatchResult, graph_communicates, split_nanobatches
from kareus_fx.passes.nanobatch_labels import label_nanobatches
from kareus_fx.passes.partitions import GraphPartitioning, partition_graph

_graph_counter = itertools.count()


def kareus_backend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: Any = None
) -> Callable[..., Any]:
    """Compile one Dynamo graph. ``options`` is what ``torch.compile(..., options=...)`` received."""
    opts = KareusOptions.from_user(options)
    gpu = gpu_spec(opts.gpu)
    dump = _dump_file(opts, next(_graph_counter))
    if opts.tune is not None and opts.tune_request is None:
        from kareus_fx.live_tuning import LiveTuning

        return LiveTuning(gm, example_inputs, opts, gpu, dump)
    return compile_graph(gm, example_inputs, gpu, dump, Deployment.from_options(opts), nanobatch=opts.nanobatch)


def compile_graph(
    gm: torch.fx.GraphModule, example_inputs: list[Any], gpu: GPUSpec, dump: GraphDumpFile | None,
    deployment: Deployment | None, *, nanobatch: bool = True, split: NanobatchResult | None = None,
) -> Callable[..., Any]:
    """Steps 1-5 of the module docstring (``split``: the nanobatch split, when already made)."""
    if split is None:
        if not (nanobatch and graph_communicates(gm, example_inputs)):
            return compile_autograd(gm, example_inputs, gpu, dump, deployment, nanobatched=False)
        split = split_nanobatches(gm, example_inputs)
    if not split.split:  # fell back: the only graph
        return compile_autograd(gm, example_inputs, gpu, dump, deployment, nanobatched=False)
    compiled = compile_autograd(split.gm, example_inputs, gpu, dump, deployment, nanobatched=True, unsplit=False)
    if deployment is not None and deployment.unsplit:
        # The plan runs some microbatches as the un-split Megatron-LM microbatch it priced.
        unsplit = compile_autograd(gm, example_inputs, gpu, None, deployment, nanobatched=False, unsplit=True)
        return deployment.select_graph(compiled, unsplit)
    return compiled


def compile_autograd(
    gm: torch.fx.GraphModule, example_inputs: list[Any], gpu: GPUSpec, dump: GraphDumpFile | None,
    deployment: Deployment | None, *, nanobatched: bool, unsplit: bool | None = None,
) -> Callable[..., Any]:
    """aot_autograd of ``gm`` with steps 3-5 of the module docstring on each aten graph.

    ``unsplit`` (see :meth:`Deployment.compile`): True, ``gm`` is the un-split graph a deployment
    runs beside the nanobatched one; False, the nanobatched one; None, the only graph."""
    forward_labels: dict[str, int | None] = {}

    def compile_aten(name: str, inference: bool = False) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
        def compiler(aten_gm: torch.fx.GraphModule, aten_inputs: list[Any]) -> Callable[..., Any]:
            analyse_graph(aten_gm, gpu)
            partitioning = None
            if nanobatched:
                partitioning = _schedule_nanobatches(aten_gm, name, forward_labels, gpu)
            if dump is not None:
                dump.add(name, aten_gm, partitioning)
            if deployment is not None and not inference:
                return deployment.compile(name, aten_gm, partitioning, aten_inputs, unsplit=unsplit)
            return boxed_nop(aten_gm, aten_inputs)

        return compiler

    return aot_autograd(
        fw_compiler=compile_aten("forward"),
        bw_compiler=compile_aten("backward"),
        inference_compiler=compile_aten("forward", inference=True),
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def _schedule_nanobatches(
    aten_gm: torch.fx.GraphModule, name: str, forward_labels: dict[str, int | None], gpu: GPUSpec
) -> GraphPartitioning:
    """Label nanobatches, find partitions, and reorder the graph to the nanobatching issue order.

    The forward graph's labels are kept for the backward (its saved-activation inputs are named
    after the forward nodes they save).
    """
    labels = label_nanobatches(aten_gm, forward_labels=forward_labels if name == "backward" else None)
    if name == "forward":
        forward_labels.update(labels)
    by_node = {node: labels.get(node.name) for node in aten_gm.graph.nodes}
    for node, label in by_node.items():
        node.meta[NANOBATCH_META] = label
    partitioning = partition_graph(aten_gm, by_node, name, gpu)
    apply_issue_order(aten_gm, partitioning.issue_order)
    return partitioning


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
