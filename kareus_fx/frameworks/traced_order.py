"""The default framework: the traced order as it runs.

A job that runs the traced model as kareus deploys it, with nothing around it that the trace does
not show: the model config's own embedding tying, the request's stage split (or the even one), no
extra work in the graphs, every collective where the trace puts it, plain p2p sends of the stage's
output activation between pipeline stages (``pipeline_sends.py``), and after the last microbatch
the plain data-parallel step: gradients all-reduced over the data x context group and every rank
stepping Adam over all of its parameters (``step_tail.py`` without a sharded optimizer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kareus_fx.compose.pipeline_schedule import Instruction
from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.frameworks.base import BackwardReprice, JobRequest
from kareus_fx.frameworks.pipeline_sends import stage_transfer_s
from kareus_fx.frameworks.step_tail import StepTail, step_tail
from kareus_fx.models.configs import ModelConfig, get_config
from kareus_fx.models.stage_layers import even_layer_counts
from kareus_fx.workload import GraphName, OpCost

__all__ = ["TracedOrder", "model_layers"]


def model_layers(req: JobRequest) -> int:
    """The reference model's decoder layer count (``--layers`` or its config's)."""
    return req.layers or get_config(req.model).num_layers


class TracedOrder:
    """The traced order as it runs (module docstring); the base the other frameworks refine."""

    name = "traced-order"

    def model_config(self, req: JobRequest) -> ModelConfig:
        """The reference model's own config."""
        return get_config(req.model)

    def stage_layer_counts(self, req: JobRequest) -> list[int]:
        """The request's own counts (a named split is resolved to counts before the stages are
        traced), else the even split of the model's layers."""
        if isinstance(req.stage_layers, tuple):
            return list(req.stage_layers)
        return even_layer_counts(model_layers(req), req.num_stages)

    def extra_work(self, req: JobRequest, stage: int) -> Mapping[GraphName, tuple[OpCost, ...]]:
        """None: the traced graphs are the whole microbatch."""
        return {}

    def backward_repricing(
        self,
        req: JobRequest,
        dumps: Mapping[str, Path],
        load: Callable[[Path], Mapping[str, Any]],
        extra_backward: tuple[OpCost, ...] = (),
    ) -> dict[str, BackwardReprice | None]:
        """None: the backward runs op after op, as traced."""
        return {}

    def pipeline_sends(
        self, req: JobRequest, sent_bytes: Sequence[float], spec: GPUSpec
    ) -> dict[tuple[int, Instruction], float]:
        """Each tensor-parallel rank sends the whole activation to its peer (``pipeline_sends.py``)."""
        return stage_transfer_s(sent_bytes, req.tp, req.cp, spec, ranks=req.pp, stage_replicas=max(1, req.ep // req.tp))

    def step_tail(self, req: JobRequest, simulator: Simulator) -> StepTail | None:
        """The plain data-parallel step: gradient all-reduce, Adam over every parameter of the rank."""
        return self._step_tail(req, simulator, distributed_optimizer=False)

    def _step_tail(self, req: JobRequest, simulator: Simulator, *, distributed_optimizer: bool) -> StepTail:
        return step_tail(
            simulator,
            self.model_config(req),
            self.stage_layer_counts(req),
            tp=req.tp,
            cp=req.cp,
            dp=req.dp,
            pp=req.pp,
            distributed_optimizer=distributed_optimizer,
        )
