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
  about 0.7 ms a round on tiny data, so the 10 models of a batch (2 objectives x 5 members) train
  in about 0.4 s on one core;
- ``min_child_weight=1``, ``subsample=1``, ``tree_method="exact"``: the data sets are tiny, and
  the exact method is deterministic for a given seed;
- ``nthread=1``: several partition types are tuned in parallel processes.

Targets are standardised per objective before training (trees do not care, but the base score and
regularisation then behave the same for joules and seconds).

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


class BootstrapXGB:
    """A bootstrap ensemble of XGBoost regressors for one objective."""

    def __init__(self, params: XGBParams, seed: int) -> None:
        self.params = params
        self.seed = seed
        self._boosters: list[xgb.Booster] = []
        self._mean = 0.0
        self._std = 1.0

    def fit(self, x: np.ndarray, y: np.ndarray) -> BootstrapXGB:
        y = np.asarray(y, dtype=float)
        self._mean = float(y.mean())
        self._std = float(y.std()) or 1.0
        z = (y - self._mean) / self._std
        n = len(y)
        size = max(2, int(round(self.params.bootstrap_fraction * n)))
        self._boosters = []
        for member in range(self.params.ensemble_size):
            rng = np.random.default_rng([self.seed, member])
            idx = rng.integers(0, n, size=size)
            member_seed = int(rng.integers(0, 2**31 - 1))
            dtrain = xgb.DMatrix(x[idx], label=z[idx], nthread=self.params.nthread)
            self._boosters.append(
                xgb.train(
                    self.params.booster_params(member_seed),
                    dtrain,
                    num_boost_round=self.params.n_estimators,
                )
            )
        return self

    def predict_members(self, x: np.ndarray) -> np.ndarray:
        """``(members, n)`` predictions in the target's units."""
        if not self._boosters:
            raise RuntimeError("fit() the ensemble before predicting")
        dmat = xgb.DMatrix(x, nthread=self.params.nthread)
        preds = np.stack([b.predict(dmat) for b in self._boosters]).astype(float)
        return preds * self._std + self._mean

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ensemble mean and standard deviation per row."""
        members = self.predict_members(x)
        return members.mean(axis=0), members.std(axis=0)


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

    def fit(
        self, x: np.ndarray, clocks_mhz: Sequence[int], measurements: Sequence[Measurement]
    ) -> PartitionSurrogate:
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
