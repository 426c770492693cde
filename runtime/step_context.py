"""Which pipeline instruction runs next, and the clock the plan gives it.

A plan gives one SM clock per (stage, instruction, microbatch) (Perseus-style, paper 5.1):
:class:`ClockSchedule` holds that lookup. A :class:`StepContext` is told at every instruction
boundary which instruction runs next (:meth:`StepContext.next_instruction`, or the
module-level :func:`next_instruction` while the context is active) and asks its
:class:`~kareus_fx.runtime.clock_controller.ClockController` for that instruction's clock. It
works from a plain training loop::

    with StepContext(schedule, controller, stage=0) as steps:
        for mb, batch in enumerate(microbatches):
            with steps.step("forward", mb):
                loss = model(batch)
            with steps.step("backward", mb):
                loss.backward()

and from a pipeline schedule, which calls ``next_instruction("forward", mb)`` before each
action it runs. The clock-switch ops that the codegen puts into the graphs read the active
context through :func:`active_step_context` / :func:`current_clock_mhz`: a torch.library op
cannot take a Python object as an argument, and the backward graph may run on an autograd
worker thread, so the active context is one module-level slot, not a context variable. One
context is active per process (one process drives one GPU).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType

from kareus_fx.compose.pipeline_schedule import INSTRUCTIONS, Instruction, PipelineNode
from kareus_fx.errors import KareusError
from kareus_fx.runtime.clock_controller import ClockController


class ClockScheduleError(KareusError, ValueError):
    """A clock schedule that does not cover an instruction, or holds an invalid entry."""


def _pipeline_node(stage: int, instruction: str, microbatch: int) -> PipelineNode:
    if instruction not in INSTRUCTIONS:
        raise ClockScheduleError(f"instruction must be one of {', '.join(INSTRUCTIONS)}, got {instruction!r}")
    for name, value in (("stage", stage), ("microbatch", microbatch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ClockScheduleError(f"{name} must be a non-negative integer, got {value!r}")
    return PipelineNode(stage, instruction, microbatch)


class ClockSchedule:
    """The plan's clock of every (stage, instruction, microbatch).

    ``requests_clocks=False`` (a plan made without frequency scaling): the schedule still names
    each instruction's clock (the maximum), but a :class:`StepContext` requests none of them, so
    a process that may not lock clocks runs the plan's kernel schedule at the card's own clock."""

    def __init__(self, clocks_mhz: Mapping[PipelineNode, int], *, requests_clocks: bool = True) -> None:
        self.requests_clocks = requests_clocks
        checked: dict[PipelineNode, int] = {}
        for key, clock_mhz in clocks_mhz.items():
            if not isinstance(key, PipelineNode):
                raise ClockScheduleError(f"schedule keys must be PipelineNode, got {key!r}")
            node = _pipeline_node(key.stage, key.instruction, key.microbatch)
            if isinstance(clock_mhz, bool) or not isinstance(clock_mhz, int) or clock_mhz <= 0:
                raise ClockScheduleError(f"clock of {node} must be a positive integer number of MHz, got {clock_mhz!r}")
            checked[node] = clock_mhz
        self._clocks_mhz = checked

    @classmethod
    def from_entries(
        cls, entries: Iterable[tuple[int, str, int, int]], *, requests_clocks: bool = True
    ) -> ClockSchedule:
        """From (stage, instruction, microbatch, clock_mhz) rows; a repeated key is an error."""
        clocks_mhz: dict[PipelineNode, int] = {}
        for stage, instruction, microbatch, clock_mhz in entries:
            node = _pipeline_node(stage, instruction, microbatch)
            if node in clocks_mhz:
                raise ClockScheduleError(f"the schedule lists {node} twice")
            clocks_mhz[node] = clock_mhz
        return cls(clocks_mhz, requests_clocks=requests_clocks)

    def __len__(self) -> int:
        return len(self._clocks_mhz)

    def clock_mhz(self, node: PipelineNode) -> int:
        """The planned clock of ``node``."""
        try:
            return self._clocks_mhz[node]
        except KeyError:
            stages = sorted({n.stage for n in self._clocks_mhz})
            microbatches = sorted({n.microbatch for n in self._clocks_mhz})
            raise ClockScheduleError(
                f"the clock schedule has no clock for {node}; it covers stages {stages} and "
                f"microbatches {microbatches}: was the plan made for another pipeline layout?"
            ) from None


_active_lock = threading.Lock()
_active: StepContext | None = None


class StepContext:
    """Tracks the running instruction of one pipeline stage and requests its planned clock.

    ``controller`` may be None (no clock switching, e.g. a CPU run); the schedule is still
    checked, so a plan that misses an instruction fails at its first boundary.
    """

    def __init__(
        self,
        schedule: ClockSchedule,
        controller: ClockController | None = None,
        stage: int = 0,
    ) -> None:
        self.schedule = schedule
        self.controller = controller
        self.stage = stage
        self.current: PipelineNode | None = None

    def next_instruction(self, instruction: Instruction, microbatch: int, stage: int | None = None) -> PipelineNode:
        """Mark ``instruction`` of ``microbatch`` as running next; request its clock."""
        node = _pipeline_node(self.stage if stage is None else stage, instruction, microbatch)
        clock_mhz = self.schedule.clock_mhz(node)
        self.current = node
        if self.controller is not None and self.schedule.requests_clocks:
            self.controller.request(clock_mhz, instruction=str(node))
        return node

    def current_clock_mhz(self) -> int | None:
        """The planned clock of the running instruction; None between instructions."""
        return None if self.current is None else self.schedule.clock_mhz(self.current)

    @contextmanager
    def step(self, instruction: Instruction, microbatch: int, stage: int | None = None) -> Iterator[PipelineNode]:
        """Run the body as ``instruction`` of ``microbatch``; no instruction runs after it."""
        node = self.next_instruction(instruction, microbatch, stage)
        try:
            yield node
        finally:
            self.current = None

    def __enter__(self) -> StepContext:
        global _active
        with _active_lock:
            if _active is not None:
                raise KareusError(
                    "another StepContext is already active in this process; leave its `with` "
                    "block first (one process drives one pipeline stage)"
                )
            _active = self
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _active
        with _active_lock:
            if _active is self:
                _active = None
        self.current = None


def active_step_context() -> StepContext | None:
    """The StepContext whose ``with`` block is running, if any."""
    return _active


def next_instruction(instruction: Instruction, microbatch: int, stage: int | None = None) -> PipelineNode:
    """:meth:`StepContext.next_instruction` on the active context (for pipeline schedules)."""
    context = _active
    if context is None:
        raise KareusError(
            "next_instruction() needs an active StepContext: wrap the training loop in "
            "`with StepContext(schedule, controller, stage=...)`"
        )
    return context.next_instruction(instruction, microbatch, stage)


def current_clock_mhz() -> int | None:
    """The planned clock of the active context's running instruction (None if none runs)."""
    context = _active
    return None if context is None else context.current_clock_mhz()
