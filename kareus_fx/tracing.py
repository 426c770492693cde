"""Trace a reference model at full size on one CPU: meta device + the ``fake`` process group.

No real GPUs, processes or weights: parameters live on the meta device, collectives go to
torch's ``fake`` backend at the real world size, and the compiled graphs run on meta tensors
(shape propagation only), which makes Dynamo and aot_autograd produce the forward and backward
graphs exactly as a real rank would.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from kareus_fx.errors import ParallelConfigError


@dataclass(frozen=True)
class TraceSpec:
    """What to trace: a reference model, its parallel layout and one microbatch's shape."""

    model: str
    tp: int = 1
    cp: int = 1
    mbs: int = 1
    seq: int = 2048
    layers: int | None = None
    dtype: torch.dtype = torch.bfloat16

    @property
    def world_size(self) -> int:
        return self.tp * self.cp


def add_trace_arguments(parser: argparse.ArgumentParser, spec: TraceSpec) -> None:
    """Add --model/--tp/--cp/--mbs/--seq/--layers with ``spec``'s values as defaults."""
    parser.add_argument("--model", default=spec.model)
    for name in ("tp", "cp", "mbs", "seq", "layers"):
        parser.add_argument(f"--{name}", type=int, default=getattr(spec, name))


def trace_spec_from_args(args: argparse.Namespace, **overrides: int) -> TraceSpec:
    """The :class:`TraceSpec` that :func:`add_trace_arguments`' arguments describe."""
    values = {name: getattr(args, name) for name in ("model", "tp", "cp", "mbs", "seq", "layers")}
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
    config.check_parallel(tp=spec.tp, cp=spec.cp)


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """Initialise torch's ``fake`` process group (rank 0 of ``world_size``) for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; trace in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trace_full_size(
    spec: TraceSpec, *, backend: str = "kareus", options: dict[str, Any] | None = None
) -> TraceResult:
    """Build ``spec.model`` on meta, compile it with ``backend`` and run forward + backward once.

    ``options`` go to ``torch.compile`` (for backend "kareus": ``dump_dir``, ``gpu``, ...).
    ``fullgraph=True``: a graph break in a reference model is an error, not a silent split.
    """
    from kareus_fx.models import ParallelLayout, build_model

    validate_trace_spec(spec)
    torch._dynamo.reset()
    with fake_process_group(spec.world_size):
        layout = ParallelLayout.from_default_group(tp=spec.tp, cp=spec.cp)
        with torch.device("meta"):
            model = build_model(spec.model, layout, num_layers=spec.layers, dtype=spec.dtype)
        batch = model.example_batch(mbs=spec.mbs, seq=spec.seq, device="meta")
        compiled = torch.compile(model, backend=backend, options=options or None, fullgraph=True)
        start_s = time.perf_counter()
        loss = compiled(**batch)
        loss.backward()
        wall_s = time.perf_counter() - start_s
    torch._dynamo.reset()
    dump_dir = (options or {}).get("dump_dir")
    paths = tuple(sorted(Path(dump_dir).glob("kareus_graph_*.json"))) if dump_dir else ()
    return TraceResult(wall_s=wall_s, dump_paths=paths)
