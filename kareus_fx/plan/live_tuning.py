"""Compile-time tuning on the live graph: ``options={"tune": "simulated" | "cuda", "plan_out": PATH}``.

The backend returns a :class:`LiveTuning` for the Dynamo graph. At its first call (outside
Dynamo's compile, because aot_autograd compiles a backward only when one runs):

1. Trace: rank 0 compiles the Dynamo graph, nanobatched and un-split, through the same
   aot_autograd passes as the backend (analysis, nanobatch labels, partitions, issue order) and
   runs forward and backward once on fake copies of the inputs, which gives the aten forward and
   backward graphs as dumps. Nothing runs on a device and no collective is issued; no gradient
   reaches the model.
2. Plan: rank 0 tunes and composes the dumps like ``kareus plan`` (``planner.plan_traced``) and
   writes the plan to ``plan_out``; every rank learns the outcome (a broadcast, so a failure on
   rank 0 is raised on every rank instead of leaving them waiting).
3. Deploy: the plan is deployed on the same graph like ``options["plan"]`` (``target`` picks the
   point) and the call runs it. Later calls run the deployed graph directly.

Dynamic shapes: when the graph's sequence length is symbolic, steps 1-2 run once per bucket
(``options["tune_seq"]``, or else the lengths seen: the compiled example's and the first call's),
each traced on fake inputs of that length, and the plan is a bucketed plan (``plan/bucketed_plan.py``)
deployed per call like one made by ``kareus plan --seq`` (``deploy/bucket_dispatch.py``). The deployment
is compiled on Dynamo's symbolic example values inside the compile's tracing context, so it stays
symbolic.

Workload of the plan (``workload.model`` is ``"live-graph"``; the layer count is unknown, null):
one pipeline stage (``pp=1``) whose collectives all run over one group spanning the job (its
size is ``tp``; ``cp=1``); ``mbs`` is the split's batch size, ``seq`` dim 1 of the first batch
input (1 if it has none), ``dtype`` the first floating-point input's, ``microbatches`` the
``microbatches`` option (default 1). Other layouts (CP, PP, data parallelism) are refused with an
error naming ``tune_request`` (a reference model traced at full size) or ``kareus plan``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode

from kareus_fx.capture.compile_step import compile_autograd, compile_graph
from kareus_fx.capture.dump import GraphDumpFile
from kareus_fx.config import KareusOptions
from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.deploy.bucket_dispatch import deployment_from_options, sequence_input
from kareus_fx.errors import KareusError, ParallelConfigError
from kareus_fx.models.recompute import live_recompute
from kareus_fx.passes.nanobatch import NanobatchResult, graph_communicates, split_nanobatches
from kareus_fx.plan.plan_format import bucketed_plan_data, write_plan

if TYPE_CHECKING:
    from kareus_fx.plan.request import PlanRequest
    from kareus_fx.plan.stage_tracing import StageGraphs

__all__ = ["LiveTuning", "live_plan_request"]


class LiveTuning:
    """The backend's callable for a graph tuned at compile time (module docstring)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        opts: KareusOptions,
        gpu: GPUSpec,
        dump: GraphDumpFile | None,
    ) -> None:
        if opts.plan_out is None:
            raise KareusError("option 'tune' needs 'plan_out': the path the tuned plan is written to")
        if opts.stage != 0:
            raise ParallelConfigError(
                f"option 'tune' plans the live graph as one pipeline stage, but options stage={opts.stage}: "
                "for a pipeline, plan with `kareus plan --pp N` (or option 'tune_request') and deploy with 'plan'"
            )
        self.gm, self.example_inputs, self.opts, self.gpu, self.dump = gm, example_inputs, opts, gpu, dump
        self.split: NanobatchResult | None = None
        if opts.nanobatch and graph_communicates(gm, example_inputs):
            self.split = split_nanobatches(gm, example_inputs)
        self._deployed: Callable[..., Any] | None = None
        self.sequence = (
            sequence_input(gm, self.split.batch_inputs) if self.split is not None and self.split.split else None
        )
        self.tracing = TracingContext.try_get()  # Dynamo's, for a symbolic graph's deployment
        fake_mode = self.tracing.fake_mode if self.tracing is not None else None
        shape_env = fake_mode.shape_env if fake_mode is not None else None
        self.hints = {sym: int(v) for sym, v in shape_env.var_to_val.items()} if shape_env is not None else {}

    def __call__(self, *args: Any) -> Any:
        if self._deployed is None:
            self._deployed = self._tune_and_deploy(args)
        return self._deployed(*args)

    def _buckets(self, args: tuple[Any, ...]) -> tuple[int, ...] | None:
        """The sequence lengths to plan when the graph's is symbolic (module docstring); None
        when it is not."""
        if self.sequence is None or self.sequence.symbol is None:
            return None
        if self.opts.tune_seq is not None:
            return self.opts.tune_seq
        seen = {int(args[self.sequence.index].shape[1]), _evaluate(self.sequence.symbol, {}, self.hints)}
        return tuple(sorted(seen))

    def _tune_and_deploy(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        plan_out = Path(self.opts.plan_out)  # type: ignore[arg-type]
        buckets = self._buckets(args)
        error = None
        if _rank() == 0:
            try:
                self._plan(plan_out, plan_out.parent / f"{plan_out.stem}-work", buckets)
            except Exception as err:  # noqa: BLE001 - reported on every rank below
                error = f"{type(err).__name__}: {err}"
        if dist.is_available() and dist.is_initialized():
            shared = [error]
            dist.broadcast_object_list(shared, src=0)
            error = shared[0]
        if error is not None:
            raise KareusError(f"compile-time tuning of the live graph failed on rank 0: {error}")
        opts = dataclasses.replace(self.opts, tune=None, plan=plan_out)
        deployment = deployment_from_options(opts)
        if buckets is None:
            return compile_graph(
                self.gm,
                self.example_inputs,
                self.gpu,
                self.dump,
                deployment,
                nanobatch=self.opts.nanobatch,
                split=self.split,
                inductor=self.opts.inductor,
            )
        symbolic_inputs = [n.meta["example_value"] for n in self.gm.graph.nodes if n.op == "placeholder"]
        with tracing(self.tracing):
            return compile_graph(
                self.gm,
                symbolic_inputs,
                self.gpu,
                self.dump,
                deployment,
                nanobatch=self.opts.nanobatch,
                split=self.split,
                inductor=self.opts.inductor,
            )

    def _plan(self, plan_out: Path, work_dir: Path, buckets: tuple[int, ...] | None) -> None:
        from kareus_fx.plan.planner import plan_traced
        from kareus_fx.plan.stage_tracing import stage_graphs_from_dumps

        def plan_at(seq: int | None) -> dict[str, Any]:
            """The plan at sequence length ``seq`` (None: the example's)."""
            sizes = None if seq is None else {self.sequence.symbol: seq}  # type: ignore[union-attr]
            work = work_dir if seq is None else work_dir / f"seq{seq}"
            dumps = {split: self._trace(work / "dumps", split, sizes) for split in (True, False)}
            stage = stage_graphs_from_dumps((0,), dumps[True], dumps[False])
            request = live_plan_request(self.opts, stage, self.split, self.example_inputs, self.gm)
            if seq is not None:
                request = dataclasses.replace(request, seq=seq)
            key = (str(plan_out), repr(request), _stage_fingerprints(stage))
            if key not in _TUNED_GRAPHS:
                _TUNED_GRAPHS[key] = plan_traced(request, [stage], work, progress=False).data
            return _TUNED_GRAPHS[key]

        if buckets is None:
            write_plan(plan_out, plan_at(None))
        else:
            write_plan(plan_out, bucketed_plan_data({seq: plan_at(seq) for seq in buckets}))

    def _trace(self, dump_root: Path, split: bool, sizes: Mapping[Any, int] | None) -> Path:
        """Dump the aten forward and backward of the graph (step 1 of the module docstring), on
        fake inputs of the example's shapes, or with its symbolic sizes at ``sizes``."""
        nanobatched = split and self.split is not None and self.split.split
        source = self.split.gm if nanobatched else self.gm  # type: ignore[union-attr]
        path = dump_root / f"{'nanobatched' if split else 'sequential'}.json"
        dump = GraphDumpFile(path, gpu=self.gpu.name, rank=0, world_size=_world_size(), graph_id="live")
        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        fakes = self._fake_inputs(fake_mode, sizes)
        # Fake tensors trace the graphs; nothing runs, so no code is generated.
        compiled = compile_autograd(source, fakes, self.gpu, dump, None, nanobatched=nanobatched, inductor=False)
        with fake_mode:
            outputs = compiled(*fakes)
            outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
            differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
            leaves = [x for x in fakes if isinstance(x, torch.Tensor) and x.requires_grad]
            if not differentiable or not leaves:
                raise KareusError(
                    "option 'tune' plans a training step, but the live graph has no output that needs a "
                    "gradient (run it with gradients enabled, on a model with trainable parameters)"
                )
            torch.autograd.grad(differentiable, leaves, [torch.ones_like(o) for o in differentiable], allow_unused=True)
        return path

    def _fake_inputs(self, fake_mode: FakeTensorMode, sizes: Mapping[Any, int] | None) -> list[Any]:
        """Fake copies of the example inputs; with ``sizes``, at those values of the graph's shape
        symbols (the others at their hints)."""
        if sizes is None:
            return [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in self.example_inputs]
        fakes: list[Any] = []
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for node, example in zip(placeholders, self.example_inputs):
            value = node.meta.get("example_value", example)
            if isinstance(value, torch.SymInt):
                fakes.append(_evaluate(value.node.expr, sizes, self.hints))
            elif isinstance(example, torch.Tensor):
                shape = [
                    _evaluate(s.node.expr, sizes, self.hints) if isinstance(s, torch.SymInt) else int(s)
                    for s in value.shape
                ]
                if shape == list(example.shape):
                    fakes.append(fake_mode.from_tensor(example))
                    continue
                with fake_mode:
                    fake = torch.zeros(shape, dtype=example.dtype, device=example.device)
                fakes.append(fake.requires_grad_(example.requires_grad))
            else:
                fakes.append(example)
        return fakes


_TUNED_GRAPHS: dict[tuple[str, str, tuple[str, ...]], dict[str, Any]] = {}
"""Plans tuned in this process, by (``plan_out``, plan request, the traced graphs' fingerprints):
Dynamo compiles the same code into several graphs when a guard fails (per-block compile: each
block is a call of one code object), and a graph with the fingerprints of one already tuned is
the same work, so it gets that plan, not a second tuning run."""


def _stage_fingerprints(stage: StageGraphs) -> tuple[str, ...]:
    """The fingerprints of a traced stage's graphs, nanobatched (when split) and un-split."""
    partitioned = stage.partitioned or {}
    return tuple(
        fp
        for name in sorted(stage.sequential)
        for fp in (partitioned[name].fingerprint if name in partitioned else "", stage.sequential[name].fingerprint)
    )


def _evaluate(expr: Any, sizes: Mapping[Any, int], hints: Mapping[Any, int]) -> int:
    """A symbolic size at ``sizes``, its other symbols at ``hints`` (the compiled example's)."""
    if isinstance(expr, int) or expr.is_number:
        return int(expr)
    return int(expr.xreplace({**hints, **sizes}))


def live_plan_request(
    opts: KareusOptions,
    stage: StageGraphs,
    split: NanobatchResult | None,
    example_inputs: list[Any],
    gm: torch.fx.GraphModule,
) -> PlanRequest:
    """The :class:`~kareus_fx.plan.planner.PlanRequest` of the live graph (module docstring)."""
    from kareus_fx.plan.request import LIVE_GRAPH_MODEL, PlanRequest

    world = _world_size()
    sizes = sorted({c.group_size for graph in stage.sequential.values() for c in graph.collectives})
    if sizes not in ([], [world]) or (not sizes and world != 1):
        raise ParallelConfigError(
            f"option 'tune' plans the live graph as one stage whose collectives span the job, but this "
            f"graph communicates over groups of {sizes or 'no'} ranks in a job of {world}: for context, "
            f"pipeline or data parallelism give option 'tune_request' (a reference model) or use `kareus plan`"
        )
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = dict(zip(placeholders, example_inputs))
    batch_inputs = [tensors[name] for name in (split.batch_inputs if split is not None else ())]
    mbs = split.batch_size if split is not None and split.batch_size else 1
    seq = batch_inputs[0].shape[1] if batch_inputs and batch_inputs[0].dim() >= 2 else 1
    dtype = next(
        (x.dtype for x in example_inputs if isinstance(x, torch.Tensor) and x.is_floating_point()), torch.float32
    )
    return PlanRequest(
        model=LIVE_GRAPH_MODEL,
        tp=world,
        cp=1,
        pp=1,
        microbatches=opts.microbatches,
        mbs=mbs,
        seq=int(seq),
        layers=None,
        gpu=opts.gpu,
        profiler=opts.tune or "simulated",
        dtype=str(dtype).removeprefix("torch."),
        recompute=live_recompute(gm),
    )  # plan_traced refuses other dtypes


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
