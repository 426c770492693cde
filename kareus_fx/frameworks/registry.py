"""Training frameworks by name (``kareus plan --framework NAME``, ``PlanRequest.framework``).

A request without a name gets what it implies: ``megatron-lm`` where it carries Megatron settings
other than the defaults (the testbed presets), else the traced order. Register a new framework by
adding its class to :data:`FRAMEWORKS`; the planner asks it through ``base.TrainingFramework`` only.
"""

from __future__ import annotations

from kareus_fx.errors import OptionsError
from kareus_fx.frameworks.base import JobRequest, TrainingFramework
from kareus_fx.frameworks.megatron_lm import MegatronLM
from kareus_fx.frameworks.megatron_settings import HF_DEFAULTS
from kareus_fx.frameworks.torchtitan_fsdp import TorchtitanFSDP
from kareus_fx.frameworks.traced_order import TracedOrder

__all__ = ["FRAMEWORKS", "framework_for", "framework_name", "get_framework"]

FRAMEWORKS: dict[str, type[TracedOrder]] = {cls.name: cls for cls in (TracedOrder, MegatronLM, TorchtitanFSDP)}
"""Every framework the planner can price, by name."""


def get_framework(name: str) -> TrainingFramework:
    """The framework called ``name``; an unknown name is refused naming the choices."""
    if name not in FRAMEWORKS:
        raise OptionsError(f"unknown training framework {name!r}: choose one of {', '.join(sorted(FRAMEWORKS))}")
    return FRAMEWORKS[name]()


def framework_name(req: JobRequest) -> str:
    """The request's framework: its own name, else what its settings imply (module docstring)."""
    if req.framework is not None:
        return req.framework
    return MegatronLM.name if req.megatron != HF_DEFAULTS else TracedOrder.name


def framework_for(req: JobRequest) -> TrainingFramework:
    """The framework that prices ``req``'s step."""
    return get_framework(framework_name(req))
