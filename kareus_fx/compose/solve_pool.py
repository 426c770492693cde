"""Several iteration frontiers at once: one solve per process.

``kareus plan`` composes one iteration frontier per method over the same pipeline; the solves
are independent and each runs in one thread (lowtime's solver steps one after another), so on a
machine with more than one core they can run side by side. Workers start with the ``spawn``
method (safe with threads, torch and CUDA in the parent, like the tuner's); each gets its
options pickled and returns its :class:`IterationFrontier` pickled, equal to what
:func:`compose_iteration` returns in this process (the solver is deterministic).

Starting a worker (importing numpy, networkx and lowtime) takes about a second, so a caller asks
for processes only where the solves take longer (see ``kareus_fx.plan.planner``). Solves whose
every (stage, instruction) has one option take no solver step; they run here while the workers
work. No progress bar is shown while workers run.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
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
    **kwargs: Any,
) -> dict[str, IterationFrontier]:
    """:func:`compose_iteration` of each entry of ``options_by_name`` (``kwargs`` go to every
    call), in up to ``processes`` worker processes (1: all in this process, with ``progress``).
    The result has ``options_by_name``'s order."""
    solving = {
        name: options
        for name, options in options_by_name.items()
        if any(len(list(getattr(o, "points", o))) > 1 for o in options.values())
    }
    if processes <= 1 or len(solving) <= 1:
        return {
            name: compose_iteration(options, num_microbatches, progress=progress, **kwargs)
            for name, options in options_by_name.items()
        }
    # Most options first: the longest solves start first.
    largest_first = sorted(solving, key=lambda n: -sum(len(list(getattr(o, "points", o))) for o in solving[n].values()))
    with ProcessPoolExecutor(max_workers=min(processes, len(solving)), mp_context=mp.get_context("spawn")) as pool:
        futures = {
            name: pool.submit(compose_iteration, solving[name], num_microbatches, **kwargs) for name in largest_first
        }
        here = {
            name: compose_iteration(options, num_microbatches, **kwargs)
            for name, options in options_by_name.items()
            if name not in solving
        }
        done = {name: future.result() for name, future in futures.items()}
    return {name: here[name] if name in here else done[name] for name in options_by_name}
