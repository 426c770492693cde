"""The interface between the planner and the training framework a job runs in.

The traced model is what ``torch.compile`` sees; the step the job runs is that model inside a
training framework, which adds work of its own around it. The planner asks a
:class:`TrainingFramework` for each such fact and knows nothing of any framework itself: a new
framework is a new implementation registered by name (``registry.py``), the planner unchanged.

Hooks that add work the traced model does not run (:meth:`~TrainingFramework.extra_work`,
:meth:`~TrainingFramework.backward_repricing`, :meth:`~TrainingFramework.step_tail`) are asked only
where the profiler can price such work (``plan.profilers.ProfilerCapabilities``) and the request
traces a reference model (its config is known); elsewhere the plan prices the traced graphs alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from kareus_fx.compose.pipeline_schedule import Instruction
from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.frameworks.megatron_settings import MegatronSettings
from kareus_fx.frameworks.step_tail import StepTail
from kareus_fx.models.configs import ModelConfig
from kareus_fx.plan.graph_workload import SequentialGraph
from kareus_fx.workload import GraphName, Measurement, OpCost

__all__ = ["BackwardReprice", "JobRequest", "TrainingFramework"]


class JobRequest(Protocol):
    """What a framework reads of the planned job (``plan.request.PlanRequest`` is one; the
    frameworks do not import the planner)."""

    @property
    def model(self) -> str: ...
    @property
    def layers(self) -> int | None: ...
    @property
    def tp(self) -> int: ...
    @property
    def cp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def dp(self) -> int: ...
    @property
    def ep(self) -> int: ...
    @property
    def mbs(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def recompute(self) -> str: ...
    @property
    def stage_layers(self) -> str | tuple[int, ...]: ...
    @property
    def megatron(self) -> MegatronSettings: ...
    @property
    def framework(self) -> str | None: ...
    @property
    def num_stages(self) -> int: ...


class BackwardReprice(Protocol):
    """A backward sequence priced as the framework runs it rather than op after op."""

    def reprice(
        self, measured: Mapping[int, Measurement], graph: SequentialGraph, simulator: Simulator
    ) -> dict[int, Measurement]:
        """Per clock, ``measured`` (``graph`` run op after op) as the framework runs ``graph``,
        priced on ``simulator``."""
        ...


@runtime_checkable
class TrainingFramework(Protocol):
    """What a training framework adds to the traced model's step, one hook per fact."""

    name: str
    """The registry name (``kareus plan --framework NAME``)."""

    def model_config(self, req: JobRequest) -> ModelConfig:
        """The reference model's config as the framework trains it (e.g. its embedding tying).
        Assumes the request names a reference model."""
        ...

    def stage_layer_counts(self, req: JobRequest) -> list[int]:
        """Decoder layers per global pipeline stage. Assumes a named split (``"balanced"``) was
        resolved to counts before the stages were traced."""
        ...

    def extra_work(self, req: JobRequest, stage: int) -> Mapping[GraphName, tuple[OpCost, ...]]:
        """Ops the framework runs in each graph of global stage ``stage`` that the traced model does not (appended after the graph's own, in the un-split graph and
        in the work outside partitions). Assumes they are memory- or compute-bound ops a
        simulated GPU can price; empty where the framework adds none."""
        ...

    def backward_repricing(
        self,
        req: JobRequest,
        dumps: Mapping[str, Path],
        load: Callable[[Path], Mapping[str, Any]],
        extra_backward: tuple[OpCost, ...] = (),
    ) -> dict[str, BackwardReprice | None]:
        """How the framework runs a stage's backward where it does not run it op after op (e.g.
        collectives overlapped beside other kernels), by ``"sequential"`` (the un-split
        microbatch, from the dump ``dumps["sequential"]``) and ``"outside"`` (the work outside
        partitions, from ``dumps["nanobatched"]`` where the stage partitions); ``load`` reads a dump. ``extra_backward``: the
        :meth:`extra_work` appended to that backward, which the repriced sequence runs too.
        Empty (or None values): the traced order."""
        ...

    def pipeline_sends(
        self, req: JobRequest, sent_bytes: Sequence[float], spec: GPUSpec
    ) -> dict[tuple[int, Instruction], float]:
        """Per (global stage, instruction), the blocking send it ends with, in seconds
        (``sent_bytes[s]``: the activation stage ``s`` sends on). Assumes each send blocks its
        sender for its whole transfer, at the blocking power."""
        ...

    def step_tail(self, req: JobRequest, simulator: Simulator) -> StepTail | None:
        """The work after the last microbatch (gradient synchronisation, optimizer step), the
        same for every method; None where the framework adds none."""
        ...
