"""A fixed CPU workload timed beside each ``kareus bench`` case, so wall times compare across machines.

A wall time recorded on one machine says little on another, or on the same machine under another
load: CI's runners differ several-fold in speed from run to run. The runner therefore times this
workload in the same process, just before and just after each case, and checks the case's phases
in units of it (``wall.*_per_ref``), the way a benchmark prints a ratio against a baseline run in
the same process.

The workload does what the planner's phases do, without any of kareus-fx's code (so a regression
in kareus-fx cannot hide in the reference): a fake-tensor ``make_fx`` trace of the forward and
backward of a small transformer block (the Python-bound dispatch that tracing and the passes are
made of) and XGBoost fits on a fixed data set (the tuner's surrogates; one thread, as the tuner
uses). Assumption: the planner's phases and this workload slow down alike when the machine is
slower or loaded; a load that changes during a case is flagged by
``ReferenceTiming.load_changed``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import xgboost
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["ReferenceTiming", "time_reference_s"]

_WIDTH, _HIDDEN, _LAYERS = 64, 256, 4
_FITS = 4
# Repeats of the timed workload per measurement; the median of them is the reference time.
_REPEATS = 5
# Above this ratio between the reference before and after a case, the machine's load changed
# while the case ran and its wall metrics are unreliable.
_LOAD_CHANGE_RATIO = 1.5


def _block_loss(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    wq, wk, wv, wo, w_up, w_down = weights
    for _ in range(_LAYERS):
        h = F.layer_norm(x, x.shape[-1:])
        attn = torch.softmax((h @ wq) @ (h @ wk).transpose(-1, -2) / _WIDTH**0.5, -1) @ (h @ wv)
        x = x + attn @ wo
        h = F.layer_norm(x, x.shape[-1:])
        x = x + F.silu(h @ w_up) @ w_down
    return x.sum()


def _trace_once() -> None:
    shapes = [(2, 16, _WIDTH)] + [(_WIDTH, _WIDTH)] * 4 + [(_WIDTH, _HIDDEN), (_HIDDEN, _WIDTH)]
    inputs = [torch.zeros(shape, requires_grad=True) for shape in shapes]

    def step(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(_block_loss(*args), args)

    make_fx(step, tracing_mode="fake")(*inputs)


def _fit_once(features: np.ndarray, target: np.ndarray) -> None:
    for seed in range(_FITS):
        xgboost.XGBRegressor(n_estimators=100, max_depth=4, n_jobs=1, random_state=seed).fit(features, target)


def _workload() -> None:
    rng = np.random.default_rng(0)
    features = rng.random((400, 6))
    target = features @ rng.random(6) + np.sin(6.0 * features[:, 0])
    _trace_once()
    _fit_once(features, target)


def time_reference_s(repeats: int = _REPEATS) -> float:
    """Median wall time of the workload over ``repeats`` runs, after one untimed warm-up run (the
    first ``make_fx`` call pays one-off imports and caches)."""
    _workload()
    samples_s = []
    for _ in range(repeats):
        started = time.perf_counter()
        _workload()
        samples_s.append(time.perf_counter() - started)
    return statistics.median(samples_s)


@dataclass(frozen=True)
class ReferenceTiming:
    """The reference workload's time just before and just after one case."""

    before_s: float
    after_s: float

    @property
    def reference_s(self) -> float:
        """The time the case's phases are divided by: the mean of before and after."""
        return (self.before_s + self.after_s) / 2

    @property
    def load_changed(self) -> bool:
        """Whether the machine's speed changed by more than 1.5x while the case ran."""
        return max(self.before_s, self.after_s) > _LOAD_CHANGE_RATIO * min(self.before_s, self.after_s)

    def in_refs(self, wall_s: float) -> float:
        """``wall_s`` in units of the reference workload's time."""
        return wall_s / self.reference_s
