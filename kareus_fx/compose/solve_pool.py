"""Several iteration frontiers at once: this process and worker processes share the solves.

``kareus plan`` composes one iteration frontier per method over the same pipeline; the solves
are independent and each runs in one thread (lowtime's solver steps one after another), so on a
machine with more than one core they can run side by side. Workers start with the ``spawn``
method (safe with threads, torch and CUDA in the parent, like the tuner's); each gets its
options pickled and returns its :class:`IterationFrontier` pickled, equal to what
:func:`compose_iteration` returns in this process (the solver is deterministic).

Starting a worker (importing numpy, networkx and lowtime) takes about a second, so a caller asks
for processes only where the solves take longer (see ``kareus_fx.plan.planner``). This process
is one of the ``processes``: it first runs the caller's ``meanwhile`` work (the planner's
power-limit curve) and the solves whose every (stage, instruction) has one option (no solver
step), then takes solves from the small end of the queue while each worker, once started, takes
them from the large end, one at a time, until none is left (as ``capture.trace_pool`` shares
traces). On the 70B PP10 x 128 plan (2 cores) the waiting process used to idle through most of
the solves while one worker solved two of the three in turn. No progress bar is shown while
workers run.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from kareus_fx.compose.iteration import IterationFrontier, compose_iteration
from kareus_fx.compose.pipeline import Instruction

__all__ = ["compose_iterations"]


def compose_iterations(
    options_by_name: Mapping[str, Mapping[tuple[int, Instruction], Sequence[Any]]],
    num_microbatches: int,
    *,
    processes: int,
    progress: bool = False,
    meanwhile: Callable[[], None] | None = None,
    **kwargs: Any,
) -> dict[str, IterationFrontier]:
    """:func:`compose_iteration` of each entry of ``options_by_name`` (``kwargs`` go to every
    call), in this process and up to ``processes - 1`` worker processes at once (1: all in this
    process, with ``progress``). ``meanwhile``: work for this process to do first (None: none);
    it runs once whatever ``processes`` is. The result has ``options_by_name``'s order."""
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
    # Most options first: the longest solves start first, in the workers.
    pending = deque(
        sorted(solving, key=lambda n: -sum(len(list(getattr(o, "points", o))) for o in solving[n].values()))
    )
    lock = threading.Lock()
    futures: dict[str, Future[IterationFrontier]] = {}
    here: dict[str, IterationFrontier] = {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:

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
