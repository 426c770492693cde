"""Replay a partition on every rank of a TP (x CP) group with the real collective, and measure it.

Used by the distributed profilers (``--profiler cpu-replay`` and ``--profiler cuda`` with more than
one process; :mod:`kareus_fx.plan.distributed_plan`). Every rank of the group calls
:meth:`GroupMeasurer.measure` with the same arguments at the same time:

- Kernels: the recorded ops replayed (or their proxies), as :mod:`~kareus_fx.runtime.kernel_rebuild`
  builds them, on this rank's device.
- The collective is the real functional collective (``torch.ops._c10d_functional``: all-reduce,
  all-gather, reduce-scatter, all-to-all of the recorded buffer size, bf16) over the rank's TP or CP
  subgroup (the one whose size the collective records), issued before the first kernel of slot
  ``launch_slot`` (after every slot when sequential) and waited for at the end. On NCCL the
  subgroup's communicator for the configuration's SM count is used (``max_ctas`` = ``min_ctas``
  = the SM count, created at startup by :meth:`GroupComms.create`); on gloo the SM count is not
  enforced (CPU threads, no SMs).
- Time: each rank times ``repeats`` executions after ``warmup`` (CUDA events on a GPU, the wall clock
  on CPU) and takes the median; the group's time is the slowest rank's (an all-reduce MAX).
- Energy (:class:`EnergyModel`): on a GPU, Zeus over a window of at least ``min_window_s`` in which
  every rank runs the same number of executions (from the group's time), per execution, summed over
  the group's GPUs; on CPU (the test device) a fixed power per rank times that rank's time, summed.
  The measurement holds the group's energy divided by the group size (one GPU's share), so the
  planner's ``tp x cp`` scaling gives the group's sum. Static energy: the GPU's static power x time.
- Clocks (GPU): each rank requests the configuration's clock from its frequency controller before
  measuring; the controller is restored when the measurer closes.

A collective that fails (a peer died, the process-group timeout ran out) raises
:class:`PeerLostError` on the ranks that see it, naming the rank, the group and the cause.
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kareus_fx.errors import KareusError, ParallelConfigError
from kareus_fx.runtime.collectives import nccl_options_for
from kareus_fx.runtime.energy import open_zeus_monitor, zeus_errors
from kareus_fx.runtime.kernel_rebuild import build_kernels
from kareus_fx.runtime.partition_replay import timed_runs
from kareus_fx.runtime.recorded_ops import NodeTable
from kareus_fx.workload import CollectiveSpec, Measurement, OpCost

if TYPE_CHECKING:
    from zeus.monitor.energy import ZeusMonitor

_BF16_BYTES = 2
TEST_DEVICE_POWER_W = 100.0
"""Power of one rank of the CPU test device (``cpu-replay``): a fixed model, not a measurement."""


_BACKEND_FAILURE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout")


def is_backend_failure(err: BaseException) -> bool:
    """Whether ``err`` comes from the communication backend (a peer died or hangs), not from a bug."""
    return isinstance(err, dist.DistError) or any(m in str(err).lower() for m in _BACKEND_FAILURE_MARKERS)


class PeerLostError(KareusError, RuntimeError):
    """A collective of a profiling group failed: a peer rank died or did not answer within the timeout."""


@dataclass
class GroupComms:
    """This rank's profiling group and its TP / CP subgroups (and, on NCCL, one per SM count)."""

    rank: int
    group_index: int
    group_ranks: tuple[int, ...]
    subgroups: dict[int, dist.ProcessGroup]
    """Subgroup by size: the TP subgroup (size tp) and the CP subgroup (size cp; TP wins a tie)."""
    backend: str
    timeout_s: float
    by_sms: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    """(subgroup size, SM count) -> NCCL communicator limited to that many CTAs."""

    @classmethod
    def create(cls, tp: int, cp: int, timeout_s: float, sm_counts: Sequence[int] = ()) -> GroupComms:
        """Split the world into groups of ``tp x cp`` consecutive ranks (collective over the world:
        every rank creates every subgroup, in the same order). ``sm_counts``: the SM counts to
        create NCCL communicators for (ignored on gloo)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        size = tp * cp
        if world % size:
            raise ParallelConfigError(
                f"world size {world} is not a multiple of the group size tp x cp = {size}: "
                f"launch a multiple of {size} processes"
            )
        backend = str(dist.get_backend())
        timeout = datetime.timedelta(seconds=timeout_s)
        mine: dict[int, dist.ProcessGroup] = {}
        by_sms: dict[tuple[int, int], dist.ProcessGroup] = {}
        blocks: list[tuple[int, list[int]]] = []
        for start in range(0, world, size):
            members = list(range(start, start + size))
            # TP: consecutive blocks of tp ranks; CP: ranks tp apart (the rank order of Megatron-LM).
            blocks += [(tp, members[i * tp : (i + 1) * tp]) for i in range(cp)]
            if cp > 1:
                blocks += [(cp, members[j::tp]) for j in range(tp)]
        for axis, ranks in blocks:
            group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                mine.setdefault(axis, group)
        if "nccl" in backend:
            for sm_count in sorted(set(sm_counts)):
                for axis, ranks in blocks:
                    group = dist.new_group(
                        ranks=ranks, backend="nccl", timeout=timeout, pg_options=nccl_options_for(sm_count)
                    )
                    if rank in ranks:
                        by_sms.setdefault((axis, sm_count), group)
        start = rank - rank % size
        return cls(rank, rank // size, tuple(range(start, start + size)), mine, backend, timeout_s, by_sms)

    @property
    def group(self) -> dist.ProcessGroup:
        """The subgroup of the larger axis (the whole group when cp == 1)."""
        return self.subgroups[max(self.subgroups)]

    def group_for(self, spec: CollectiveSpec, comm_sms: int) -> dist.ProcessGroup:
        """The communicator that runs ``spec`` with ``comm_sms`` SMs."""
        if spec.group_size not in self.subgroups:
            raise PeerLostError(
                f"a collective over {spec.group_size} ranks, but the profiling group's TP / CP "
                f"subgroups have {sorted(self.subgroups)} ranks: plan with the dump's tp and cp"
            )
        return self.by_sms.get((spec.group_size, comm_sms), self.subgroups[spec.group_size])

    def max_all(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def sum_all(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in self.backend else torch.device("cpu")
        tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
        self.guard(lambda: dist.all_reduce(tensor, op=op, group=self.group), "reducing the group's result")
        return tensor.tolist()

    def guard(self, run: Callable[[], Any], what: str) -> Any:
        """``run()``, with a backend failure raised as :class:`PeerLostError`."""
        try:
            return run()
        except (RuntimeError, dist.DistError) as err:
            if isinstance(err, KareusError) or not is_backend_failure(err):
                raise
            cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PeerLostError(
                f"rank {self.rank} (profiling group {self.group_index}, ranks {list(self.group_ranks)}): a collective "
                f"failed while {what}: a peer rank died or did not answer within the {self.timeout_s:g} s timeout "
                f"({cause}). The profile database keeps every finished measurement: restart the job to resume"
            ) from err


class RealCollective:
    """One recorded collective as the real functional collective on a buffer of its recorded size."""

    def __init__(self, spec: CollectiveSpec, comms: GroupComms, device: torch.device) -> None:
        self.spec = spec
        self.comms = comms
        g = spec.group_size
        elements = max(g, round(spec.bytes / _BF16_BYTES / g) * g)  # a multiple of the group size
        size = elements // g if spec.kind == "all_gather" else elements
        self.buffer = torch.randn(size, dtype=torch.bfloat16, device=device)

    def start(self, comm_sms: int) -> torch.Tensor:
        """Issue the collective (asynchronous); wait on the returned tensor."""
        ops, spec = torch.ops._c10d_functional, self.spec
        name = self.comms.group_for(spec, comm_sms).group_name
        g = spec.group_size
        out: torch.Tensor  # torch.ops overloads are untyped
        if spec.kind == "all_reduce":
            out = ops.all_reduce(self.buffer, "sum", name)
        elif spec.kind == "all_gather":
            out = ops.all_gather_into_tensor(self.buffer, g, name)
        elif spec.kind == "reduce_scatter":
            out = ops.reduce_scatter_tensor(self.buffer, "sum", g, name)
        else:
            split = [self.buffer.numel() // g] * g
            out = ops.all_to_all_single(self.buffer, split, split, name)
        return out


class GroupReplay:
    """Slots of kernels and the real collectives, issued at the planned slot (module docstring)."""

    def __init__(
        self,
        slots: Sequence[Sequence[OpCost]],
        collectives: Sequence[CollectiveSpec],
        comms: GroupComms,
        device: torch.device,
        table: NodeTable | None = None,
    ) -> None:
        kernels = iter(build_kernels([op for slot in slots for op in slot], device, table))
        self.slots = [[next(kernels) for _ in slot] for slot in slots]
        self.collectives = [RealCollective(spec, comms, device) for spec in collectives]
        self.device = device

    def issue(self, launch_slot: int | None, comm_sms: int) -> None:
        """One execution; returns when every collective is done (on CPU, every kernel too)."""
        launch = len(self.slots) if launch_slot is None else launch_slot
        if not 0 <= launch <= len(self.slots):
            raise ValueError(f"launch_slot {launch_slot} outside the partition's {len(self.slots)} slots")
        pending: list[torch.Tensor] = []
        for index in range(len(self.slots) + 1):
            if index == launch:
                pending = [c.start(comm_sms) for c in self.collectives]
            for kernel in self.slots[index] if index < len(self.slots) else ():
                kernel.run()
        for tensor in pending:
            torch.ops._c10d_functional.wait_tensor(tensor)

    def times_s(self, launch_slot: int | None, comm_sms: int, warmup: int, repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` executions after ``warmup`` (CUDA events, else the wall clock)."""
        return timed_runs(lambda: self.issue(launch_slot, comm_sms), self.device, warmup=warmup, repeats=repeats)


