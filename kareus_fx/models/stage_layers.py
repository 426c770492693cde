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

An explicit split (``layer_counts``, one count per stage, as Megatron-LM's
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` or a hand-made
partition give) replaces the even one: the Kareus paper's testbed balances its stages by hand
(section 6.1), and ``kareus_fx.plan.stage_balance`` chooses such a split.

Stages with the same role and the same layer count trace to graphs of the same structure (the
layers of a stage are numbered from 0 in the stage's module tree, as in Megatron's
``TransformerBlock``), so a planner traces one stage of each :class:`StageGroup`. In a
mixture-of-experts model whose first layers are dense, the count of dense layers a stage holds
joins the key: a stage of dense and sparse layers differs from one of sparse layers alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kareus_fx.errors import ParallelConfigError

StageRole = Literal["single", "first", "middle", "last"]


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``index`` (0-based) of a pipeline of ``num_stages`` stages."""

    index: int = 0
    num_stages: int = 1
    layer_counts: tuple[int, ...] | None = None
    """Decoder layers of each stage, in stage order; None splits them evenly."""

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
        if self.layer_counts is not None and len(self.layer_counts) != self.num_stages:
            raise ParallelConfigError(
                f"{len(self.layer_counts)} stage layer counts {list(self.layer_counts)} for a "
                f"{self.num_stages}-stage pipeline; give one count per stage"
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
        raise ParallelConfigError(f"pp must be >= 1, got pp={num_stages}; use pp=1 for no pipeline parallelism")
    if num_stages > num_layers:
        raise ParallelConfigError(
            f"pp={num_stages} pipeline stages need at least {num_stages} decoder layers, the model "
            f"has {num_layers}; choose pp <= {num_layers} (or more layers)"
        )


def check_layer_counts(num_layers: int, layer_counts: Sequence[int]) -> None:
    """Raise :class:`ParallelConfigError` unless ``layer_counts`` give every stage at least one
    layer and add up to the model's ``num_layers``."""
    if any(count < 1 for count in layer_counts) or sum(layer_counts) != num_layers:
        raise ParallelConfigError(
            f"stage layer counts {list(layer_counts)} must each be >= 1 and add up to the model's "
            f"{num_layers} layers; e.g. {even_layer_counts(num_layers, len(layer_counts))}"
        )


def even_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Megatron-LM's default split (see the module docstring): ``[8, 8, 7, 7]`` for 30 over 4."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if index < extra else 0) for index in range(num_stages)]


def stage_layer_range(num_layers: int, num_stages: int, index: int, layer_counts: Sequence[int] | None = None) -> range:
    """Global indices of the decoder layers stage ``index`` holds: ``layer_counts`` (one per stage)
    or the even split (see the module docstring)."""
    check_stage_layers(num_layers, num_stages)
    PipelineStage(index, num_stages, None if layer_counts is None else tuple(layer_counts))  # validates
    if layer_counts is None:
        layer_counts = even_layer_counts(num_layers, num_stages)
    check_layer_counts(num_layers, layer_counts)
    start = sum(layer_counts[:index])
    return range(start, start + layer_counts[index])


@dataclass(frozen=True)
class StageGroup:
    """Pipeline stages whose graphs have the same structure: same role, same layer count, same
    count of dense layers (those before a mixture-of-experts model's first sparse one)."""

    role: StageRole
    num_layers: int
    stages: tuple[int, ...]
    dense_layers: int = 0

    @property
    def representative(self) -> int:
        """The stage to trace for the whole group (its lowest index)."""
        return self.stages[0]


def group_stages(
    num_layers: int, num_stages: int, layer_counts: Sequence[int] | None = None, sparse_from: int | None = None
) -> list[StageGroup]:
    """The pipeline's stages grouped by (role, layer count, dense layers), in order of their first
    stage. ``sparse_from``: a mixture-of-experts model's first sparse layer (None: a dense model,
    every layer counts as dense-structured alike)."""
    check_stage_layers(num_layers, num_stages)
    groups: dict[tuple[StageRole, int, int], list[int]] = {}
    for index in range(num_stages):
        layers = stage_layer_range(num_layers, num_stages, index, layer_counts)
        dense = 0 if sparse_from is None else len(range(layers.start, min(layers.stop, sparse_from)))
        groups.setdefault((stage_role(index, num_stages), len(layers), dense), []).append(index)
    return [StageGroup(role, count, tuple(stages), dense) for (role, count, dense), stages in groups.items()]
