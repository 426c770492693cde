"""Pipeline-parallel stages: which decoder layers a stage holds and which stages look alike.

A model split into ``num_stages`` pipeline stages (Megatron-LM's pipeline parallelism) gives
every stage a contiguous run of decoder layers; the first stage also holds the embedding, the
last one the final norm, the LM head and the loss. One stage (``num_stages == 1``) is the whole
model.

Layer split: Megatron-LM's default split is even (``num_layers / num_stages`` per stage; it asserts
divisibility). When the count does not divide, the first ``num_layers % num_stages`` stages get one
layer more than the others (``[8, 8, 7, 7]`` for 30 layers over 4 stages): the last stage, which
also runs the LM head and the loss, is never one of the larger ones. Every stage needs at least one
layer, so ``num_stages <= num_layers``.

Stages with the same role and the same layer count trace to graphs of the same structure (the
layers of a stage are numbered from 0 in the stage's module tree, as in Megatron's
``TransformerBlock``), so a planner traces one stage of each :class:`StageGroup`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kareus_fx.errors import ParallelConfigError

StageRole = Literal["single", "first", "middle", "last"]


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``index`` (0-based) of a pipeline of ``num_stages`` stages."""

    index: int = 0
    num_stages: int = 1

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ParallelConfigError(
                f"a pipeline needs at least 1 stage, got num_stages={self.num_stages}; use pp >= 1"
            )
        if not 0 <= self.index < self.num_stages:
            raise ParallelConfigError(
                f"stage index {self.index} is outside a {self.num_stages}-stage pipeline; "
                f"choose a stage in 0..{self.num_stages - 1}"
            )

    @property
    def is_first(self) -> bool:
        """Holds the embedding (takes token ids)."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm, LM head and loss (takes labels, returns the loss)."""
        return self.index == self.num_stages - 1

    @property
    def role(self) -> StageRole:
        return stage_role(self.index, self.num_stages)


def stage_role(index: int, num_stages: int) -> StageRole:
    """``"single"`` for a one-stage pipeline, else ``"first"``, ``"middle"`` or ``"last"``."""
    if num_stages == 1:
        return "single"
    if index == 0:
        return "first"
    return "last" if index == num_stages - 1 else "middle"


def check_stage_layers(num_layers: int, num_stages: int) -> None:
    """Raise :class:`ParallelConfigError` unless every stage gets at least one layer."""
    if num_stages < 1:
        raise ParallelConfigError(
            f"pp must be >= 1, got pp={num_stages}; use pp=1 for no pipeline parallelism"
        )
    if num_stages > num_layers:
        raise ParallelConfigError(
            f"pp={num_stages} pipeline stages need at least {num_stages} decoder layers, the model "
            f"has {num_layers}; choose pp <= {num_layers} (or more layers)"
        )


def stage_layer_range(num_layers: int, num_stages: int, index: int) -> range:
    """Global indices of the decoder layers stage ``index`` holds (see the module docstring)."""
    check_stage_layers(num_layers, num_stages)
    PipelineStage(index, num_stages)  # validates the index
    base, extra = divmod(num_layers, num_stages)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


@dataclass(frozen=True)
class StageGroup:
    """Pipeline stages whose graphs have the same structure: same role, same layer count."""

    role: StageRole
    num_layers: int
    stages: tuple[int, ...]

    @property
    def representative(self) -> int:
        """The stage to trace for the whole group (its lowest index)."""
        return self.stages[0]


def group_stages(num_layers: int, num_stages: int) -> list[StageGroup]:
    """The pipeline's stages grouped by (role, layer count), in order of their first stage."""
    check_stage_layers(num_layers, num_stages)
    groups: dict[tuple[StageRole, int], list[int]] = {}
    for index in range(num_stages):
        key = (stage_role(index, num_stages), len(stage_layer_range(num_layers, num_stages, index)))
        groups.setdefault(key, []).append(index)
    return [StageGroup(role, count, tuple(stages)) for (role, count), stages in groups.items()]
