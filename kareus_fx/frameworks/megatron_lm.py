"""Megatron-LM with Transformer Engine: the paper's testbed as a training framework.

The traced order (``traced_order.py``) refined by the request's Megatron settings
(``PlanRequest.megatron``, ``megatron_settings.py``; the testbed presets carry the artifact's):
the embedding tying Megatron trains, hidden dropout's memory traffic (``megatron_dropout.py``),
the unfused gradient accumulation into fp32 ``main_grad`` (``megatron_main_grad.py``), Transformer
Engine's input-gradient all-reduce beside the weight-gradient GEMM (``megatron_async_dgrad.py``),
and the distributed optimizer's step tail (``step_tail.py``). Megatron-core's p2p sends are the
traced order's (every tensor-parallel rank sends the whole activation). With the default settings
(``HF_DEFAULTS``) every hook gives what the traced order gives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.frameworks.base import BackwardReprice, JobRequest
from kareus_fx.frameworks.megatron_async_dgrad import async_dgrad_split
from kareus_fx.frameworks.megatron_dropout import dropout_ops
from kareus_fx.frameworks.megatron_main_grad import main_grad_ops
from kareus_fx.frameworks.step_tail import StepTail, stage_parameters
from kareus_fx.frameworks.traced_order import TracedOrder
from kareus_fx.models.configs import ModelConfig
from kareus_fx.workload import GraphName, OpCost

__all__ = ["MegatronLM", "backward_graph"]


def backward_graph(dump: Mapping[str, Any]) -> Mapping[str, Any]:
    """The (loaded) dump's backward graph record."""
    (graph,) = [g for g in dump["graphs"] if g["name"] == "backward"]
    return graph


class MegatronLM(TracedOrder):
    """Megatron-LM/TE under ``req.megatron`` (module docstring)."""

    name = "megatron-lm"

    def model_config(self, req: JobRequest) -> ModelConfig:
        """The config with the embedding tying Megatron trains (None keeps the config's own)."""
        cfg = super().model_config(req)
        if req.megatron.tie_embeddings is not None:
            cfg = dataclasses.replace(cfg, tie_embeddings=req.megatron.tie_embeddings)
        return cfg

    def extra_work(self, req: JobRequest, stage: int) -> Mapping[GraphName, tuple[OpCost, ...]]:
        """Hidden dropout's mask traffic (forward and backward) and the unfused ``main_grad``
        accumulation (backward), where the settings turn them on."""
        settings = req.megatron
        if settings.hidden_dropout <= 0.0 and settings.gradient_accumulation_fusion is not False:
            return {}
        cfg = self.model_config(req)
        counts = self.stage_layer_counts(req)
        extra: dict[GraphName, tuple[OpCost, ...]] = {"forward": (), "backward": ()}
        if settings.hidden_dropout > 0.0:
            elements = req.mbs * req.seq / req.cp * cfg.hidden_size
            for g in extra:
                extra[g] += dropout_ops(g, counts[stage], elements, req.recompute)
        if settings.gradient_accumulation_fusion is False:
            extra["backward"] += main_grad_ops(stage_parameters(cfg, counts, req.tp)[stage])
        return extra

    def backward_repricing(
        self,
        req: JobRequest,
        dumps: Mapping[str, Path],
        load: Callable[[Path], Mapping[str, Any]],
        extra_backward: tuple[OpCost, ...] = (),
    ) -> dict[str, BackwardReprice | None]:
        """Transformer Engine's asynchronous input-gradient all-reduces where
        ``MegatronSettings.te_async_dgrad`` is on; the traced order otherwise."""
        if not req.megatron.te_async_dgrad:
            return {}
        splits = {"sequential": async_dgrad_split(backward_graph(load(dumps["sequential"])))}
        if "nanobatched" in dumps:
            backward = backward_graph(load(dumps["nanobatched"]))
            leftover = backward["leftover"]
            splits["outside"] = async_dgrad_split(backward, [*leftover["nodes"], *leftover["collectives"]])
        return {
            kind: None
            if split is None
            else dataclasses.replace(split, rest=dataclasses.replace(split.rest, ops=split.rest.ops + extra_backward))
            for kind, split in splits.items()
        }

    def step_tail(self, req: JobRequest, simulator: Simulator) -> StepTail | None:
        """Megatron-LM's ``train_step`` tail, with the distributed optimizer where the settings use it."""
        return self._step_tail(req, simulator, distributed_optimizer=req.megatron.distributed_optimizer)
