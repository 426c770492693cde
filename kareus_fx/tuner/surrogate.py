"""XGBoost surrogates for one partition type: time and dynamic energy, with bootstrap uncertainty.

Paper section 4.3.2: two regressors, ``t_hat(x)`` and ``e_dyn_hat(x)``; total energy is derived as
``e_dyn_hat(x) + P_static * t_hat(x)`` and static energy as ``P_static * t_hat(x)``. Uncertainty comes
from a bootstrap ensemble: each member is trained on its own resample of the measured points and
the spread of their predictions is the uncertainty (appendix C: 5 members, 0.8 sampling fraction,
seeds varied across members).

Hyperparameters (appendix C asks for shallow trees, a high learning rate and modest capacity; the
concrete values are ours, chosen on the synthetic and simulated partition types of
``bench/mbo_quality.py``):

- ``max_depth=4``: with 3 knobs, depth 4 lets a tree express a clock x SMs x launch-slot interaction;
- ``learning_rate=0.3``: few rounds are enough on a few hundred points;
- ``n_estimators=50``: modest capacity; at learning rate 0.3 the fit on a few hundred points has
  converged by then (100 rounds gave the same frontiers on the benchmark types). XGBoost costs
  about 0.7 ms a round on tiny data, so the 12 models of a batch (2 objectives x (5 members + the
  all-points model)) train in about 0.5 s on one core;
- ``min_child_weight=1``, ``subsample=1``, ``tree_method="exact"``: the data sets are tiny, and
  the exact method is deterministic for a given seed;
- ``nthread=1``: several partition types are tuned in parallel processes.

Targets are standardised per objective before training (trees do not care, but the base score and
regularisation then behave the same for joules and seconds).

Two departures from plain bagged trees, both because the frontier is made of configurations that
differ from their neighbours by one clock step (1-3 % in time and energy), finer than piecewise-
constant trees resolve from 10-15 % of the space:

- **Linear base in the clock**: each model first fits a least-squares line in the clock
  (``ridge``-regularised; ``linear_features``) and the trees learn its residual; a prediction is
  line + trees. Between two measured clocks a tree predicts a constant, so all the clocks in
  between tie, the greedy HVI pass can pick only one of them, and the points it skips are the
  frontier's middle. The line carries the smooth clock trend across those gaps; the trees keep
  everything else (SMs x launch slot, the TDP plateau). Only the clock: a line through all the
  features (tried first) also extrapolates along the U-shaped SM axis and sent the passes after
  phantom optima at its ends (``syn_medium``: worst of 5 seeds 0.909, mean 0.977, against 0.999
  and 0.9995 with the clock line). Over the traced Llama-3.2-3B and Qwen3-1.7B TP8 types
  (``bench/mbo_quality.py``, 5 seeds) the backward types' mean HV ratios rose from 0.986-0.998
  to 0.997-0.9997; one forward type (Llama MLP) lost (0.978 without the line, 0.949 with it; see the bench).
- **Mean from all points**: the predicted mean is a model trained on every measured point; the
  bootstrap members (each on a resample of 80 %, i.e. about 55 % distinct points) give only the
  spread. The mean of the members is a bagged model that has not seen a near-front point in about
  half its members and is pulled towards the bulk; with it the worst seed of the Llama attention
  forward type reached an HV ratio of 0.933, with the all-points mean 0.992.

Features (:meth:`~kareus_fx.tuner.space.SearchSpace.features`): besides the three knobs and the
launch position, the trees get two roofline estimates, the collective's *hiding capacity* (SMs x
compute left after the launch at the config's clock) and the *compute time* on the SMs the
collective leaves (the space module says why). Measured with ``bench/mbo_quality.py --seeds 5``
(simulated A100; mean / worst seed HV ratio, 5-column encoding -> 7-column encoding): Llama-3.2-3B
forward MLP 0.949 / 0.938 -> 0.997 / 0.992, Qwen3-1.7B forward attention 0.973 / 0.955 -> 0.997 /
0.996, Qwen3-1.7B forward MLP 0.990 / 0.971 -> 0.994 / 0.989, Llama forward attention 0.9996 /
0.998 -> 0.9992 / 0.998 (noise); the backward types stay at 0.999-1.0;
synthetic types 0.978 / 0.943, 0.9995 / 0.999, 0.995 / 0.989 -> 0.980 / 0.959, 0.999 / 0.998,
0.998 / 0.997. The clock stays the only column of the linear base: adding the compute-time
estimate to it (a line through SMs again) dropped ``syn_medium`` to 0.948 / 0.881 (3 seeds).

Static power: taken from the measurements, per clock (``static_energy_j / time_s``), interpolated in
the clock between measured clocks and the GPU spec's ``static_power_w`` where nothing is measured.
With a profiler whose static power is the spec constant this is exactly ``static_power_w``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import xgboost as xgb

from kareus_fx.workload import Measurement


@dataclass(frozen=True)
class XGBParams:
    """XGBoost and bootstrap-ensemble settings (see module docstring for the reasons)."""

    max_depth: int = 4
    learning_rate: float = 0.3
    n_estimators: int = 50
    min_child_weight: float = 1.0
    reg_lambda: float = 1.0
    ensemble_size: int = 5
    bootstrap_fraction: float = 0.8
    nthread: int = 1
    ridge: float = 1e-3
    """L2 penalty of the linear base (on standardised targets, features in [0, 1])."""
    linear_features: tuple[int, ...] = (0,)
    """Feature columns of the linear base: 0 is the clock in ``SearchSpace.features``."""

    def to_dict(self) -> dict:
        return asdict(self)

    def booster_params(self, seed: int) -> dict:
        return {
            "objective": "reg:squarederror",
            "max_depth": self.max_depth,
            "eta": self.learning_rate,
            "min_child_weight": self.min_child_weight,
            "lambda": self.reg_lambda,
            "tree_method": "exact",
            "nthread": self.nthread,
            "seed": seed,
            "verbosity": 0,
        }


def _design(x: np.ndarray, columns: tuple[int, ...]) -> np.ndarray:
    return np.column_stack([np.ones(len(x)), x[:, list(columns)]])


class _LinearPlusTrees:
    """A least-squares linear function of some features plus XGBoost trees on its residual."""

    def __init__(self, params: XGBParams, x: np.ndarray, z: np.ndarray, seed: int) -> None:
        self.columns = params.linear_features
        design = _design(x, self.columns)
        gram = design.T @ design + params.ridge * np.eye(design.shape[1])
        self.coef = np.linalg.solve(gram, design.T @ z)
        dtrain = xgb.DMatrix(x, label=z - design @ self.coef, nthread=params.nthread)
        self.booster = xgb.train(params.booster_params(seed), dtrain, num_boost_round=params.n_estimators)
        self.nthread = params.nthread

    def predict(self, x: np.ndarray) -> np.ndarray:
        trees = self.booster.predict(xgb.DMatrix(x, nthread=self.nthread)).astype(float)
        return trees + _design(x, self.columns) @ self.coef


class BootstrapXGB:
    """One objective: a model on all points for the mean, a bootstrap ensemble for the spread."""

    def __init__(self, params: XGBParams, seed: int) -> None:
        self.params = params
        self.seed = seed
        self._full: _LinearPlusTrees | None = None
        self._members: list[_LinearPlusTrees] = []
        self._mean = 0.0
        self._std = 1.0

    def fit(self, x: np.ndarray, y: np.ndarray) -> BootstrapXGB:
        y = np.asarray(y, dtype=float)
        self._mean = float(y.mean())
        self._std = float(y.std()) or 1.0
        z = (y - self._mean) / self._std
        n = len(y)
        size = max(2, int(round(self.params.bootstrap_fraction * n)))
        self._full = _LinearPlusTrees(self.params, x, z, seed=self.seed)
        self._members = []
        for member in range(self.params.ensemble_size):
            rng = np.random.default_rng([self.seed, member])
            idx = rng.integers(0, n, size=size)
            member_seed = int(rng.integers(0, 2**31 - 1))
            self._members.append(_LinearPlusTrees(self.params, x[idx], z[idx], seed=member_seed))
        return self

    def predict_members(self, x: np.ndarray) -> np.ndarray:
        """``(members, n)`` predictions of the bootstrap members in the target's units."""
        if not self._members:
            raise RuntimeError("fit() the ensemble before predicting")
        return np.stack([m.predict(x) for m in self._members]) * self._std + self._mean

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean (the all-points model) and standard deviation (over the members) per row."""
        if self._full is None:
            raise RuntimeError("fit() the ensemble before predicting")
        mean = self._full.predict(x) * self._std + self._mean
        return mean, self.predict_members(x).std(axis=0)


@dataclass(frozen=True)
class Prediction:
    """Surrogate predictions for a set of candidate configs (arrays of equal length)."""

    time_s: np.ndarray
    time_std_s: np.ndarray
    dynamic_energy_j: np.ndarray
    dynamic_energy_std_j: np.ndarray
    static_power_w: np.ndarray

    @property
    def static_energy_j(self) -> np.ndarray:
        return self.static_power_w * self.time_s

    @property
    def total_energy_j(self) -> np.ndarray:
        return self.dynamic_energy_j + self.static_energy_j


class StaticPowerModel:
    """Static power per clock from measurements, interpolated; the spec value where none is measured."""

    def __init__(self, default_w: float) -> None:
        self.default_w = default_w
        self._clocks = np.zeros(0)
        self._power = np.zeros(0)

    def fit(self, clocks_mhz: Sequence[int], measurements: Sequence[Measurement]) -> StaticPowerModel:
        by_clock: dict[int, list[float]] = {}
        for clock, m in zip(clocks_mhz, measurements):
            if m.time_s > 0:
                by_clock.setdefault(int(clock), []).append(m.static_energy_j / m.time_s)
        clocks = sorted(by_clock)
        self._clocks = np.array(clocks, dtype=float)
        self._power = np.array([float(np.median(by_clock[c])) for c in clocks])
        return self

    def __call__(self, clocks_mhz: np.ndarray) -> np.ndarray:
        clocks = np.asarray(clocks_mhz, dtype=float)
        if len(self._clocks) == 0:
            return np.full(clocks.shape, self.default_w)
        return np.interp(clocks, self._clocks, self._power)


class PartitionSurrogate:
    """Time and dynamic-energy ensembles plus the static power model for one partition type."""

    def __init__(self, params: XGBParams, static_power_w: float, seed: int) -> None:
        self.params = params
        self.time_model = BootstrapXGB(params, seed=2 * seed)
        self.dynamic_model = BootstrapXGB(params, seed=2 * seed + 1)
        self.static_power = StaticPowerModel(static_power_w)

    def fit(self, x: np.ndarray, clocks_mhz: Sequence[int], measurements: Sequence[Measurement]) -> PartitionSurrogate:
        self.time_model.fit(x, np.array([m.time_s for m in measurements]))
        self.dynamic_model.fit(x, np.array([m.dynamic_energy_j for m in measurements]))
        self.static_power.fit(clocks_mhz, measurements)
        return self

    def predict(self, x: np.ndarray, clocks_mhz: np.ndarray) -> Prediction:
        t_mean, t_std = self.time_model.predict(x)
        e_mean, e_std = self.dynamic_model.predict(x)
        return Prediction(
            time_s=t_mean,
            time_std_s=t_std,
            dynamic_energy_j=e_mean,
            dynamic_energy_std_j=e_std,
            static_power_w=self.static_power(clocks_mhz),
        )
