"""Compile-time tuning: ``options={"tune": "simulated" | "cuda", "plan_out": PATH}`` tunes the live
graph (:mod:`kareus_fx.plan.live_tuning`, one stage). With ``"tune_request": {...}`` it instead runs
:func:`kareus_fx.plan.planner.make_plan` on that :class:`~kareus_fx.plan.planner.PlanRequest` (model, tp,
cp, pp, microbatches, mbs, seq, layers, ...): the planner traces the reference model at full size
on the meta device under the fake process group, so it runs in a spawned process (rank 0 only;
the other ranks wait at a barrier); this is the way for pipelines. Either way the plan is
written to ``plan_out`` and then deployed like ``options["plan"]``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from pathlib import Path
from typing import Any

import torch.distributed as dist

from kareus_fx.config import KareusOptions
from kareus_fx.errors import KareusError, OptionsError
from kareus_fx.plan.plan_format import write_plan

__all__ = ["tuned_plan"]

_TUNED: set[Path] = set()


def tuned_plan(opts: KareusOptions) -> Path:
    """Plan ``opts.tune_request`` once per process into ``opts.plan_out`` (see the module docstring)."""
    from kareus_fx.plan.request import PlanRequest, validate_plan_request

    if opts.plan_out is None:
        raise OptionsError(
            "option 'tune' needs 'plan_out' (where to write the plan); with 'tune_request' the tuner plans "
            "that reference model at full size, without it the live graph"
        )
    tune_request, profiler = opts.tune_request, opts.tune
    if tune_request is None or profiler is None:  # the backend sends 'tune' alone to LiveTuning
        raise OptionsError("option 'tune_request' plans a reference model and needs 'tune' (the profiler)")
    known = {f.name for f in dataclasses.fields(PlanRequest)} - {"gpu", "profiler"}
    unknown = sorted(set(tune_request) - known)
    if unknown:
        raise OptionsError(f"option 'tune_request': unknown field(s) {unknown}; valid: {sorted(known)}")
    try:
        request = PlanRequest(**tune_request, gpu=opts.gpu, profiler=profiler)
    except TypeError as err:
        raise OptionsError(f"option 'tune_request': {err}") from None
    validate_plan_request(request)
    path = opts.plan_out
    if path in _TUNED:
        return path
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        _plan_in_child(request, path)
    if distributed:
        dist.barrier()
    _TUNED.add(path)
    return path


def _plan_in_child(request: Any, path: Path) -> None:
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_plan_worker, args=(request, str(path), send), name="kareus-tune")
    child.start()
    send.close()
    try:
        error = receive.recv()
    except EOFError:
        error = "the tuning process ended without a result (killed?)"
    child.join()
    if error is not None:
        raise KareusError(f"compile-time tuning failed: {error}")


def _plan_worker(request: Any, path: str, send: Any) -> None:
    from kareus_fx.plan.planner import make_plan

    try:
        write_plan(path, make_plan(request, Path(path).parent / (Path(path).stem + "-work"), progress=False).data)
        send.send(None)
    except BaseException as err:  # noqa: BLE001 - sent to the compiling process
        send.send(f"{type(err).__name__}: {err}")
