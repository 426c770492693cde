"""Which microbatch of a pipeline stage runs a compiled graph's call.

The running microbatch comes from the active :class:`~kareus_fx.runtime.step_context.StepContext`
when it runs this instruction (a pipeline schedule's hook, or a loop that calls
``next_instruction``); otherwise from a count of the graph's forward (backward) calls modulo the
plan's microbatches, which assumes a plain training loop running forward and backward of each
microbatch in order.
"""

from __future__ import annotations

from kareus_fx.compose.pipeline_schedule import INSTRUCTIONS, PipelineNode
from kareus_fx.deploy.plan_checks import PlanMismatchError
from kareus_fx.runtime.step_context import active_step_context

__all__ = ["MicrobatchCursor"]


class MicrobatchCursor:
    """Which microbatch of this stage runs an instruction (step 3 of :mod:`kareus_fx.deploy.deployment`)."""

    def __init__(self, stage: int, microbatches: int, *, per_block: bool = False) -> None:
        self.stage = stage
        self.microbatches = microbatches
        self.per_block = per_block
        """The graph is one block of the stage (a ``--compile-unit block`` plan): it runs once per
        layer in every instruction, so counting its calls does not give the microbatch."""
        self._calls: dict[str, int] = dict.fromkeys(INSTRUCTIONS, 0)

    def next(self, instruction: str) -> PipelineNode:
        """The instruction that runs now; a counted one advances the count."""
        node = self.peek(instruction)
        if not self._from_hook(instruction):
            self._calls[instruction] += 1
        return node

    def peek(self, instruction: str) -> PipelineNode:
        """The instruction :meth:`next` would return, without counting it."""
        context = active_step_context()
        current = None if context is None else context.current
        if current is not None and current.instruction == instruction:  # what _from_hook checks
            if current.stage != self.stage or current.microbatch >= self.microbatches:
                raise PlanMismatchError(
                    f"the pipeline hook runs {current} but this graph was compiled for stage "
                    f"{self.stage} of a plan with {self.microbatches} microbatches; pass "
                    f"options={{'stage': {current.stage}}} or re-plan for this pipeline"
                )
            return current
        if self.per_block and self.microbatches > 1:
            raise PlanMismatchError(
                f"a per-block plan (--compile-unit block) of {self.microbatches} microbatches ran a block's "
                f"{instruction} outside a pipeline step: each block runs once per layer, so the deployment cannot "
                f"count microbatches; run the step under a StepContext (steps.step('{instruction}', mb)) or a "
                f"torch.distributed.pipelining schedule (follow_plan), or plan --microbatches 1"
            )
        microbatch = self._calls[instruction] % self.microbatches
        return PipelineNode(self.stage, instruction, microbatch)  # type: ignore[arg-type]

    def at_iteration_boundary(self) -> bool:
        """True when every counted instruction has run a whole number of iterations."""
        return all(count % self.microbatches == 0 for count in self._calls.values())

    @staticmethod
    def _from_hook(instruction: str) -> bool:
        context = active_step_context()
        return context is not None and context.current is not None and context.current.instruction == instruction
