"""The one compile step every path shares: Dynamo graph -> aten graphs -> passes -> runnable.

Used by the backend (``backend.py``) for each Dynamo graph and by compile-time tuning
(``plan/live_tuning.py``) to trace the live graph and then deploy its plan, so both compile
the same way. Steps (the backend's module docstring gives the whole data flow):

1. nanobatch split of graphs that communicate (or the split already made);
2. aot_autograd with Inductor's decompositions and the min-cut partitioner -> aten forward and
   backward (the graphs are the same with and without Inductor's code generation, so a plan's
   fingerprint holds for both);
3. per aten graph: node analysis against the GPU spec, grouped and priced as the kernels
   Inductor generates (``passes/kernel_groups.py``), nanobatch labels,
   partitions and types, reorder to the nanobatching issue order;
4. dump, when a dump file is given;
5. with a deployment, the plan's stream-scheduled variants; without one, the graph as it is;
   each compiled by :mod:`kareus_fx.capture.codegen` (Inductor's inner compile holding the
   graph's order, or op by op with ``inductor=False``).

Inductor's FX graph cache does not serve these compiles: Inductor bypasses it whenever
``_post_fusion_custom_pass`` is a plain function, as codegen's ``hold_plan_order`` is (a cache
keyed without the plan's order, the nanobatch fusion rule and the nanobatch labels could serve
another plan's code), so every process compiles its graphs itself. Inductor's joint-graph pattern passes are not run (``compile_fx`` runs them on the
device's graphs, which made the meta-device trace of ``kareus plan`` differ from the live graph).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch._functorch.config
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

from kareus_fx.capture.codegen import GraphCodegen
from kareus_fx.capture.dump import GraphDumpFile
from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.deploy.bucket_dispatch import BucketedDeployment, sequence_input
from kareus_fx.deploy.deployment import Deployment
from kareus_fx.deploy.plan_checks import check_plan_recompute
from kareus_fx.passes.analysis import analyse_graph, sizes_at
from kareus_fx.passes.issue_order import apply_issue_order
from kareus_fx.passes.kernel_groups import group_kernels
from kareus_fx.passes.nanobatch import NANOBATCH_META, NanobatchResult, graph_communicates, split_nanobatches
from kareus_fx.passes.nanobatch_labels import label_nanobatches
from kareus_fx.passes.partitions import GraphPartitioning, partition_graph
from kareus_fx.workload import GraphName

__all__ = ["compile_autograd", "compile_graph"]


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    gpu: GPUSpec,
    dump: GraphDumpFile | None,
    deployment: Deployment | BucketedDeployment | None,
    *,
    nanobatch: bool = True,
    split: NanobatchResult | None = None,
    inductor: bool = True,
) -> Callable[..., Any]:
    """Steps 1-5 of the module docstring (``split``: the nanobatch split, when already made;
    ``inductor``: Inductor generates the code, else the graphs run op by op)."""
    if deployment is not None:
        check_plan_recompute(deployment.plan, gm)
    if split is None and nanobatch and graph_communicates(gm, example_inputs):
        split = split_nanobatches(gm, example_inputs)
    sequence = sequence_input(gm, split.batch_inputs) if split is not None and split.split else None
    if (
        isinstance(deployment, Deployment)
        and deployment.sizes is None
        and sequence is not None
        and sequence.symbol is not None
    ):
        deployment = BucketedDeployment.of_one_length(deployment)  # a symbolic length: per call
    if isinstance(deployment, BucketedDeployment):  # one compile per sequence-length bucket
        dumps = iter([dump])  # the first compile dumps

        def compile_bucket(bucket: Deployment | None) -> Callable[..., Any]:
            if bucket is None:
                return compile_autograd(gm, example_inputs, gpu, None, None, nanobatched=False, inductor=inductor)
            return compile_graph(gm, example_inputs, gpu, next(dumps, None), bucket, split=split, inductor=inductor)

        return deployment.compile(sequence, compile_bucket)
    if split is None:
        return compile_autograd(gm, example_inputs, gpu, dump, deployment, nanobatched=False, inductor=inductor)
    if not split.split:  # fell back: the only graph
        return compile_autograd(gm, example_inputs, gpu, dump, deployment, nanobatched=False, inductor=inductor)
    compiled = compile_autograd(
        split.gm, example_inputs, gpu, dump, deployment, nanobatched=True, unsplit=False, inductor=inductor
    )
    if deployment is not None and deployment.unsplit:
        # The plan runs some microbatches as the un-split Megatron-LM microbatch it priced.
        unsplit = compile_autograd(
            gm, example_inputs, gpu, None, deployment, nanobatched=False, unsplit=True, inductor=inductor
        )
        return deployment.select_graph(compiled, unsplit)
    return compiled


def compile_autograd(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    gpu: GPUSpec,
    dump: GraphDumpFile | None,
    deployment: Deployment | None,
    *,
    nanobatched: bool,
    unsplit: bool | None = None,
    inductor: bool = True,
) -> Callable[..., Any]:
    """aot_autograd of ``gm`` with steps 3-5 of the module docstring on each aten graph.

    ``unsplit`` (see :meth:`Deployment.compile`): True, ``gm`` is the un-split graph a deployment
    runs beside the nanobatched one; False, the nanobatched one; None, the only graph."""
    forward_labels: dict[str, int | None] = {}

    def compile_aten(
        name: GraphName, inference: bool = False
    ) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
        def compiler(aten_gm: torch.fx.GraphModule, aten_inputs: list[Any]) -> Callable[..., Any]:
            with sizes_at(deployment.sizes if deployment is not None else None):
                return compile_at_sizes(aten_gm, aten_inputs)

        def compile_at_sizes(aten_gm: torch.fx.GraphModule, aten_inputs: list[Any]) -> Callable[..., Any]:
            analyse_graph(aten_gm, gpu)
            partitioning = None
            if nanobatched:
                partitioning = _schedule_nanobatches(aten_gm, name, forward_labels, gpu)
            else:
                group_kernels(aten_gm, gpu.ridge_point_flops_per_byte())
            if dump is not None:
                dump.add(name, aten_gm, partitioning)
            codegen = GraphCodegen(inductor=inductor, is_backward=name == "backward", is_inference=inference)
            if deployment is not None and not inference:
                return deployment.compile(name, aten_gm, partitioning, aten_inputs, codegen, unsplit=unsplit)
            return codegen(aten_gm, aten_inputs)

        return compiler

    # A switching deployment compiles every candidate's variants now: aot_autograd would compile
    # the backward at its first call, i.e. during training at the first switch to a new graph.
    compile_backward_now = deployment is not None and deployment.switching is not None
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=compile_backward_now):
        return aot_autograd(
            fw_compiler=compile_aten("forward"),
            bw_compiler=compile_aten("backward"),
            inference_compiler=compile_aten("forward", inference=True),
            decompositions=select_decomp_table(),
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)


def _schedule_nanobatches(
    aten_gm: torch.fx.GraphModule, name: GraphName, forward_labels: dict[str, int | None], gpu: GPUSpec
) -> GraphPartitioning:
    """Label nanobatches, group kernels, find partitions, and reorder the graph to the
    nanobatching issue order.

    The forward graph's labels are kept for the backward (its saved-activation inputs are named
    after the forward nodes they save).
    """
    labels = label_nanobatches(aten_gm, forward_labels=forward_labels if name == "backward" else None)
    if name == "forward":
        forward_labels.update(labels)
    by_node = {node: labels.get(node.name) for node in aten_gm.graph.nodes}
    for node, label in by_node.items():
        node.meta[NANOBATCH_META] = label
    group_kernels(aten_gm, gpu.ridge_point_flops_per_byte())  # kernels within one nanobatch
    partitioning = partition_graph(aten_gm, by_node, name, gpu)
    apply_issue_order(aten_gm, partitioning.issue_order)
    return partitioning
