"""Tune several partition types at once: one process per type, one progress bar per type.

``tune_partition_types`` runs :func:`~kareus_fx.tuner.mbo.tune_partition` (or the exhaustive
search) for each type in a ``ProcessPoolExecutor`` with the ``spawn`` start method (safe with
threads, torch and CUDA in the parent). ``workers=1`` runs everything in this process.

Profilers are not shipped between processes: each worker builds its own from
``profiler_factory``, a picklable zero-argument callable (a module-level function, a class, or a
``functools.partial`` of one), e.g. ``partial(CachedProfiler, ...)`` over the SQLite profile
database. Everything measured goes through that profiler, and every type's run is seeded from
``seed`` and the type id alone (not from the order or the worker it lands on), so a killed run
re-run with the same database re-issues the same configurations and finds them cached.

Progress: workers send ``(type_id, measured, planned)`` through a ``multiprocessing.Manager``
queue; the parent drains it into a ``rich.progress`` bar per type. When the type finishes its bar
is completed (a run that converges early measures fewer than planned).
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kareus_fx.tuner.mbo import MBOSettings, TuningResult, exhaustive_search, tune_partition
from kareus_fx.workload import PartitionType, Profiler, SequenceProfiler

if TYPE_CHECKING:
    from kareus_fx.cost_models.profile_db import CachedProfiler

ProfilerFactory = Callable[[], Profiler]


@dataclass(frozen=True)
class CachedProfilerFactory:
    """Picklable factory of a ``CachedProfiler`` over the profile database at ``db_path``.

    ``inner`` builds the profiler that measures what the database does not have yet (itself a
    picklable factory, e.g. ``functools.partial(SimulatedProfiler, "A100", 0.01, 0)``); ``kind``
    overrides the database key of the inner profiler (default: its ``kind`` or class name);
    ``log_path``: a :class:`~kareus_fx.cost_models.profile_queue.ProfileQueue` file that logs every
    measurement made, under ``run`` (None: no log).
    """

    db_path: str
    inner: Callable[[], SequenceProfiler]
    kind: str | None = None
    log_path: str | None = None
    run: str = ""

    def __call__(self) -> CachedProfiler:
        from kareus_fx.cost_models.profile_db import CachedProfiler, ProfileDB
        from kareus_fx.cost_models.profile_queue import ProfileQueue

        log = None if self.log_path is None else ProfileQueue(self.log_path)
        return CachedProfiler(self.inner(), ProfileDB(self.db_path), kind=self.kind, log=log, run=self.run)


def type_seed(seed: int, type_id: str) -> int:
    """The seed a type is tuned with: independent of which other types are tuned, and of order."""
    return (seed * 1_000_003 + zlib.crc32(type_id.encode())) % (2**32)


def _tune_one(
    ptype: PartitionType,
    profiler_factory: ProfilerFactory,
    settings: MBOSettings,
    seed: int,
    exhaustive: bool,
    updates: object | None,
) -> TuningResult:
    profiler = profiler_factory()

    def report(done: int, planned: int) -> None:
        if updates is not None:
            updates.put((ptype.type_id, done, planned))  # type: ignore[attr-defined]

    try:
        if exhaustive:
            return exhaustive_search(ptype, profiler, settings=settings, progress=report)
        return tune_partition(ptype, profiler, settings=settings, seed=seed, progress=report)
    finally:
        # close what the factory opened (a CachedProfiler's database connection)
        for obj in (profiler, getattr(profiler, "db", None), getattr(profiler, "log", None)):
            close = getattr(obj, "close", None)
            if callable(close):
                close()


def tune_partition_types(
    ptypes: Sequence[PartitionType],
    profiler_factory: ProfilerFactory,
    *,
    settings: MBOSettings | None = None,
    seed: int = 0,
    workers: int = 1,
    exhaustive: bool = False,
    progress: bool = True,
) -> dict[str, TuningResult]:
    """Tune every partition type; results keyed by ``type_id`` in the order of ``ptypes``.

    ``workers`` processes run at once (1: in this process). ``exhaustive=True`` measures every
    configuration instead of running MBO. ``progress=False`` hides the bars.
    """
    settings = settings or MBOSettings()
    ids = [p.type_id for p in ptypes]
    if len(set(ids)) != len(ids):
        raise ValueError(f"partition type ids must be unique, got {ids}")
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    results: dict[str, TuningResult] = {}
    with Progress(*columns, disable=not progress, transient=False) as bar:
        tasks = {p.type_id: bar.add_task(p.type_id, total=None) for p in ptypes}

        def update(type_id: str, done: int, planned: int) -> None:
            bar.update(tasks[type_id], completed=done, total=planned)

        def finish(result: TuningResult) -> None:
            n = result.stats.measured
            bar.update(tasks[result.type_id], completed=n, total=n)
            results[result.type_id] = result

        if workers <= 1 or len(ptypes) <= 1:
            direct = _DirectUpdates(update)
            for p in ptypes:
                run_seed = type_seed(seed, p.type_id)
                finish(_tune_one(p, profiler_factory, settings, run_seed, exhaustive, direct))
        else:
            ctx = mp.get_context("spawn")
            with (
                ctx.Manager() as manager,
                ProcessPoolExecutor(max_workers=min(workers, len(ptypes)), mp_context=ctx) as pool,
            ):
                updates = manager.Queue()
                pending: set[Future] = {
                    pool.submit(
                        _tune_one,
                        p,
                        profiler_factory,
                        settings,
                        type_seed(seed, p.type_id),
                        exhaustive,
                        updates,
                    )
                    for p in ptypes
                }
                while pending:
                    done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                    _drain(updates, update)
                    for fut in done:
                        finish(fut.result())
                _drain(updates, update)
                for r in results.values():
                    bar.update(tasks[r.type_id], completed=r.stats.measured, total=r.stats.measured)
    return {tid: results[tid] for tid in ids}


class _DirectUpdates:
    """The in-process stand-in for the manager queue: ``put`` updates the bar at once."""

    def __init__(self, update: Callable[[str, int, int], None]) -> None:
        self._update = update

    def put(self, item: tuple[str, int, int]) -> None:
        self._update(*item)


def _drain(updates: object, update: Callable[[str, int, int], None]) -> None:
    while True:
        try:
            type_id, done, planned = updates.get_nowait()  # type: ignore[attr-defined]
        except queue_mod.Empty:
            return
        update(type_id, done, planned)