class EnergyModel:
    """Where a rank's energy comes from: Zeus on its GPU, or the test device's fixed power."""

    def __init__(
        self,
        static_power_w: float,
        gpu_index: int | None = None,
        min_window_s: float = 5.0,
        zeus_monitor: ZeusMonitor | None = None,
    ) -> None:
        self.static_power_w = static_power_w
        self.gpu_index = gpu_index
        self.min_window_s = min_window_s
        self._zeus = zeus_monitor

    @property
    def test_device(self) -> bool:
        return self.gpu_index is None

    def energy_j(
        self, replay: GroupReplay, launch_slot: int | None, comm_sms: int, rank_time_s: float, group_time_s: float
    ) -> float:
        """This rank's energy of one execution (every rank of the group calls it together)."""
        if self.gpu_index is None:  # the test device
            return TEST_DEVICE_POWER_W * rank_time_s
        if self._zeus is None:
            self._zeus = open_zeus_monitor([self.gpu_index])
        runs = max(1, math.ceil(self.min_window_s / group_time_s))  # the same on every rank
        window = f"kareus_group_{id(replay)}"
        with zeus_errors("read the energy counter at the measurement window's start"):
            self._zeus.begin_window(window)
        for _ in range(runs):
            replay.issue(launch_slot, comm_sms)
        with zeus_errors("read the energy counter at the measurement window's end"):
            result = self._zeus.end_window(window)
        return float(sum(result.gpu_energy.values())) / runs


