"""The schedule's hooks as torch.library ops with side effects (namespace ``kareus``).

The codegen pass (``passes/stream_schedule.py``) puts these ops into the aten forward and
backward graphs, where a user printing ``gm.code`` sees them:

- ``kareus::clock_hook(stage, instruction)``: first op of a graph, i.e. at the microbatch
  boundary. Requests the plan's clock for the running (stage, instruction, microbatch) from the
  frequency controller the deployment was given; does nothing when none was given, or when a
  :class:`~kareus_fx.runtime.step_context.StepContext` is running an instruction (its
  ``next_instruction`` already requested that clock).
- ``kareus::comm_launch(tag, comm_sms, launch_slot, inputs)``: right before a partition's
  collective(s), i.e. after the planned launch slot's predecessor. Records event ``tag`` on the
  compute stream, makes the comm stream wait on it and issues what follows on the comm stream.
- ``kareus::comm_issued(tag, outputs)``: right after the collective(s): records event
  ``tag/issued`` on the comm stream and returns to the compute stream.
- ``kareus::comm_wait(tag, outputs)``: right before the first ``wait_tensor`` of the
  collective(s) (their first use): the compute stream waits on ``tag/issued``.

On a CUDA tensor the stream work goes through :class:`~kareus_fx.runtime.streams.CudaStreamTable`
(and tensors crossing streams are ``record_stream``-ed for the consumer stream); on CPU through
the :class:`~kareus_fx.runtime.streams.NullStreamTable`, which does nothing but check the order
(a wait on an event never recorded is an error). ``launch_slot`` is -1 for a sequential
partition. NCCL itself runs a collective on its internal stream, ordered after the stream that
issues it: issuing from the comm stream, after the event, is what makes the launch wait for the
slot's predecessor and nothing later.

Side effects: every op is registered as an ordered effect
(``torch.library._register_effectful_op``), so ``Graph.eliminate_dead_code`` keeps it
(``torch.fx.Node.is_impure``) and re-tracing (``make_fx``, functionalisation) keeps it in order.

Runtime state: which (stage, instruction, microbatch) runs is one module-level slot set by the
deployment's dispatcher before it runs a graph (a torch.library op cannot take a Python object;
the backward may run on an autograd worker thread). One process drives one GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch._library.effects import EffectType

from kareus_fx.compose.pipeline_schedule import PipelineNode
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.step_context import ClockSchedule, active_step_context
from kareus_fx.runtime.streams import CudaStreamTable, StreamName, StreamTable, make_stream_table

SEQUENTIAL_LAUNCH_SLOT = -1
"""``launch_slot`` argument of ``comm_launch`` for a partition that runs sequentially."""


@dataclass(frozen=True)
class ClockBinding:
    """The controller the clock hooks request from, and the plan's clock of every instruction."""

    controller: ClockController
    schedule: ClockSchedule


@dataclass
class HookRuntime:
    """What the hooks act on: the running instruction, its clock binding, the stream tables."""

    running: PipelineNode | None = None
    clock: ClockBinding | None = None
    tables: dict[torch.device, StreamTable] = field(default_factory=dict)
    comm_regions: dict[str, contextlib.ExitStack] = field(default_factory=dict)
    collective: str | None = None
    """The tag of the partition whose collective was last launched or awaited (names a failure)."""
    log: list[tuple[object, ...]] | None = None
    """When a list (see :func:`recording_hooks`), every hook call appends (op name, args)."""

    def table_for(self, tensors: list[Tensor]) -> StreamTable:
        device = next((t.device for t in tensors if t.is_cuda), torch.device("cpu"))
        table = self.tables.get(device)
        if table is None:
            table = self.tables[device] = make_stream_table(device)
        return table


RUNTIME = HookRuntime()


def set_running(node: PipelineNode | None, clock: ClockBinding | None) -> None:
    """Mark ``node`` as the instruction whose graph runs next (the dispatcher calls this)."""
    RUNTIME.running = node
    RUNTIME.clock = clock
    RUNTIME.collective = None


@contextlib.contextmanager
def recording_hooks() -> Iterator[list[tuple[object, ...]]]:
    """Record every hook call in the block; yields the list (for tests and debugging)."""
    previous, RUNTIME.log = RUNTIME.log, []
    try:
        yield RUNTIME.log
    finally:
        RUNTIME.log = previous


def _log(*entry: object) -> None:
    if RUNTIME.log is not None:
        RUNTIME.log.append(entry)


def _record_streams(table: StreamTable, tensors: list[Tensor], stream: StreamName) -> None:
    """Keep ``tensors`` alive for ``stream``'s pending work (CUDA caching allocator)."""
    if isinstance(table, CudaStreamTable):
        for tensor in tensors:
            tensor.record_stream(table.streams[stream])


@torch.library.custom_op("kareus::clock_hook", mutates_args=())
def clock_hook(stage: int, instruction: str) -> None:
    """Microbatch boundary: request the plan's clock of the running instruction."""
    _log("clock_hook", stage, instruction)
    running, binding = RUNTIME.running, RUNTIME.clock
    if binding is None or running is None or (running.stage, running.instruction) != (stage, instruction):
        return  # no controller, or the graph runs outside the deployment's dispatcher
    context = active_step_context()
    if context is not None and context.current is not None:
        return  # the StepContext requested this instruction's clock at next_instruction()
    binding.controller.request(binding.schedule.clock_mhz(running), instruction=str(running))


@torch.library.custom_op("kareus::comm_launch", mutates_args=())
def comm_launch(tag: str, comm_sms: int, launch_slot: int, inputs: list[Tensor]) -> None:
    """Launch point of a partition's collective: order it after the slot's predecessor."""
    _log("comm_launch", tag, comm_sms, launch_slot)
    RUNTIME.collective = tag
    table = RUNTIME.table_for(inputs)
    table.record(tag, "compute")
    table.wait(tag, "comm")
    _record_streams(table, inputs, "comm")
    region = contextlib.ExitStack()
    region.enter_context(table.use("comm"))
    RUNTIME.comm_regions[tag] = region


@torch.library.custom_op("kareus::comm_issued", mutates_args=())
def comm_issued(tag: str, outputs: list[Tensor]) -> None:
    """The collective(s) are issued: record their event, go back to the compute stream."""
    _log("comm_issued", tag)
    table = RUNTIME.table_for(outputs)
    table.record(f"{tag}/issued", "comm")
    region = RUNTIME.comm_regions.pop(tag, None)
    if region is not None:
        region.close()


@torch.library.custom_op("kareus::comm_wait", mutates_args=())
def comm_wait(tag: str, outputs: list[Tensor]) -> None:
    """First use of the collective's result: the compute stream waits for the comm stream."""
    _log("comm_wait", tag)
    RUNTIME.collective = tag
    table = RUNTIME.table_for(outputs)
    table.wait(f"{tag}/issued", "compute")
    _record_streams(table, outputs, "compute")


for _op in (clock_hook, comm_launch, comm_issued, comm_wait):
    _op.register_fake(lambda *args: None)
    torch.library._register_effectful_op(_op._qualname, EffectType.ORDERED)

CLOCK_HOOK = torch.ops.kareus.clock_hook.default
COMM_LAUNCH = torch.ops.kareus.comm_launch.default
COMM_ISSUED = torch.ops.kareus.comm_issued.default
COMM_WAIT = torch.ops.kareus.comm_wait.default
HOOK_OPS = (CLOCK_HOOK, COMM_LAUNCH, COMM_ISSUED, COMM_WAIT)
