"""A partition's kernels issued in the plan's order, and timed.

:class:`PartitionReplay` holds a partition's slots of kernels (one per recorded op,
:mod:`~kareus_fx.runtime.kernel_rebuild`) and its collectives' stand-ins
(:mod:`~kareus_fx.runtime.collective_stand_in`). With ``fused=True`` and node records
(:mod:`kareus_fx.runtime.fused_replay`) each slot is instead one Inductor-compiled graph of its
recorded ops with their dataflow, as the deployment runs them; a slot that cannot be rebuilt or
compiled is replayed op by op (warning).

The stand-ins are issued on a side stream before the first kernel of slot ``launch_slot`` (the
stream-schedule pass' convention), after every slot when sequential; the main stream waits for
them at the end. Timing: CUDA events around each execution after warm-up, ``perf_counter`` on CPU
(where kernels run synchronously: :func:`replay_partition` with ``device="cpu"`` runs in tests).
On a GPU an execution can be captured once per configuration in a CUDA graph and replayed
(:meth:`PartitionReplay.captured`), so that what is timed is the GPU's time for the kernels with no
host gaps between them; a replay with an op that synchronises with the host (found by a warm-up
under CUDA's sync debug mode, before any capture) cannot be captured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kareus_fx.runtime.collective_stand_in import CollectiveKernel, build_collective_kernel
from kareus_fx.runtime.fused_replay import fused_slot_kernel
from kareus_fx.runtime.kernel_rebuild import Kernel, build_kernels
from kareus_fx.runtime.recorded_ops import NodeTable
from kareus_fx.workload import CollectiveSpec, OpCost, PartitionConfig, PartitionType

logger = logging.getLogger(__name__)


class UncapturableReplayError(RuntimeError):
    """A replay synchronises with the host, so it cannot be captured in a CUDA graph."""


def _fused_or_per_op(ops: Sequence[OpCost], table: NodeTable, device: torch.device) -> list[Kernel]:
    """The slot as one fused kernel (compiled here, by its first run), or one kernel per op where
    the slot's graph cannot be rebuilt or compiled (a warning names why)."""
    if not ops:
        return []
    try:
        run, _, _ = fused_slot_kernel(ops, table, device)
        run()
    except Exception as err:  # noqa: BLE001 -- any rebuild or Inductor failure: measure op by op
        logger.warning(
            "slot of %d ops (from %s) not fused (%s): replaying it op by op",
            len(ops),
            ops[0].name if ops else "-",
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        return build_kernels(ops, device, table)
    return [Kernel(f"fused[{ops[0].name}..{ops[-1].name}]", "inductor", "fused", run)]


def timed_runs(run: Callable[[], None], device: torch.device, *, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run`` after ``warmup``: CUDA events on a GPU,
    ``perf_counter`` on CPU (where kernels run synchronously)."""
    for _ in range(warmup):
        run()
    if device.type != "cuda":
        times_s = []
        for _ in range(repeats):
            start_s = time.perf_counter()
            run()
            times_s.append(time.perf_counter() - start_s)
        return times_s
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1000.0 for start, end in events]


@dataclass
class PartitionReplay:
    """A partition's kernels, ready to issue: slots of kernels, then the collectives' proxies."""

    slots: list[list[Kernel]]
    collectives: list[CollectiveKernel]
    device: torch.device
    launch_log: list[str] | None = None
    """When a list, each issued kernel's label is appended (``slot{i}:{name}``, ``collective{j}``)."""
    _side_stream: torch.cuda.Stream | None = None
    _graph: torch.cuda.CUDAGraph | None = None
    _graph_config: tuple[int | None, int] | None = None

    @classmethod
    def build(
        cls,
        slots: Sequence[Sequence[OpCost]],
        collectives: Sequence[CollectiveSpec],
        device: torch.device | str,
        table: NodeTable | None = None,
        *,
        fused: bool = False,
    ) -> PartitionReplay:
        """``fused``: each slot one Inductor-compiled graph of its recorded ops
        (:mod:`kareus_fx.runtime.fused_replay`; needs ``table``), a slot that cannot be fused
        replayed op by op with a warning; else one kernel per op."""
        device = torch.device(device)
        if fused and table is not None:
            built = [_fused_or_per_op(slot, table, device) for slot in slots]
        else:
            kernels = iter(build_kernels([op for slot in slots for op in slot], device, table))
            built = [[next(kernels) for _ in slot] for slot in slots]
        return cls(
            slots=built,
            collectives=[build_collective_kernel(spec, device) for spec in collectives],
            device=device,
            _side_stream=torch.cuda.Stream(device) if device.type == "cuda" else None,
        )

    def issue(self, launch_slot: int | None, comm_sms: int) -> None:
        """Enqueue one execution: the collectives before slot ``launch_slot`` (None: after all)."""
        launch = len(self.slots) if launch_slot is None else launch_slot
        if not 0 <= launch <= len(self.slots):
            raise ValueError(f"launch_slot {launch_slot} outside the partition's {len(self.slots)} slots")
        done = None
        for index in range(len(self.slots) + 1):
            if index == launch:
                done = self._issue_collectives(comm_sms)
            for kernel in self.slots[index] if index < len(self.slots) else ():
                self._log(f"slot{index}:{kernel.name}")
                kernel.run()
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def _issue_collectives(self, comm_sms: int) -> torch.cuda.Event | None:
        if self._side_stream is None:
            for index, collective in enumerate(self.collectives):
                self._log(f"collective{index}")
                collective.run(comm_sms)
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self._side_stream.wait_event(ready)
        with torch.cuda.stream(self._side_stream):
            for index, collective in enumerate(self.collectives):
                self._log(f"collective{index}")
                collective.run(comm_sms)
        done = torch.cuda.Event()
        done.record(self._side_stream)
        return done

    def captured(self, launch_slot: int | None, comm_sms: int) -> Callable[[], None]:
        """One execution as a call that replays a CUDA graph of it (GPU only), captured on the first
        call for this configuration; a capture of another configuration is released first (each
        holds a private memory pool of one execution's tensors).

        Raises :class:`UncapturableReplayError` before any capture where an op synchronises with
        the host (a value read back, a data-dependent shape): the last warm-up runs under
        ``torch.cuda.set_sync_debug_mode("error")``. A capture that fails is not retried: it
        leaves the CUDA generator's capture state set, so random tensors fail afterwards."""
        if self.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs a CUDA replay, this one is on {self.device}")
        if self._graph is None or self._graph_config != (launch_slot, comm_sms):
            self.release_graph()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up off the capture stream (lazy inits, Triton's compile)
                for _ in range(2):
                    self.issue(launch_slot, comm_sms)
                previous_mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    self.issue(launch_slot, comm_sms)
                except RuntimeError as err:
                    raise UncapturableReplayError(str(err).splitlines()[0]) from err
                finally:
                    torch.cuda.set_sync_debug_mode(previous_mode)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.issue(launch_slot, comm_sms)
            self._graph, self._graph_config = graph, (launch_slot, comm_sms)
        return self._graph.replay

    def release_graph(self) -> None:
        """Free the captured CUDA graph and its memory pool (no-op without one)."""
        self._graph, self._graph_config = None, None

    def synchronize(self) -> None:
        """Wait for every issued kernel (kernels run synchronously on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _log(self, label: str) -> None:
        if self.launch_log is not None:
            self.launch_log.append(label)

    def time_s(self, launch_slot: int | None, comm_sms: int, *, warmup: int, repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` executions after ``warmup``: CUDA events on a GPU,
        ``perf_counter`` on CPU (where kernels run synchronously)."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        return timed_runs(lambda: self.issue(launch_slot, comm_sms), self.device, warmup=warmup, repeats=repeats)


def replay_partition(
    ptype: PartitionType,
    config: PartitionConfig,
    *,
    device: torch.device | str = "cpu",
    table: NodeTable | None = None,
    warmup: int = 1,
    repeats: int = 3,
    launch_log: list[str] | None = None,
) -> list[float]:
    """Seconds of ``repeats`` executions of ``ptype`` under ``config`` (no energy, no clock change).

    ``table``: the node records of ``ptype.graph`` (from :func:`node_tables_from_dump`) to
    replay the recorded ops; None uses kernel proxies. ``launch_log`` receives the launch order.
    """
    replay = PartitionReplay.build([slot.ops for slot in ptype.slots], [ptype.collective], device, table)
    replay.launch_log = launch_log
    return replay.time_s(config.launch_slot, config.comm_sms, warmup=warmup, repeats=repeats)
