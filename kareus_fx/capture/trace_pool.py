"""Independent traces at once: this process and ``processes - 1`` worker processes share them.

The planner traces each distinct pipeline stage as two slices (``plan/layer_slice.py``); each
trace (:func:`~kareus_fx.capture.tracing.trace_both_splits`) runs on one core, in a fresh Dynamo,
under its own ``fake`` process group, and writes its dumps to its own directories, so the traces
are independent. :func:`run_calls` runs them side by side and returns what each returns (the
dump paths: files on disk, never tensors), in the calls' order.

Workers start by ``fork`` where that is safe, else by ``spawn`` (:func:`start_method`). A spawned
worker imports torch and the backend first: 3.9 s of CPU on the 2-core machine (then 0.4 s more
for its first trace), against a slice trace's 3-5 s; under load, where the cores are busy anyway,
that made the parallel trace slower than the serial one (qwen3-1.7b-tp8-mbs8-seq4k: 49 s against
30-36 s, load 4-6 of 2 cores), while a forked worker added no CPU time (33 s). A forked worker
also starts with this process's state (torch, Dynamo and backend settings), as the serial path
traces. Each trace resets Dynamo and sets up its own ``fake`` process group, so what this process
compiled before does not reach it. This process does not wait idle for its workers: it takes
calls from the back, one at a time, and each worker, once started (it has imported the calls'
modules), from the front, until none is left.

Errors: a call that raises in a worker raises the same exception type with the same message here
(``concurrent.futures`` pickles it back). Every call runs; the first failing one in the calls'
order is raised, the one a serial run raises. A worker that dies (killed, out of memory, a crash
in C++) fails its call with :class:`TraceWorkerError`, naming it; this process runs the calls
left, and nothing waits on the dead worker.
``processes <= 1`` or a single call runs everything here, one after another.

Garbage collection: the calls run with this process's heap frozen (``kareus_fx.capture.gc_freeze``; a forked
worker inherits that), so a trace's collections do not walk torch's and the planner's objects.

Warnings: a worker records the warnings its call issues (those its filters let through: this
process's when forked) and this process issues them again
(their category, text and place) once its calls are done, each distinct one once over the
workers, so a pass that falls back and warns once is seen here, under this process's warning
filters, not on a worker's stderr once per worker (one that this process's own calls issued too
may show twice). A call that raises in a worker loses its warnings; its error says what went
wrong.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import threading
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from kareus_fx.capture.gc_freeze import heap_frozen
from kareus_fx.errors import KareusError

__all__ = ["TraceWorkerError", "run_calls", "start_method"]

T = TypeVar("T")


class TraceWorkerError(KareusError, RuntimeError):
    """A trace worker process exited before returning its result."""


def run_calls(calls: Sequence[Callable[[], T]], processes: int) -> list[T]:
    """``[call() for call in calls]``, in this process and up to ``processes - 1`` worker
    processes at once (see the module docstring). ``calls`` must pickle (module-level functions,
    ``functools.partial`` of them); each result must pickle too."""
    _no_tqdm_monitor()
    with heap_frozen():  # this process's heap, out of every process's collections (kareus_fx.capture.gc_freeze)
        return _run_calls(calls, processes)


def _run_calls(calls: Sequence[Callable[[], T]], processes: int) -> list[T]:
    workers = min(processes, len(calls)) - 1
    if workers < 1:
        return [call() for call in calls]
    pending = deque(range(len(calls)))
    lock = threading.Lock()
    futures: dict[int, Future[_Recorded[T]]] = {}
    here: dict[int, T | Exception] = {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(start_method())) as pool:

        def feed(_: object = None) -> None:
            """Give a worker the front call (also a done callback: the worker that finished is free)."""
            with lock:
                if not pending:
                    return
                index = pending.popleft()
                try:
                    futures[index] = pool.submit(_recording_warnings, calls[index])
                except BrokenProcessPool:  # a worker died: this process takes the rest
                    pending.appendleft(index)
                    return
            futures[index].add_done_callback(feed)

        modules = tuple(sorted({getattr(getattr(call, "func", call), "__module__", __name__) for call in calls}))
        for _ in range(workers):  # a worker takes calls once it has imported theirs (or failed to)
            pool.submit(_import, modules).add_done_callback(feed)
        while True:
            with lock:
                if not pending:
                    break
                index = pending.pop()
            try:
                here[index] = calls[index]()
            except Exception as err:  # noqa: BLE001 - raised below, in the calls' order, as a serial run would
                here[index] = err
        results = [_result(index, here, futures, calls) for index in range(len(calls))]
    registry: dict = {}  # one registry for every worker: a warning they share is issued once
    for recorded in results:
        for warning in recorded.warnings:
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno, registry=registry
            )
    return [recorded.value for recorded in results]


def _no_tqdm_monitor() -> None:
    """Keep tqdm from starting its monitor thread in this process.

    torch.fx's ``Interpreter.run`` opens a tqdm bar (disabled or not) on every run, so this
    process's own traces start tqdm's monitor thread, which then lives on: with it
    :func:`start_method` chose ``spawn`` for every later pool, and a second plan in one process
    traced slower (Llama-3.2-3B TP8 mbs8 4K: 17.3 s against 14.0 s for the first). tqdm's own
    switch, ``monitor_interval = 0``, keeps the thread from starting (it only refreshes bars that
    stall); a monitor already running (the caller's bars) is left alone, and then workers spawn.
    """
    try:
        from tqdm import tqdm
    except ImportError:  # torch.hub's fallback bar starts no thread
        return
    tqdm.monitor_interval = 0


def start_method() -> str:
    """``fork`` where the calling thread is this process's only Python thread and CUDA is not
    initialised, else ``spawn``. A fork copies every lock as it is, and another thread may hold
    one (the child would wait on it forever); a forked child cannot use CUDA once the parent has.
    (torch's own ``DataLoader`` forks its workers on Linux by default; native thread pools, such as
    torch's and OpenBLAS's, reset themselves in the child.) Workers of a process that cannot fork
    cost one import of torch and the backend each (module docstring)."""
    if threading.active_count() == 1 and not torch.cuda.is_initialized() and "fork" in mp.get_all_start_methods():
        return "fork"
    return "spawn"


@dataclass(frozen=True)
class _Warning:
    """A warning a worker's call issued: what :func:`warnings.warn_explicit` needs to issue it again."""

    message: str
    category: type[Warning]
    filename: str
    lineno: int


@dataclass(frozen=True)
class _Recorded(Generic[T]):
    """What a call returned, and the warnings it issued in a worker (none for a call run here)."""

    value: T
    warnings: tuple[_Warning, ...] = ()


def _recording_warnings(call: Callable[[], T]) -> _Recorded[T]:
    """``call()`` in a worker, with the warnings it issues recorded instead of printed there: those
    its filters (this process's when forked, the defaults and ``-W`` when spawned) let through."""
    with warnings.catch_warnings(record=True) as issued:  # under the filters this worker inherited
        value = call()
    return _Recorded(value, tuple(_Warning(str(w.message), w.category, w.filename, w.lineno) for w in issued))


def _result(
    index: int,
    here: dict[int, T | Exception],
    futures: dict[int, Future[_Recorded[T]]],
    calls: Sequence[Callable[[], T]],
) -> _Recorded[T]:
    if index in here:
        outcome = here[index]
        if isinstance(outcome, Exception):
            raise outcome
        return _Recorded(outcome)
    try:
        return futures[index].result()
    except BrokenProcessPool as err:
        raise TraceWorkerError(
            f"the worker process running {_describe(calls[index])} exited before returning "
            f"(killed, or crashed: out of memory?): {err}"
        ) from err


def _import(modules: tuple[str, ...]) -> None:
    """Import ``modules`` in a worker (torch and the backend: most of a worker's start)."""
    for name in modules:
        importlib.import_module(name)


def _describe(call: Callable[[], object]) -> str:
    """``call`` as a reader knows it: the function and its arguments."""
    args = getattr(call, "args", ())
    name = getattr(getattr(call, "func", call), "__name__", repr(call))
    return f"{name}({', '.join(map(repr, args))})" if args else name
