"""Several iteration frontiers at once: this process and worker processes share the solves.

``kareus plan`` composes one iteration frontier per method over the same pipeline; the solves
are independent and each runs in one thread (lowtime's solver steps one after another), so on a
machine with more than one core they can run side by side. Workers start with the ``spawn``
method (safe with threads, torch and CUDA in the parent, like the tuner's); each gets its
options pickled and returns its :class:`IterationFrontier` pickled, equal to what
:func:`compose_iteration` returns in this process (the solver is deterministic).

A spawned worker first imports numpy, networkx and lowtime (about a second), so a caller asks
for processes only where the solves take longer (see ``kareus_fx.plan.planner``); a caller that
may fork (``start_method="fork"``: one Python thread, no CUDA; ``capture.trace_pool.start_method``)
starts workers that import nothing. This process is one of the ``processes``: it first runs the
caller's ``meanwhile`` work (the planner's power-limit curve) and the solves whose every (stage,
instruction) has one option (no solver step), then takes solves from the small end of the queue
while each worker, once started, takes them from the large end, one at a time, until none is
left (as ``capture.trace_pool`` shares traces). The queue is ordered by each solve's step count
(:func:`~kareus_fx.compose.iteration.count_solver_steps`, at most ``max_solver_steps``), the
number its time goes with (on the 70B PP10 x 128 plan: Megatron-LM + Perseus 420 steps, 4.8 CPU s;
Nanobatching + Perseus 402, 3.7 s; Kareus 283, 2.9 s, though it has the most options: ordered by
options, the worker took Kareus first and this process then solved both others in turn). No
progress bar is shown while workers run.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from kareus_fx.compose.iteration import (
    DEFAULT_UNIT_TIME_S,
    IterationFrontier,
    choose_unit_time_s,
    compose_iteration,
    count_solver_steps,
)
from kareus_fx.compose.pipeline_schedule import Instruction

__all__ = ["compose_iterations"]


def compose_iterations(
    options_by_name: Mapping[str, Mapping[tuple[int, Instruction], Sequence[Any]]],
    num_microbatches: int,
    *,
    processes: int,
    progress: bool = False,
    meanwhile: Callable[[], None] | None = None,
    start_method: str = "spawn",
    **kwargs: Any,
) -> dict[str, IterationFrontier]:
    """:func:`compose_iteration` of each entry of ``options_by_name`` (``kwargs`` go to every
    call), in this process and up to ``processes - 1`` worker processes at once (1: all in this
    process, with ``progress``). ``meanwhile``: work for this process to do first (None: none);
    it runs once whatever ``processes`` is. ``start_method``: how workers start (``"fork"`` only
    where the caller knows it is safe). The result has ``options_by_name``'s order."""
    solving = {
        name: options
        for name, options in options_by_name.items()
        if any(len(list(getattr(o, "points", o))) > 1 for o in options.values())
    }
    workers = min(processes, len(solving)) - 1
    if workers < 1:
        if meanwhile is not None:
            meanwhile()
        return {
            name: compose_iteration(options, num_microbatches, progress=progress, **kwargs)
            for name, options in options_by_name.items()
        }
    # Most steps first: the longest solves start first, in the workers.
    pending = deque(sorted(solving, key=lambda name: -_steps(solving[name], num_microbatches, kwargs)))
    lock = threading.Lock()
    futures: dict[str, Future[IterationFrontier]] = {}
    here: dict[str, IterationFrontier] = {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(start_method)) as pool:

        def feed(_: object = None) -> None:
            """Give a worker the largest solve left (also a done callback: that worker is free)."""
            with lock:
                if not pending:
                    return
                name = pending.popleft()
                futures[name] = pool.submit(compose_iteration, solving[name], num_microbatches, **kwargs)
            futures[name].add_done_callback(feed)

        for _ in range(workers):
            feed()
        if meanwhile is not None:
            meanwhile()
        here.update(
            (name, compose_iteration(options, num_microbatches, **kwargs))
            for name, options in options_by_name.items()
            if name not in solving
        )
        while True:
            with lock:
                if not pending:
                    break
                name = pending.pop()
            here[name] = compose_iteration(solving[name], num_microbatches, **kwargs)
        done = {name: future.result() for name, future in futures.items()}
    return {name: here[name] if name in here else done[name] for name in options_by_name}


def _steps(options: Mapping[tuple[int, Instruction], Sequence[Any]], num_microbatches: int, kwargs: Any) -> int:
    """At most how many steps :func:`compose_iteration` takes on ``options`` with ``kwargs`` (at
    the quantum it coarsens to where ``max_solver_steps`` is given)."""
    unit_s = kwargs.get("unit_time_s", DEFAULT_UNIT_TIME_S)
    virtual_stages = kwargs.get("virtual_stages", 1)
    if kwargs.get("max_solver_steps") is not None:
        unit_s = choose_unit_time_s(
            options,
            num_microbatches,
            kwargs["max_solver_steps"],
            min_unit_time_s=unit_s,
            virtual_stages=virtual_stages,
        )
    return count_solver_steps(options, num_microbatches, unit_s, virtual_stages=virtual_stages)
