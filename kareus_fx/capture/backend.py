"""The ``kareus`` torch.compile backend: options, then the shared compile step.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="kareus")`` works in a fresh interpreter. Per Dynamo graph it
reads the options (``options=`` over those of the ``KAREUS_CONFIG`` / ``KAREUS_OPTIONS``
environment variables, ``kareus_fx/config_sources.py``), opens the graph's dump file (``options={"dump_dir": ...}``) and either

- compiles the graph with ``compile_step.compile_graph``: nanobatch split of graphs that
  communicate (``options={"nanobatch": False}`` turns it off; a graph the split cannot prove
  safe falls back to itself with one warning), aot_autograd, the passes on each aten graph,
  dump, Inductor's code generation (``options={"inductor": False}`` runs the graphs op by op),
  and with a plan (``options={"plan": PATH, "target": ..., "stage": s}``) the plan's
  stream-scheduled variants (``deploy/deployment.py``, ``passes/stream_schedule.py``); or
- with ``options={"power_limit": "real" | "dry-run", "plan": ...}``, sets the plan's job-wide power
  limit for the target and compiles the graph un-split (``deploy/power_limit_mode.py``); or
- with ``options={"tune": ...}``, returns a :class:`~kareus_fx.plan.live_tuning.LiveTuning` that
  plans the live graph at its first call and then deploys the plan through the same step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.fx

from kareus_fx.capture.compile_step import compile_graph
from kareus_fx.capture.dump import GraphDumpFile
from kareus_fx.config import KareusOptions
from kareus_fx.config_sources import resolve_options
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.deploy.bucket_dispatch import deployment_from_options
from kareus_fx.deploy.power_limit_mode import deploy_power_limit
from kareus_fx.plan.live_tuning import LiveTuning

_graph_counter = itertools.count()


def kareus_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], options: Any = None) -> Callable[..., Any]:
    """Compile one Dynamo graph. ``options`` is what ``torch.compile(..., options=...)`` received."""
    opts = resolve_options(options)
    gpu = gpu_spec(opts.gpu)
    dump = _dump_file(opts, next(_graph_counter))
    if opts.tune is not None and opts.tune_request is None:
        return LiveTuning(gm, example_inputs, opts, gpu, dump)
    if opts.power_limit is not None:
        deploy_power_limit(opts)
        return compile_graph(gm, example_inputs, gpu, dump, None, nanobatch=False, inductor=opts.inductor)
    return compile_graph(
        gm, example_inputs, gpu, dump, deployment_from_options(opts), nanobatch=opts.nanobatch, inductor=opts.inductor
    )


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
