"""``kareus plan`` over torch.distributed: every TP (x CP) group of the world profiles at once.

Run under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), or
with ``--nproc N`` (:mod:`kareus_fx.plan.launcher` starts N such processes on this machine). The
profilers: ``cpu-replay`` (gloo, CPU: the test device) and ``cuda`` (NCCL, one GPU per process).

1. Rank 0 traces the stages (in full: the replays need the recorded ops) before joining the process
   group (tracing runs under its own fake group; the others wait in the rendezvous), then
   broadcasts them.
2. The world is split into groups of ``tp x cp`` consecutive ranks (:class:`GroupComms`); group ``g``'s
   leader is its first rank. Every rank builds the same catalog of what can be measured: the plan's
   partition types (by plan id) and its sequences (un-split microbatches, work outside partitions).
3. Rank 0 is the coordinator: it runs the planner (tuning, baselines, composition) with a
   :class:`QueueProfiler`. What the profile database lacks goes into the shared work queue
   (:mod:`kareus_fx.cost_models.profile_queue`) as (partition type or sequence, configuration)
   items, a whole tuning batch at once (``prefetch``); the coordinator then serves the queue with
   its own group until every item it waits for is done.
4. Every other group's leader claims items, measures each with its group (:class:`GroupMeasurer`,
   every member replaying with the real collective), stores the measurement in the profile
   database and the measurement log, and marks it done. Followers (the other ranks of a group)
   replay each item their leader has claimed, in claim order.
5. The coordinator closes the queue when the plan is made; every rank leaves, and only rank 0
   writes the plan.

Failures: a collective that fails raises :class:`PeerLostError` on the ranks that see it; they mark
their item failed (so does any other error of a replay), which stops the coordinator with that
reason. Workers stop with
:class:`PeerLostError` when the coordinator's heartbeat is older than ``peer_timeout_s``, and the
coordinator when an item stays claimed longer than ``peer_timeout_s`` plus the measurement's
allowance. A killed job resumes from the profile database: nothing measured is measured again.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kareus_fx.cost_models.hardware import canonical_gpu_name, gpu_spec
from kareus_fx.cost_models.profile_db import ProfileDB, fingerprint, measurement_key, structure_of
from kareus_fx.cost_models.profile_queue import ProfileQueue
from kareus_fx.cost_models.sim_params import gpu_params
from kareus_fx.errors import OptionsError, ParallelConfigError
from kareus_fx.plan.planner import PlanOutcome, plan_traced
from kareus_fx.plan.profilers import QUEUE_FILE, distinct_types, replay_tables
from kareus_fx.plan.profiling_cost import sequence_fingerprint
from kareus_fx.plan.request import PlanRequest, validate_plan_request
from kareus_fx.plan.stage_tracing import StageGraphs, trace_plan_stages
from kareus_fx.runtime.group_replay import EnergyModel, GroupComms, GroupMeasurer, GroupReplay, PeerLostError
from kareus_fx.workload import (
    CollectiveSpec,
    Measurement,
    MeasurementFailedError,
    OpCost,
    PartitionConfig,
    PartitionType,
)

__all__ = [
    "DEFAULT_PEER_TIMEOUT_S",
    "Catalog",
    "GroupWorker",
    "QueueProfiler",
    "QueueServer",
    "Session",
    "distributed_env",
    "make_plan_distributed",
    "serve_or_coordinate",
]

DEFAULT_PEER_TIMEOUT_S = 300.0
"""How long a profiling group waits for a peer (a collective, the coordinator's heartbeat)."""
TRACE_TIMEOUT_S = 3600.0
"""The world group's timeout: the other ranks wait in it while rank 0 traces."""
TEST_DEVICE_STATIC_W = 40.0
"""Static power of one rank of the CPU test device (of its fixed 100 W, ``group_replay``)."""
T = TypeVar("T")
_POLL_S = 0.02
_BEAT_S = 1.0


@dataclass(frozen=True)
class Session:
    """This process's place in the profiling world."""

    rank: int
    world_size: int
    local_rank: int
    comms: GroupComms
    run: str
    peer_timeout_s: float

    @property
    def groups(self) -> int:
        return self.world_size // len(self.comms.group_ranks)

    @property
    def leader(self) -> bool:
        return self.rank == self.comms.group_ranks[0]


class Catalog:
    """What can be measured, on every rank alike: partition types by plan id, sequences by fingerprint."""

    def __init__(
        self,
        kind: str,
        gpu: str,
        ptypes: Mapping[str, PartitionType],
        sequences: Mapping[str, tuple[tuple[OpCost, ...], tuple[CollectiveSpec, ...]]],
        sequence_sms: int,
    ) -> None:
        self.kind = kind
        self.gpu = gpu
        self.ptypes = dict(ptypes)
        self.sequences = dict(sequences)
        """(ops, collectives) by :func:`sequence_fingerprint`."""
        self.sequence_sms = sequence_sms
        """The SM count of a sequence's collectives (the simulator's default)."""
        self._tid = {fingerprint(p): tid for tid, p in self.ptypes.items()}

    @classmethod
    def from_plan(cls, req: PlanRequest, traced: Sequence[StageGraphs]) -> Catalog:
        """The partition types and sequences ``plan_traced`` measures for ``req``."""
        gpu = canonical_gpu_name(req.gpu)
        ptypes, _ = distinct_types(traced, req.launch_search)
        sequences = {}
        for stage in traced:
            for graph in [*stage.sequential.values(), *(g.outside for g in (stage.partitioned or {}).values())]:
                sequences[sequence_fingerprint(graph.ops, graph.collectives)] = (graph.ops, graph.collectives)
        return cls(req.profiler, gpu, ptypes, sequences, gpu_params(gpu).params.default_comm_sms)

    def partition(self, ptype: PartitionType, config: PartitionConfig) -> tuple[str, PartitionConfig, dict[str, Any]]:
        """(fingerprint, configuration, queue payload) of a partition measurement."""
        fp = fingerprint(ptype)
        if fp not in self._tid:
            raise OptionsError(f"partition type {ptype.type_id} is not one of the plan's types")
        return (
            fp,
            config,
            {
                "fp": fp,
                "clock": config.clock_mhz,
                "sms": config.comm_sms,
                "slot": config.launch_slot,
                "library": config.comm_library,
            },
        )

    def sequence(
        self, ops: Sequence[OpCost], collectives: Sequence[CollectiveSpec], clock_mhz: int
    ) -> tuple[str, PartitionConfig, dict[str, Any]]:
        fp = sequence_fingerprint(ops, collectives)
        if fp not in self.sequences:
            raise OptionsError("a sequence that is not one of the plan's graphs was asked for")
        config = PartitionConfig(clock_mhz, self.sequence_sms, None, "nccl")
        return fp, config, {"fp": fp, "clock": clock_mhz, "sms": self.sequence_sms, "slot": None, "library": "nccl"}

    def key(self, fp: str, config: PartitionConfig) -> str:
        return measurement_key(self.kind, self.gpu, fp, config)

    def describe(self, fp: str) -> tuple[str, Any]:
        """(type id, structure) stored beside a measurement in the profile database."""
        if fp in self._tid:
            tid = self._tid[fp]
            return tid, structure_of(self.ptypes[tid])
        ops, collectives = self.sequences[fp]
        return "sequence", {
            "ops": [[op.target, float(op.flops), float(op.bytes)] for op in ops],
            "collectives": [[c.kind, float(c.bytes), int(c.group_size), int(c.fused)] for c in collectives],
        }


class GroupWorker:
    """Replays catalog items with this rank's group (every member calls :meth:`measure` together)."""

    def __init__(
        self, catalog: Catalog, session: Session, measurer: GroupMeasurer, tables: Mapping[str, Any] | None = None
    ) -> None:
        self.catalog = catalog
        self.session = session
        self.measurer = measurer
        self.tables = tables or {}
        self._replays: dict[str, GroupReplay] = {}

    def measure(self, payload: Mapping[str, Any]) -> Measurement:
        fp = payload["fp"]
        replay = self._replays.get(fp)
        if replay is None:
            from kareus_fx.runtime.device_profiler import replay_key

            if fp in self.catalog.sequences:
                ops, collectives = self.catalog.sequences[fp]
                slots: list[Sequence[OpCost]] = [[op] for op in ops]
            else:
                ptype = self.catalog.ptypes[self.catalog.describe(fp)[0]]
                slots, collectives = [slot.ops for slot in ptype.slots], (ptype.collective,)
            table = self.tables.get(replay_key(op for slot in slots for op in slot))
            replay = self._replays[fp] = GroupReplay(
                slots, collectives, self.session.comms, self.measurer.device, table
            )
        return self.measurer.measure(replay, int(payload["clock"]), payload["slot"], int(payload["sms"]))


class QueueServer:
    """A group leader's and a follower's side of the queue (module docstring, steps 4 and 5)."""

    def __init__(self, session: Session, worker: GroupWorker, db: ProfileDB, queue: ProfileQueue) -> None:
        self.session = session
        self.worker = worker
        self.db = db
        self.queue = queue
        self._started_s = time.monotonic()

    def serve_one(self) -> bool:
        """Leader: claim, measure with the group, store one item; False when none is pending."""
        s = self.session
        item = self.queue.claim(s.run, s.comms.group_index)
        if item is None:
            return False
        measurement = self._measure(item.key, item.payload)
        fp = item.payload["fp"]
        config = PartitionConfig(
            int(item.payload["clock"]),
            int(item.payload["sms"]),
            item.payload["slot"],
            item.payload.get("library", "mscclpp"),  # queued before the field: the old meaning
        )
        type_id, structure = self.worker.catalog.describe(fp)
        _, inserted = self.db.insert(
            self.worker.catalog.kind, self.worker.catalog.gpu, fp, type_id, structure, config, measurement
        )
        self.queue.log(item.key, s.run, s.rank, inserted)
        self.queue.finish(s.run, item.key)
        return True

    def _measure(self, key: str, payload: Mapping[str, Any]) -> Measurement:
        try:
            return self.worker.measure(payload)
        except Exception as err:  # the coordinator stops with the reason instead of waiting for a timeout
            self.queue.finish(self.session.run, key, "failed", f"rank {self.session.rank}: {type(err).__name__}: {err}")
            raise

    def serve(self) -> None:
        """Leader or follower of a group other than the coordinator's (follower of its group too):
        work until the coordinator closes the queue."""
        done: set[str] = set()
        self._started_s = time.monotonic()
        while True:
            if self.session.leader:
                if self.serve_one():
                    continue
            else:
                waiting = [
                    item
                    for item in self.queue.claimed_by(self.session.run, self.session.comms.group_index)
                    if item.key not in done
                ]
                if waiting:
                    done.add(waiting[0].key)
                    self._measure(waiting[0].key, waiting[0].payload)
                    continue
            if self._coordinator_closed():
                return
            time.sleep(_POLL_S)

    def _coordinator_closed(self) -> bool:
        beat = self.queue.heartbeat(self.session.run)
        if beat is None:  # the coordinator has not started the run yet
            waited_s = time.monotonic() - self._started_s
            if waited_s > self.session.peer_timeout_s:
                raise PeerLostError(
                    f"rank {self.session.rank}: the coordinator (rank 0) did not start the run within "
                    f"{self.session.peer_timeout_s:g} s: it died or hangs"
                )
            return False
        age_s, closed = beat
        if closed:
            return True
        if age_s > self.session.peer_timeout_s:
            raise PeerLostError(
                f"rank {self.session.rank}: the coordinator (rank 0) has not been heard from for "
                f"{age_s:.0f} s (timeout {self.session.peer_timeout_s:g} s): it died or hangs; restart "
                f"the job to resume from the profile database"
            )
        return False


class QueueProfiler:
    """The coordinator's profiler: answers from the profile database, queues what it lacks and
    serves the queue with its own group until those items are done (module docstring, step 3)."""

    def __init__(self, catalog: Catalog, server: QueueServer, measurement_allowance_s: float) -> None:
        self.catalog = catalog
        self.server = server
        self.gpu_name = catalog.gpu
        self.kind = catalog.kind
        self.allowance_s = measurement_allowance_s

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        return self._get(*self.catalog.partition(ptype, config))

    def measure_sequence(
        self, ops: Sequence[OpCost], collectives: Sequence[CollectiveSpec], clock_mhz: int, **_: Any
    ) -> Measurement:
        return self._get(*self.catalog.sequence(ops, collectives, clock_mhz))

    def prefetch(
        self,
        partitions: Sequence[tuple[PartitionType, PartitionConfig]] = (),
        sequences: Sequence[tuple[Sequence[OpCost], Sequence[CollectiveSpec], int]] = (),
    ) -> None:
        """Measure a batch at once, spread over every group."""
        wanted = [self.catalog.partition(p, c) for p, c in partitions]
        wanted += [self.catalog.sequence(o, c, clock) for o, c, clock in sequences]
        self._run(
            {self.catalog.key(fp, config): payload for fp, config, payload in wanted if self._missing(fp, config)}
        )

    def _missing(self, fp: str, config: PartitionConfig) -> bool:
        """Neither a measurement nor a failure is stored for this key."""
        db = self.server.db
        return (
            db.get(self.kind, self.gpu_name, fp, config) is None
            and db.get_failure(self.kind, self.gpu_name, fp, config) is None
        )

    def _stored(self, fp: str, config: PartitionConfig) -> Measurement | None:
        """The stored measurement (None: not measured); a stored failure raises it again."""
        db = self.server.db
        stored = db.get(self.kind, self.gpu_name, fp, config)
        if stored is None:
            reason = db.get_failure(self.kind, self.gpu_name, fp, config)
            if reason is not None:
                raise MeasurementFailedError(reason)
        return stored

    def _get(self, fp: str, config: PartitionConfig, payload: dict[str, Any]) -> Measurement:
        stored = self._stored(fp, config)
        if stored is None:
            self._run({self.catalog.key(fp, config): payload})
            stored = self._stored(fp, config)
        assert stored is not None, "a done item has its measurement stored"
        return stored

    def _run(self, items: Mapping[str, dict[str, Any]]) -> None:
        if not items:
            return
        server, run = self.server, self.server.session.run
        server.queue.add(run, dict(items))
        keys = list(items)
        while True:
            if server.serve_one():
                continue
            state = server.queue.items(run, keys)
            failed = [item for item in state.values() if item.status == "failed"]
            if failed:
                raise PeerLostError(
                    f"profiling group {failed[0].group_index} could not measure {failed[0].key}: {failed[0].reason}"
                )
            if all(item.status == "done" for item in state.values()):
                return
            self._check_stale(state.values())
            time.sleep(_POLL_S)

    def _check_stale(self, items: Any) -> None:
        limit_s = self.server.session.peer_timeout_s + self.allowance_s
        for item in items:
            claimed = (
                self.server.queue.claimed_since_s(self.server.session.run, item.key)
                if item.status == "claimed"
                else None
            )
            if claimed is not None and claimed > limit_s:
                raise PeerLostError(
                    f"profiling group {item.group_index} claimed {item.key} {claimed:.0f} s ago and "
                    f"has not finished it (limit {limit_s:.0f} s): its ranks died or hang"
                )


# ----- the session ---------------------------------------------------------------------------------
def distributed_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's variables, or None outside a launcher."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise OptionsError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (torchrun sets them)") from None
    if not 0 <= rank < world:
        raise OptionsError(f"RANK {rank} outside WORLD_SIZE {world}")
    return rank, world, local


def _search_sm_counts(catalog: Catalog, req: PlanRequest) -> list[int]:
    from kareus_fx.tuner.mbo import MBOSettings

    settings, spec = MBOSettings(clock_stride_mhz=req.clock_stride_mhz), gpu_spec(catalog.gpu)
    counts = {catalog.sequence_sms}
    for ptype in catalog.ptypes.values():
        counts.update(settings.space_for(ptype, spec).comm_sms)
    return sorted(counts)


@contextlib.contextmanager
def _session(req: PlanRequest, peer_timeout_s: float) -> Iterator[tuple[int, int, int, str]]:
    env = distributed_env()
    rank, world, local = env if env is not None else (0, 1, 0)
    if world % (req.tp * req.cp):
        raise ParallelConfigError(
            f"{world} processes cannot form groups of tp x cp = {req.tp * req.cp} ranks: "
            f"launch a multiple of {req.tp * req.cp} processes (--nproc or torchrun --nproc-per-node)"
        )
    backend = "gloo" if req.profiler == "cpu-replay" else "nccl"
    if backend == "nccl":
        torch.cuda.set_device(local)
    timeout = datetime.timedelta(seconds=TRACE_TIMEOUT_S)
    if env is None:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    try:
        run = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(run, src=0)
        yield rank, world, local, str(run[0])
    finally:
        dist.destroy_process_group()


def make_plan_distributed(
    req: PlanRequest, work_dir: str | Path, *, progress: bool = True, peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
) -> PlanOutcome | None:
    """Plan ``req`` with every process of the world profiling (module docstring); the plan on rank
    0, None on the others. ``work_dir`` (shared by every rank) keeps the dumps, the profile database
    and the queue."""
    validate_plan_request(req)
    if req.profiler not in ("cpu-replay", "cuda"):
        raise OptionsError(f"--nproc and torchrun plan with --profiler cpu-replay or cuda, not {req.profiler}")
    if not peer_timeout_s > 0:
        raise OptionsError(f"--peer-timeout must be a positive number of seconds, got {peer_timeout_s}")
    work = Path(work_dir)
    started = time.perf_counter()
    traced_box: list[Any] = [None]
    env = distributed_env()
    if env is None or env[0] == 0:  # before the process group: tracing runs under its own fake group
        work.mkdir(parents=True, exist_ok=True)
        traced_box[0] = trace_plan_stages(req, work / "dumps")  # the request with its split resolved
    trace_s = time.perf_counter() - started
    with _session(req, peer_timeout_s) as (rank, world, local, run):
        dist.broadcast_object_list(traced_box, src=0)
        req, traced = traced_box[0]
        catalog = Catalog.from_plan(req, traced)
        comms = GroupComms.create(req.tp, req.cp, peer_timeout_s, _search_sm_counts(catalog, req))
        session = Session(rank, world, local, comms, run, peer_timeout_s)

        def coordinate(profiler: QueueProfiler) -> PlanOutcome:
            outcome = plan_traced(
                req,
                traced,
                work,
                progress=progress,
                profiler=profiler,
                groups=session.groups,
                device=_device_label(req, session),
            )
            outcome.wall_s = {"trace_s": trace_s, **outcome.wall_s, "total_s": time.perf_counter() - started}
            outcome.data["wall_s"] = outcome.wall_s
            return outcome

        with _measurer(req, session) as measurer:
            worker = GroupWorker(catalog, session, measurer, replay_tables(traced))
            outcome = serve_or_coordinate(session, worker, work, coordinate, _allowance_s(req))
        comms.guard(dist.barrier, "waiting for every rank to finish")  # no rank tears down while a peer is busy
    return outcome


def serve_or_coordinate(
    session: Session, worker: GroupWorker, work: Path, coordinate: Callable[[QueueProfiler], T], allowance_s: float
) -> T | None:
    """Rank 0: ``coordinate(profiler)`` (with a heartbeat), then close the queue; every other rank:
    serve the queue until it is closed (module docstring, steps 3-5). The profile database and the
    queue are ``work``'s."""
    with ProfileDB(work / "profile.sqlite") as db, ProfileQueue(work / QUEUE_FILE) as queue:
        server = QueueServer(session, worker, db, queue)
        if session.rank != 0:
            server.serve()
            return None
        queue.start_run(session.run, session.rank)
        try:
            with _heartbeat(work / QUEUE_FILE, session.run, session.rank):
                return coordinate(QueueProfiler(worker.catalog, server, allowance_s))
        finally:
            queue.beat(session.run, session.rank, closed=True)  # after the heartbeat thread stopped


def _allowance_s(req: PlanRequest) -> float:
    """Seconds one measurement may take beyond the peer timeout (window, cooldown, replay set-up)."""
    return 60.0 if req.profiler == "cpu-replay" else req.device_window_s + 180.0


def _device_label(req: PlanRequest, session: Session) -> str:
    size = len(session.comms.group_ranks)
    if req.profiler == "cpu-replay":
        return (
            f"test device: {session.world_size} CPU processes in {session.groups} group(s) of {size} over gloo; "
            f"wall-clock time, energy from a fixed power model, not a GPU"
        )
    return f"{session.world_size} {canonical_gpu_name(req.gpu)} GPUs in {session.groups} group(s) of {size} over NCCL"


@contextlib.contextmanager
def _measurer(req: PlanRequest, session: Session) -> Iterator[GroupMeasurer]:
    """The group measurer of ``req.profiler``; on a GPU the clock controller is always restored."""
    if req.profiler == "cpu-replay":
        yield GroupMeasurer(session.comms, EnergyModel(TEST_DEVICE_STATIC_W), torch.device("cpu"))
        return
    from zeus.device import get_gpus

    from kareus_fx.runtime.clock_backends import parse_clock_mode
    from kareus_fx.runtime.clock_controller import ClockController
    from kareus_fx.runtime.device_profiler import wait_for_cooldown

    spec = gpu_spec(canonical_gpu_name(req.gpu))
    index = session.local_rank
    controller = ClockController.open(parse_clock_mode(req.clock_mode or "real"), gpu_index=index)
    try:
        gpus = get_gpus()
        idle_c = float(gpus.get_gpu_temperature(index))  # before the first measurement heats the GPU

        def cool_down() -> None:
            wait_for_cooldown(lambda: float(gpus.get_gpu_temperature(index)), idle_c, tolerance_c=3.0, timeout_s=120.0)

        def set_clock(clock_mhz: int) -> None:
            controller.request(clock_mhz, instruction="group_profiler")
            controller.flush(timeout_s=30.0)

        yield GroupMeasurer(
            session.comms,
            EnergyModel(spec.static_power_w, index, req.device_window_s),
            torch.device("cuda", index),
            warmup=3,
            repeats=10,
            set_clock=set_clock,
            before_measure=cool_down,
        )
    finally:
        controller.restore()  # always: a failed or killed-peer run leaves no GPU at a locked clock


@contextlib.contextmanager
def _heartbeat(path: Path, run: str, rank: int) -> Iterator[None]:
    """Beat every second from a thread (own connection) while the coordinator plans."""
    stop = threading.Event()

    def beat() -> None:
        with ProfileQueue(path) as queue:
            while not stop.wait(_BEAT_S):
                queue.beat(run, rank)

    thread = threading.Thread(target=beat, name="kareus-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
