"""A reference model's pipeline stage in the calling convention of ``torch.distributed.pipelining``.

The engine passes a stage's activations positionally (the first stage: the schedule's ``step``
arguments; the others: what the previous stage sent) and the ``step`` keyword arguments by name.
:class:`~kareus_fx.models.transformer.Transformer` takes ``input_ids`` / ``hidden`` / ``labels`` by
name, so :class:`StageModule` maps ``forward(x, labels=None)`` onto it: ``x`` is the token ids on
the first stage and the hidden states elsewhere; the last stage takes ``labels`` and returns its
loss (as the plan's last-stage graph does). It adds no op: its graph is the stage's graph.
"""

from __future__ import annotations

import torch
from torch import nn

from kareus_fx.models.transformer import Transformer


class StageModule(nn.Module):
    """``forward(x, labels=None)`` of one pipeline stage of ``model`` (module docstring)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.model.stage.is_first:
            return self.model(input_ids=x, labels=labels)
        return self.model(hidden=x, labels=labels)
