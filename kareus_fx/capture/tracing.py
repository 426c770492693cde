"""Trace a reference model at full size on one CPU: meta device + the ``fake`` process group.

No real GPUs, processes or weights: parameters live on the meta device, collectives go to
torch's ``fake`` backend at the real world size, and the compiled graphs run on meta tensors
(shape propagation only), which makes Dynamo and aot_autograd produce the forward and backward
graphs exactly as a real rank would.

Pipeline parallelism: a spec with ``pp > 1`` traces one stage (``stage``) of the pipeline: its
layers, plus the embedding on the first stage and the LM head and loss on the last (see
``kareus_fx.models.stage_layers``). The fake process group has the stage's ranks: its TP x CP grid,
or with expert parallelism (``ep`` > 1, a mixture-of-experts model) its EP group of ``ep`` ranks
(``ep // tp`` data-parallel replicas' TP groups): the stage's graphs communicate only within them
(sends between stages are outside them). The expert all-to-alls of a traced stage assume each
expert's load is ``expert_imbalance`` times the uniform one (``kareus_fx.models.moe_pricing``).
:func:`distinct_stages` lists the stages worth tracing: one per group of identical stages.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from kareus_fx.errors import ParallelConfigError, UnsupportedGraphError
from kareus_fx.models.recompute import check_recompute
from kareus_fx.models.stage_layers import (
    PipelineStage,
    StageGroup,
    check_layer_counts,
    check_stage_layers,
    group_stages,
)

COMPILE_UNITS = ("stage", "block")
"""What one Dynamo graph covers (:attr:`TraceSpec.compile_unit`)."""


@dataclass(frozen=True)
class TraceSpec:
    """What to trace: a reference model, its parallel layout and one microbatch's shape.

    ``layers`` is the whole model's layer count (None: the config's); ``pp`` pipeline stages split
    it (``stage_layers``: one count per stage; None: evenly) and ``stage`` picks the one to trace.
    """

    model: str
    tp: int = 1
    cp: int = 1
    mbs: int = 1
    seq: int = 2048
    layers: int | None = None
    dtype: torch.dtype = torch.bfloat16
    pp: int = 1
    stage: int = 0
    stage_layers: tuple[int, ...] | None = None
    recompute: str = "none"
    """Activation checkpointing of the traced model (``kareus_fx.models.recompute``)."""
    compile_unit: str = "stage"
    """What is compiled as one graph: the whole stage (``"stage"``), or one decoder layer
    (``"block"``: torchtitan's per-block compile, ``integrations.torchtitan.compile_blocks``),
    the stage's last, with the rest of the stage running un-compiled around it."""
    ep: int = 1
    """Expert-parallel degree of a mixture-of-experts model: 1, or a multiple of ``tp``."""
    expert_imbalance: float = 1.0
    """The busiest expert's load over the uniform one (>= 1), at which every rank's expert
    all-to-alls and expert GEMMs are priced."""

    @property
    def world_size(self) -> int:
        """Ranks of the traced stage: its TP x CP grid, times ``ep // tp`` replicas under EP."""
        return self.tp * self.cp * max(1, self.ep // self.tp)


_INT_ARGUMENTS = ("tp", "cp", "mbs", "seq", "layers", "pp", "stage", "ep")


def add_trace_arguments(parser: argparse.ArgumentParser, spec: TraceSpec) -> None:
    """Add --model/--tp/--cp/--mbs/--seq/--layers/--pp/--stage/--ep/--expert-imbalance with
    ``spec``'s values as defaults."""
    parser.add_argument("--model", default=spec.model)
    for name in _INT_ARGUMENTS:
        parser.add_argument(f"--{name}", type=int, default=getattr(spec, name))
    parser.add_argument("--expert-imbalance", type=float, default=spec.expert_imbalance)


def trace_spec_from_args(args: argparse.Namespace, **overrides: int) -> TraceSpec:
    """The :class:`TraceSpec` that :func:`add_trace_arguments`' arguments describe."""
    values = {name: getattr(args, name) for name in ("model", *_INT_ARGUMENTS, "expert_imbalance")}
    return TraceSpec(**{**values, **overrides})


# The workload the benches trace by default: the Llama-3.2-3B TP=8 at full size.
BENCH_TRACE_SPEC = TraceSpec(model="llama3.2-3b", tp=8, mbs=8, seq=4096, layers=28)


@dataclass(frozen=True)
class TraceResult:
    """Wall time of one trace (Dynamo + aot_autograd + the backend, forward and backward)."""

    wall_s: float
    dump_paths: tuple[Path, ...]


def validate_trace_spec(spec: TraceSpec) -> None:
    """Raise a clear error for a layout the model cannot have, before any tracing."""
    from kareus_fx.models import get_config

    config = get_config(spec.model)  # unknown model -> error listing the known ones
    check_recompute(spec.recompute)
    for name, value in (("tp", spec.tp), ("cp", spec.cp), ("mbs", spec.mbs), ("seq", spec.seq)):
        if value < 1:
            raise ParallelConfigError(f"--{name} must be a positive integer, got {value}")
    if spec.layers is not None and spec.layers < 1:
        raise ParallelConfigError(f"--layers must be a positive integer, got {spec.layers}")
    if spec.seq % spec.cp:
        raise ParallelConfigError(
            f"sequence length {spec.seq} is not divisible by cp={spec.cp}: each context-parallel "
            f"rank needs an equal chunk; choose seq as a multiple of {spec.cp}"
        )
    config.check_parallel(tp=spec.tp, cp=spec.cp, ep=spec.ep)
    if not spec.expert_imbalance >= 1.0:
        raise ParallelConfigError(
            f"expert_imbalance is the busiest expert's load over the uniform one: >= 1, got {spec.expert_imbalance}"
        )
    if config.moe is not None and spec.tp > 1 and (spec.seq // spec.cp) % spec.tp:
        raise ParallelConfigError(
            f"sequence length {spec.seq} is not divisible by tp={spec.tp}: each TP rank routes an equal share of "
            f"every sequence's tokens through the experts; choose seq as a multiple of {spec.tp * spec.cp}"
        )
    check_stage_layers(spec.layers or config.num_layers, spec.pp)
    if spec.stage_layers is not None:
        PipelineStage(0, spec.pp, spec.stage_layers)
        check_layer_counts(spec.layers or config.num_layers, spec.stage_layers)
    if spec.compile_unit not in COMPILE_UNITS:
        raise ParallelConfigError(
            f"--compile-unit must be one of {', '.join(COMPILE_UNITS)} (what torch.compile compiles as one graph: "
            f"the whole stage, or each transformer block as torchtitan does), got {spec.compile_unit!r}"
        )
    if not 0 <= spec.stage < spec.pp:
        raise ParallelConfigError(
            f"--stage {spec.stage} is not a stage of a pp={spec.pp} pipeline; choose a stage in 0..{spec.pp - 1}"
        )


def distinct_stages(spec: TraceSpec) -> list[StageGroup]:
    """The pipeline's stages grouped by graph structure (role, layer count and, in a mixture of
    experts, dense layers), in stage order.

    Trace ``group.representative`` of each group once: every stage of a group has the same
    forward and backward graphs. ``spec.stage`` is ignored.
    """
    from kareus_fx.models import get_config

    validate_trace_spec(replace(spec, stage=0))
    config = get_config(spec.model)
    sparse_from = None if config.moe is None else config.moe.dense_layers
    return group_stages(spec.layers or config.num_layers, spec.pp, spec.stage_layers, sparse_from)


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """Initialise torch's ``fake`` process group (rank 0 of ``world_size``) for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; trace in a fresh process")
    # init_process_group wraps sys.excepthook to prefix "[rank0]:"; every trace would add one more
    # prefix to a later traceback, so the hook is put back when the group goes.
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


def trace_full_size(spec: TraceSpec, *, backend: str = "kareus", options: dict[str, Any] | None = None) -> TraceResult:
    """Build ``spec.model`` (stage ``spec.stage`` of ``spec.pp``) on meta, compile it with
    ``backend`` and run forward + backward once.

    The last (or only) stage's backward starts from its loss; any other stage's from a meta
    gradient of its output's shape, as the next stage would send it.
    ``options`` go to ``torch.compile`` (for backend "kareus": ``dump_dir``, ``gpu``, ...).
    ``fullgraph=True``: a graph break in a reference model is an error, not a silent split.
    """
    with _stage_model(spec) as (model, batch):
        if backend == "kareus":  # meta tensors: the graphs and their analysis, no generated code
            options = {"inductor": False, **(options or {})}
        compiled = torch.compile(model, backend=backend, options=options or None, fullgraph=True)
        start_s = time.perf_counter()
        out = compiled(**batch)
        output_grad = None if model.stage.is_last else torch.empty_like(out)
        torch.autograd.backward(out, grad_tensors=output_grad)
        wall_s = time.perf_counter() - start_s
    dump_dir = (options or {}).get("dump_dir")
    paths = tuple(sorted(Path(dump_dir).glob("kareus_graph_*.json"))) if dump_dir else ()
    return TraceResult(wall_s=wall_s, dump_paths=paths)


def trace_both_splits(spec: TraceSpec, gpu: str, nanobatched_dir: Path, sequential_dir: Path) -> tuple[Path, Path]:
    """The dumps of :func:`trace_full_size` with backend "kareus", ``options={"gpu": gpu}`` and
    ``"nanobatch"`` True (under ``nanobatched_dir``) and False (``sequential_dir``), from one
    Dynamo trace: the captured graph goes to the backend twice (nanobatch split or not,
    aot_autograd, passes, dump), each compiled graph run forward and backward once on meta.

    Dynamo's graph does not depend on the backend, so each dump is the one its own trace would
    write (``tests/test_tracing.py`` compares them). Each compile runs as Dynamo runs a backend,
    with lazily recompiled graph modules (``torch._dynamo.config.use_lazy_graph_module``): torch.fx
    then writes a graph module's Python code when it first runs, not at each of the thousands of
    modules aot_autograd and its checkpoint tracing build (8 % of the 70B PP10 plan's trace CPU:
    42.5 s against 47.2 s for its 6 slice traces, the mean of two runs each). The model must compile as one graph
    (``fullgraph=True``). Each directory holds this trace's dump alone: an earlier one there (a
    rerun into the same directory, whose graph number, a per-process count, may differ) goes.
    ``spec.compile_unit == "block"``: the graph is the stage's last decoder layer's, compiled on
    its own while the rest of the stage runs un-compiled (per-block compile)."""
    captured: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        captured.append((gm, example_inputs))
        return gm.forward

    kareus = torch._dynamo.lookup_backend("kareus")  # by name, as torch.compile finds it
    paths = []
    with _stage_model(spec) as (model, batch):
        if spec.compile_unit == "block":  # the stage's last layer alone; the rest runs as it is
            model.layers[-1].compile(backend=capture, fullgraph=True)
            model(**batch)
        else:
            torch.compile(model, backend=capture, fullgraph=True)(**batch)
        if len(captured) != 1:
            raise UnsupportedGraphError(
                f"stage {spec.stage} of {spec.model} traced into {len(captured)} graphs; the planner needs one "
                f"graph per {spec.compile_unit} (a model that compiles with fullgraph=True)"
            )
        gm, example_inputs = captured[0]
        # a block's input comes out of the un-compiled layers before it: a leaf of its own, so
        # each split's backward stops at the block (the earlier layers' graph is not kept for two)
        example_inputs = [
            x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.grad_fn is not None else x
            for x in example_inputs
        ]
        for split, out in ((True, nanobatched_dir), (False, sequential_dir)):
            for stale in Path(out).glob("kareus_graph_*.json"):  # an earlier run's: its graph number may differ
                stale.unlink()
            options = {"dump_dir": str(out), "gpu": gpu, "nanobatch": split, "inductor": False}
            # as Dynamo calls a backend: fx regenerates a graph module's code only when it runs
            with _use_lazy_graph_module(torch._dynamo.config.use_lazy_graph_module):
                # torch types a looked-up backend as CompilerFn(gm, inputs); a registered backend may take more
                compiled = kareus(gm, example_inputs, options=options)  # type: ignore[call-arg]
            returned = compiled(*example_inputs)
            outputs = [returned] if isinstance(returned, torch.Tensor) else list(returned)
            differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward(differentiable, grad_tensors=[torch.empty_like(o) for o in differentiable])
            (path,) = Path(out).glob("kareus_graph_*.json")
            paths.append(path)
    return paths[0], paths[1]


@contextmanager
def _stage_model(spec: TraceSpec) -> Iterator[tuple[Any, dict[str, torch.Tensor]]]:
    """Stage ``spec.stage`` of ``spec.model`` on meta and its example batch, under a fresh Dynamo
    and the ``fake`` process group of the stage's ranks."""
    from kareus_fx.models import ParallelLayout, build_model

    validate_trace_spec(spec)
    torch._dynamo.reset()
    try:
        with fake_process_group(spec.world_size):
            layout = ParallelLayout.from_default_group(tp=spec.tp, cp=spec.cp, ep=spec.ep)
            with torch.device("meta"):
                model = build_model(
                    spec.model,
                    layout,
                    num_layers=spec.layers,
                    dtype=spec.dtype,
                    stage=PipelineStage(spec.stage, spec.pp, spec.stage_layers),
                    recompute=spec.recompute,
                    expert_imbalance=spec.expert_imbalance,
                )
            yield model, model.example_batch(mbs=spec.mbs, seq=spec.seq, device="meta")
    finally:
        torch._dynamo.reset()
