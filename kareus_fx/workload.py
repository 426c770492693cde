"""The vocabulary shared by the partition pass, the cost models, the tuner and the composer.

A *partition* (paper section 4.2) is one (possibly fused) collective of one nanobatch plus the
longest contiguous run of the other nanobatch's computation that does not depend on it. Its
computation is a sequence of *launch slots*: one compute-bound op, or a group of short
consecutive memory-bound ops. Partitions with the same structure share a :class:`PartitionType`.

A :class:`PartitionConfig` is one point of the search space (clock, SMs for the collective,
launch slot or sequential); a :class:`Measurement` is what a profiler reports for it.
Units are in the field names; bytes are HBM bytes moved (reads + writes) unless stated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kareus_fx.errors import KareusError

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
GraphName = Literal["forward", "backward"]


@dataclass(frozen=True)
class OpCost:
    """One aten op's work: FLOPs and HBM bytes (from fake-tensor metadata).

    ``bound`` is the graph analysis' label against the planning GPU ("compute" | "memory"),
    None when unknown (hand-built workloads). ``kernel`` is the id of the (Inductor) kernel the
    op is fused into, unique within its graph (``passes/kernel_groups.py``); ``flops`` and
    ``bytes`` are then the op's share of that kernel's. None: the op is its own kernel.
    """

    name: str
    target: str
    flops: float
    bytes: float
    bound: str | None = None
    kernel: str | None = None


def fused_kernels(ops: Sequence[OpCost]) -> tuple[OpCost, ...]:
    """The kernels ``ops`` run as: consecutive ops of one kernel become one ``OpCost`` (the first
    op's name and target, the summed FLOPs and bytes); an op without a kernel id stays itself."""
    kernels: list[OpCost] = []
    first: OpCost | None = None  # the current kernel's first op, its sums so far and whether it grew
    flops = nbytes = 0.0
    grew = False
    for op in ops:
        if first is not None and op.kernel is not None and first.kernel == op.kernel:
            flops, nbytes, grew = flops + op.flops, nbytes + op.bytes, True
            continue
        if first is not None:
            kernels.append(dataclasses.replace(first, flops=flops, bytes=nbytes) if grew else first)
        first, flops, nbytes, grew = op, op.flops, op.bytes, False
    if first is not None:
        kernels.append(dataclasses.replace(first, flops=flops, bytes=nbytes) if grew else first)
    return tuple(kernels)


@dataclass(frozen=True)
class SlotSpec:
    """One logical launch slot: a compute-bound op, or consecutive short memory-bound ops."""

    ops: tuple[OpCost, ...]

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

    @property
    def bytes(self) -> float:
        return sum(op.bytes for op in self.ops)

    @property
    def bound(self) -> str | None:
        """ "compute" if the slot holds a compute-bound op, "memory" if only memory-bound ones."""
        labels = {op.bound for op in self.ops}
        if "compute" in labels:
            return "compute"
        return "memory" if labels == {"memory"} else None


@dataclass(frozen=True)
class CollectiveSpec:
    """One (possibly fused) collective.

    ``bytes`` is the size of one rank's full-size buffer: the input of an all-reduce,
    reduce-scatter or all-to-all, the output of an all-gather. ``fused`` counts the collectives
    merged into this one (for example the K and V all-gathers of context parallelism).
    """

    kind: CollectiveKind
    bytes: float
    group_size: int
    fused: int = 1


@dataclass(frozen=True)
class PartitionType:
    """The structure shared by partitions of one type, and how many of them a microbatch has."""

    type_id: str
    graph: GraphName
    slots: tuple[SlotSpec, ...]
    collective: CollectiveSpec
    count: int
    launch_slots: tuple[int, ...]
    """Indices into ``slots`` at which the collective may start (appendix C excludes the rest)."""


CommLibrary = Literal["nccl", "mscclpp"]
"""The collective library a partition's collective runs with (paper section 5): ``"nccl"`` for the
baselines and for Kareus's collectives outside tuned partitions (NCCL's default channels, or a CTA
limit), ``"mscclpp"`` for Kareus's tuned, SM-limited collectives. The two price differently (NCCL's
measured curve of bandwidth against CTAs; the MSCCL++ kernel's calibrated one) and are measured
apart (the profile database keys them)."""
COMM_LIBRARIES: tuple[CommLibrary, ...] = ("nccl", "mscclpp")


@dataclass(frozen=True)
class PartitionConfig:
    """One schedule of a partition. ``launch_slot=None`` means sequential execution.

    ``comm_library`` defaults to ``"mscclpp"``: a configuration of Kareus's search space. The
    baselines' schedules (default SMs, NCCL) name ``"nccl"``."""

    clock_mhz: int
    comm_sms: int
    launch_slot: int | None
    comm_library: CommLibrary = "mscclpp"

    @property
    def sequential(self) -> bool:
        return self.launch_slot is None


@dataclass(frozen=True)
class Measurement:
    """Time and energy of one execution; ``energy_j = dynamic_energy_j + static_energy_j``."""

    time_s: float
    energy_j: float
    dynamic_energy_j: float
    static_energy_j: float

    def plus(self, part: Measurement, times: int = 1) -> Measurement:
        """This execution followed by ``times`` runs of ``part``."""
        return Measurement(
            self.time_s + times * part.time_s,
            self.energy_j + times * part.energy_j,
            self.dynamic_energy_j + times * part.dynamic_energy_j,
            self.static_energy_j + times * part.static_energy_j,
        )

    def with_link_wait(self, wait_s: float, blocking_power_w: float) -> Measurement:
        """This execution followed by a link wait of ``wait_s`` at the blocking power (static:
        the GPU waits, it computes nothing)."""
        wait_j = blocking_power_w * wait_s
        return Measurement(
            self.time_s + wait_s, self.energy_j + wait_j, self.dynamic_energy_j, self.static_energy_j + wait_j
        )


class MeasurementFailedError(KareusError, RuntimeError):
    """One configuration cannot run (out of memory, a collective timed out): a failed
    configuration with its ``reason``, not a broken run. Tuners record it and go on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Profiler(Protocol):
    """Measures partitions: the simulated GPU or the on-device profiler."""

    gpu_name: str

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        """Time and energy of one partition of type ``ptype`` run with ``config``; raises
        :class:`MeasurementFailedError` for a configuration that cannot run."""
        ...


class SequenceProfiler(Profiler, Protocol):
    """A profiler that also measures work run op after op (outside partitions, un-split graphs)."""

    def measure_sequence(
        self, ops: Sequence[OpCost], collectives: Sequence[CollectiveSpec], clock_mhz: int
    ) -> Measurement:
        """Time and energy of ``ops`` one after another, then each collective alone (default SM
        count), at ``clock_mhz``."""
        ...
