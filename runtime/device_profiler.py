"""The on-device profiler: measures a partition's time and energy on this process's GPU.

:class:`DeviceProfiler` (``--profiler cuda``) builds each partition type's replay once
(:mod:`~kareus_fx.runtime.partition_replay`: kernels rebuilt from the dump's op records,
:mod:`~kareus_fx.runtime.kernel_rebuild`; the collective as an SM-limited reduce,
:mod:`~kareus_fx.runtime.collective_stand_in`) and decides how each configuration is measured:

- Before each measurement the GPU cools until its temperature is within ``cooldown_tolerance_c``
  of its idle temperature (given, or read before the first measurement) or ``cooldown_timeout_s``
  passes, so a configuration is not charged for the previous one's heat. The clock goes through a
  :class:`~kareus_fx.runtime.clock_controller.ClockController`; ``close()`` restores it.
- Time: the median of CUDA-event timings of ``repeats`` executions after warm-up. On a GPU each
  configuration's execution is captured once in a CUDA graph and the graph is replayed
  (``cuda_graphs=True``, the default; profile-database kind ``cuda-graph``): issued op by op from
  Python the replay is launch-bound for partitions under a few milliseconds (an H200 ran a 40-op
  backward partition in 0.63-0.85 ms from a graph and 3.7-4.0 ms issued op by op,
  ``bench/results/gpu_h200/``), so the measured time is the GPU's time for the partition's kernels
  with no host gaps between them. A deployment whose host cannot keep ahead of its GPU runs slower
  than that. A replay that synchronises with the host is measured op by op, with a warning once
  per profiler. One replay at a time holds a CUDA graph (each graph holds a memory pool).
- Energy: Zeus's ``ZeusMonitor`` over a window of at least ``min_window_s`` (NVML's counter
  updates every ~100 ms) repeating the partition, divided by the repeats. Static energy = the
  GPU's static power (``cost_models.hardware``) x time; dynamic = total - static.

A configuration that runs out of GPU memory, or whose collective fails or times out
(``torch.distributed.DistBackendError``), raises :class:`~kareus_fx.workload.MeasurementFailedError`
with the reason: the tuner records it as failed and goes on (its replay is dropped and the cache
emptied, so the next configuration starts clean).

Without CUDA, :meth:`DeviceProfiler.measure` raises :class:`DeviceProfilerError`; the replay
itself (:func:`~kareus_fx.runtime.partition_replay.replay_partition` with ``device="cpu"``) runs on
CPU with wall-clock timing, for tests. :func:`node_tables_from_dump` and :func:`replay_key`, which
build and key the profiler's node tables, are re-exported here for its callers.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kareus_fx.cost_models.hardware import DEFAULT_GPU, gpu_spec
from kareus_fx.errors import KareusError
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.energy import open_zeus_monitor, zeus_errors
from kareus_fx.runtime.kernel_rebuild import node_tables_from_dump, replay_key
from kareus_fx.runtime.partition_replay import PartitionReplay, UncapturableReplayError, timed_runs
from kareus_fx.runtime.recorded_ops import NodeTable
from kareus_fx.workload import (
    CollectiveSpec,
    GraphName,
    Measurement,
    MeasurementFailedError,
    OpCost,
    PartitionConfig,
    PartitionType,
)

if TYPE_CHECKING:  # zeus is imported when a GPU is measured, not at import time
    from zeus.monitor.energy import ZeusMonitor

__all__ = [
    "DeviceProfiler",
    "DeviceProfilerError",
    "node_tables_from_dump",
    "replay_key",
    "wait_for_cooldown",
]


logger = logging.getLogger(__name__)


class DeviceProfilerError(KareusError, RuntimeError):
    """The on-device profiler cannot run here (no CUDA GPU, no energy counter)."""


def wait_for_cooldown(
    read_temperature_c: Callable[[], float],
    idle_temperature_c: float,
    *,
    tolerance_c: float,
    timeout_s: float,
    poll_s: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> bool:
    """Wait until the temperature is within ``tolerance_c`` of idle; False if ``timeout_s`` passed first."""
    deadline_s = monotonic() + timeout_s
    while read_temperature_c() > idle_temperature_c + tolerance_c:
        if monotonic() >= deadline_s:
            logger.warning("GPU did not cool to %.0f C within %.0f s; measuring anyway", idle_temperature_c, timeout_s)
            return False
        sleep(poll_s)
    return True


class DeviceProfiler:
    """Measures partitions on this process's CUDA GPU (``--profiler cuda``).

    ``frequency``: the controller that sets each configuration's clock (a dry-run one records
    requests and changes nothing); None leaves the clock as it is (then the measurement is at
    the card's current clock, whatever ``clock_mhz`` says; a warning says so once).
    ``node_tables``: the dump's node records per graph (:func:`node_tables_from_dump`) to replay
    recorded ops; None uses kernel proxies. ``tables_by_ops``: node tables by the
    :func:`replay_key` of the ops they replay (a partition type's ops in slot order, or a
    sequence's ops), consulted before ``node_tables[graph]``: for ops of several dumps.
    ``cuda_graphs``: replay each configuration from a CUDA graph (the default; see the module
    docstring), else op by op from Python (database kind ``cuda``, launch-bound below a few
    milliseconds). ``fused_slots``: replay each slot as one Inductor-compiled graph of its
    recorded ops (:mod:`kareus_fx.runtime.fused_replay`; database kind suffix ``-fused``), and an
    un-split sequence as one graph; not yet measured on a GPU, so off by default.
    ``idle_temperature_c``: the cooldown target (default:
    the temperature read before the first measurement). ``zeus_monitor`` / ``read_temperature_c``: injected
    for tests; by default a ``ZeusMonitor`` on ``gpu_index`` and Zeus's NVML temperature.
    """

    def __init__(
        self,
        gpu_name: str = DEFAULT_GPU,
        *,
        gpu_index: int = 0,
        frequency: ClockController | None = None,
        node_tables: Mapping[str, NodeTable] | None = None,
        tables_by_ops: Mapping[str, NodeTable] | None = None,
        min_window_s: float = 5.0,
        cuda_graphs: bool = True,
        fused_slots: bool = False,
        warmup: int = 3,
        repeats: int = 10,
        cooldown_tolerance_c: float = 3.0,
        cooldown_timeout_s: float = 120.0,
        idle_temperature_c: float | None = None,
        zeus_monitor: ZeusMonitor | None = None,
        read_temperature_c: Callable[[], float] | None = None,
    ) -> None:
        spec = gpu_spec(gpu_name)
        self.gpu_name = spec.name
        self.static_power_w = spec.static_power_w
        self.gpu_index = gpu_index
        self.frequency = frequency
        self.node_tables = node_tables or {}
        self.tables_by_ops = tables_by_ops or {}
        self.min_window_s = float(min_window_s)
        self.cuda_graphs = cuda_graphs
        self.fused_slots = fused_slots
        self.kind = "cuda" + ("-graph" if cuda_graphs else "") + ("-fused" if fused_slots else "")
        """Profile-database key of this profiler: measurements of the two replays never mix."""
        self.warmup = warmup
        self.repeats = repeats
        self.cooldown_tolerance_c = cooldown_tolerance_c
        self.cooldown_timeout_s = cooldown_timeout_s
        self._zeus = zeus_monitor
        self._read_temperature_c = read_temperature_c
        self._idle_temperature_c = idle_temperature_c
        self._replays: dict[tuple[Any, ...], PartitionReplay] = {}
        self._warned_clock = False
        self._warned_capture = False
        self._captured: PartitionReplay | None = None
        """The one replay holding a CUDA graph (each graph holds a memory pool)."""
        self.last_window_s: float | None = None
        """The energy window of the latest measurement, in seconds."""

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        """Time and energy of one partition of ``ptype`` run with ``config`` on this GPU."""
        key = (ptype.graph, ptype.type_id)

        def run() -> Measurement:
            if key not in self._replays:
                self._check_cuda()
                slots = [slot.ops for slot in ptype.slots]
                table = self._table([op for ops in slots for op in ops], ptype.graph)
                self._replays[key] = PartitionReplay.build(
                    slots, [ptype.collective], self._device(), table, fused=self.fused_slots
                )
            return self._measure(self._replays[key], config.clock_mhz, config.launch_slot, config.comm_sms)

        return self._as_configuration_failure(key, f"{ptype.type_id} at {config}", run)

    def measure_sequence(
        self,
        ops: Sequence[OpCost],
        collectives: Sequence[CollectiveSpec],
        clock_mhz: int,
        *,
        graph: GraphName | None = None,
        comm_sms: int = 16,
    ) -> Measurement:
        """``ops`` one after another, then each collective alone with ``comm_sms`` SMs (the
        simulator's default, 16), at ``clock_mhz``; the node table is ``tables_by_ops``' for these
        ops, else ``node_tables[graph]``."""
        key = ("sequence", replay_key(ops), tuple(collectives))

        def run() -> Measurement:
            if key not in self._replays:
                self._check_cuda()
                slots = [list(ops)] if self.fused_slots else [[op] for op in ops]
                self._replays[key] = PartitionReplay.build(
                    slots, list(collectives), self._device(), self._table(ops, graph), fused=self.fused_slots
                )
            return self._measure(self._replays[key], clock_mhz, None, comm_sms)

        return self._as_configuration_failure(key, f"{len(ops)} ops in sequence at {clock_mhz} MHz", run)

    def _as_configuration_failure(self, key: tuple[Any, ...], what: str, run: Callable[[], Measurement]) -> Measurement:
        """``run()``, with out-of-memory and collective failures raised as a failed configuration."""
        try:
            return run()
        except torch.cuda.OutOfMemoryError as err:
            reason = f"out of memory replaying {what}: {str(err).splitlines()[0]}"
        except torch.distributed.DistBackendError as err:
            reason = f"collective failed or timed out replaying {what}: {str(err).splitlines()[0]}"
        dropped = self._replays.pop(key, None)
        if dropped is not None and dropped is self._captured:
            self._release_capture()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise MeasurementFailedError(reason)

    def _table(self, ops: Sequence[OpCost], graph: GraphName | None) -> NodeTable | None:
        table = self.tables_by_ops.get(replay_key(ops)) if self.tables_by_ops else None
        if table is None and graph is not None:
            table = self.node_tables.get(graph)
        return table

    def close(self) -> None:
        """Release the captured CUDA graph and restore the clock (through the frequency controller)."""
        self._release_capture()
        if self.frequency is not None:
            self.frequency.restore()

    def __enter__(self) -> DeviceProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_cuda(self) -> None:
        if not torch.cuda.is_available():
            raise DeviceProfilerError(
                "--profiler cuda needs a CUDA GPU (torch.cuda.is_available() is False): run on a "
                "GPU machine, or use the simulated profiler (--profiler simulated, the default)"
            )

    def _device(self) -> torch.device:
        return torch.device("cuda", self.gpu_index)

    def _measure(self, replay: PartitionReplay, clock_mhz: int, launch_slot: int | None, comm_sms: int) -> Measurement:
        self._check_cuda()
        zeus, read_temperature_c = self._energy_sources()
        if self._idle_temperature_c is None:
            self._idle_temperature_c = float(read_temperature_c())
        wait_for_cooldown(
            read_temperature_c,
            self._idle_temperature_c,
            tolerance_c=self.cooldown_tolerance_c,
            timeout_s=self.cooldown_timeout_s,
        )
        self._set_clock(clock_mhz)
        run = self._runner(replay, launch_slot, comm_sms)
        time_s = statistics.median(timed_runs(run, replay.device, warmup=self.warmup, repeats=self.repeats))
        window = f"kareus_profile_{id(replay)}"
        with zeus_errors("read the energy counter at the measurement window's start"):
            zeus.begin_window(window)
        runs = self._fill_window(run, replay, time_s)
        with zeus_errors("read the energy counter at the measurement window's end"):
            result = zeus.end_window(window)  # synchronises CUDA before reading the counter
        self.last_window_s = float(result.time)
        energy_j = float(sum(result.gpu_energy.values())) / runs
        static_j = self.static_power_w * time_s
        return Measurement(
            time_s=time_s, energy_j=energy_j, dynamic_energy_j=energy_j - static_j, static_energy_j=static_j
        )

    def _runner(self, replay: PartitionReplay, launch_slot: int | None, comm_sms: int) -> Callable[[], None]:
        """One execution of ``replay`` as a call: its CUDA graph where ``cuda_graphs`` and the
        replay is on a GPU (the previous replay's graph released first), else the eager issue;
        a replay that synchronises with the host is measured op by op, with a warning once."""

        def issue() -> None:
            replay.issue(launch_slot, comm_sms)

        if not self.cuda_graphs or replay.device.type != "cuda":
            return issue
        if self._captured is not replay:
            self._release_capture()
        self._captured = replay
        try:
            return replay.captured(launch_slot, comm_sms)
        except UncapturableReplayError as err:
            if not self._warned_capture:
                warnings.warn(
                    f"a partition's replay could not be captured in a CUDA graph ({str(err).splitlines()[0]}): "
                    "measuring it op by op from Python, so a partition under a few milliseconds is timed "
                    "at the CPU's launch rate",
                    stacklevel=3,
                )
                self._warned_capture = True
            return issue

    def _release_capture(self) -> None:
        if self._captured is not None:
            self._captured.release_graph()
            self._captured = None

    def _fill_window(self, run: Callable[[], None], replay: PartitionReplay, time_s: float) -> int:
        """Repeat ``run`` until at least ``min_window_s`` has passed; return the repeats."""
        start_s = time.perf_counter()
        runs, elapsed_s = 0, 0.0
        while elapsed_s < self.min_window_s:
            batch = max(1, math.ceil((self.min_window_s - elapsed_s) / time_s))
            for _ in range(batch):
                run()
            replay.synchronize()
            runs += batch
            elapsed_s = time.perf_counter() - start_s
        return runs

    def _set_clock(self, clock_mhz: int) -> None:
        if self.frequency is None:
            if not self._warned_clock:
                logger.warning("no frequency controller: measuring at the GPU's current clock, not the configured one")
                self._warned_clock = True
            return
        self.frequency.request(clock_mhz, instruction="device_profiler")
        self.frequency.flush(timeout_s=30.0)

    def _energy_sources(self) -> tuple[ZeusMonitor, Callable[[], float]]:
        if self._zeus is None:
            self._zeus = open_zeus_monitor([self.gpu_index])
        if self._read_temperature_c is None:
            from zeus.device.gpu import get_gpus

            with zeus_errors("open the GPU's temperature sensor"):
                gpus, index = get_gpus(), self.gpu_index

            def read_temperature_c() -> float:
                with zeus_errors("read the GPU's temperature"):
                    return float(gpus.get_gpu_temperature(index))

            self._read_temperature_c = read_temperature_c
        if not getattr(self._zeus, "gpu_indices", [self.gpu_index]):
            raise DeviceProfilerError("ZeusMonitor sees no GPU: the on-device profiler needs NVML's energy counter")
        return self._zeus, self._read_temperature_c