class GroupMeasurer:
    """Measures replays with the group (module docstring); ``set_clock(clock_mhz)`` locks a clock (GPU)."""

    def __init__(
        self,
        comms: GroupComms,
        energy: EnergyModel,
        device: torch.device,
        *,
        warmup: int = 1,
        repeats: int = 3,
        set_clock: Callable[[int], None] | None = None,
        before_measure: Callable[[], None] | None = None,
    ) -> None:
        self.comms = comms
        self.energy = energy
        self.device = device
        self.warmup = warmup
        self.repeats = repeats
        self.set_clock = set_clock
        self.before_measure = before_measure
        """Called before each measurement on every rank (a cooldown), then the group synchronises."""

    def measure(self, replay: GroupReplay, clock_mhz: int, launch_slot: int | None, comm_sms: int) -> Measurement:
        if self.before_measure is not None:
            self.before_measure()
        if self.set_clock is not None:
            self.set_clock(clock_mhz)
        self.comms.guard(lambda: dist.barrier(group=self.comms.group), "waiting for the group")

        def run() -> tuple[float, float]:
            rank_time_s = statistics.median(replay.times_s(launch_slot, comm_sms, self.warmup, self.repeats))
            (group_time_s,) = self.comms.max_all([rank_time_s])
            return group_time_s, self.energy.energy_j(replay, launch_slot, comm_sms, rank_time_s, group_time_s)

        group_time_s, rank_energy_j = self.comms.guard(run, "replaying a partition")
        (group_energy_j,) = self.comms.sum_all([rank_energy_j])
        energy_j = group_energy_j / len(self.comms.group_ranks)
        static_j = self.energy.static_power_w * group_time_s
        return Measurement(
            time_s=group_time_s, energy_j=energy_j, dynamic_energy_j=energy_j - static_j, static_energy_j=static_j
        )
