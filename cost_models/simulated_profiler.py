"""The default profiler: the simulated GPU behind the :class:`~kareus_fx.workload.Profiler` protocol.

CPU-only, deterministic, fast. With ``noise_std > 0`` each measurement carries log-normal time
and power noise like a real profiler's; the noise of the k-th measurement of a (partition type,
config) depends only on the seed, the partition type's fingerprint, the config and k, so a run
is reproducible whatever order (or process) the configurations are measured in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from kareus_fx.cost_models.hardware import DEFAULT_GPU
from kareus_fx.cost_models.profile_db import FingerprintCache
from kareus_fx.cost_models.sim_params import SimParams, gpu_params
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.workload import CollectiveSpec, Measurement, OpCost, PartitionConfig, PartitionType


class SimulatedProfiler:
    """Measures partitions on the simulated ``gpu_name`` (calibrated parameters unless ``params``).

    ``power_limit_w``: the GPU runs under that power limit instead of its TDP (the clock throttles
    to where the average power meets it, as at the TDP); None: the TDP."""

    def __init__(
        self,
        gpu_name: str = DEFAULT_GPU,
        noise_std: float = 0.0,
        seed: int = 0,
        params: SimParams | None = None,
        power_limit_w: float | None = None,
    ) -> None:
        if noise_std < 0.0:
            raise ValueError(f"noise_std must be >= 0, got {noise_std}")
        loaded = gpu_params(gpu_name)
        self.gpu_name = loaded.spec.name
        self.noise_std = float(noise_std)
        self.seed = int(seed)
        spec = loaded.spec
        if power_limit_w is not None:
            if not 0.0 < power_limit_w <= spec.tdp_w:
                raise ValueError(f"power_limit_w must be in (0, {spec.tdp_w:g}] W for {spec.name}, got {power_limit_w}")
            spec = replace(spec, tdp_w=float(power_limit_w))
        self.power_limit_w = power_limit_w
        self.simulator = Simulator(spec, params if params is not None else loaded.params)
        self._repeats: dict[tuple[str, PartitionConfig], int] = {}
        self._fingerprint = FingerprintCache()
        params_text = json.dumps(self.simulator.params.to_dict(), sort_keys=True)
        self._params_hash = hashlib.sha256(params_text.encode()).hexdigest()[:12]

    @property
    def kind(self) -> str:
        """Profile-database key of this profiler: changes when the parameters or the noise change."""
        noise = f"noise={self.noise_std:g},seed={self.seed}" if self.noise_std > 0 else "exact"
        limit = "" if self.power_limit_w is None else f":limit={self.power_limit_w:g}W"
        return f"simulated:{self._params_hash}:{noise}{limit}"

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        measurement = self.simulator.measure(ptype, config)
        if self.noise_std <= 0.0:
            return measurement
        fp = self._fingerprint(ptype)
        repeat = self._repeats.get((fp, config), 0)
        self._repeats[(fp, config)] = repeat + 1
        slot = -1 if config.launch_slot is None else config.launch_slot
        rng = np.random.default_rng([self.seed, int(fp[:15], 16), config.clock_mhz, config.comm_sms, slot + 1, repeat])
        return self.simulator.with_noise(measurement, rng, self.noise_std)

    def measure_sequence(
        self, ops: Sequence[OpCost], collectives: Sequence[CollectiveSpec], clock_mhz: int
    ) -> Measurement:
        """Work outside partitions, or a whole un-split microbatch: ``ops`` one after another,
        then each collective alone with the default SM count, at ``clock_mhz``."""
        measurement = self.simulator.predict_sequence(ops, collectives, clock_mhz=clock_mhz).measurement
        if self.noise_std <= 0.0:
            return measurement
        text = json.dumps(
            [[op.target, op.flops, op.bytes] for op in ops] + [list(vars(c).values()) for c in collectives]
        )
        digest = int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
        rng = np.random.default_rng([self.seed, digest, int(clock_mhz)])
        return self.simulator.with_noise(measurement, rng, self.noise_std)
