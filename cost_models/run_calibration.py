"""Recalibrate the simulated GPU from a user's own runs (``kareus plan --calibrate-from RUN.jsonl ...``).

The run logs (``deploy/run_log.py``, one record per iteration) say, for every iteration after
warm-up, what the deployed plan predicted and what the hardware measured. Fitted here: one time
scale, the median of measured over predicted iteration time, and one energy scale, the median of
measured over predicted energy per GPU, over every such iteration of every file. The median keeps a
stray iteration (an NVML counter that updated late, a checkpoint save) from moving the fit.

Assumption: the simulator's error on this machine is one factor on every time and one on every
energy, the same at every clock, kernel schedule and partition, so the shape of the frontier holds
and only its level moves. That is what a run of one point can identify; a run that visits several
points (``PointSwitcher``) could fit more, and is not used so here. Records of CPU runs carry no
measured energy (``energy_source: simulated``) and are refused; their times are of CPU kernels.
The runs must come from plans of the same simulator (not themselves recalibrated): the ratios are
taken against the predictions the records hold.

The plan applies the scales to every iteration-level and microbatch-level price it holds (the
frontier, each microbatch option, each method's frontier, the step tail; the methods' reduction metrics are ratios
and do not change) and records the scales and the files' SHA-256 hashes under ``run_calibration``.
The tuned partition frontiers stay the simulator's: a uniform scale does not reorder them.
"""

from __future__ import annotations

import copy
import hashlib
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kareus_fx.deploy.run_record import read_run_log
from kareus_fx.errors import KareusError

__all__ = ["RunCalibration", "RunCalibrationError", "apply_run_calibration", "fit_run_calibration"]

_ENERGY_KEYS = ("energy_j", "dynamic_energy_j", "static_energy_j")


class RunCalibrationError(KareusError, ValueError):
    """Run logs that cannot calibrate the simulator (no measured iteration, mixed GPUs)."""


@dataclass(frozen=True)
class RunSource:
    """One run log the fit read."""

    path: str
    sha256: str
    iterations: int


@dataclass(frozen=True)
class RunCalibration:
    """The fitted scales (measured over predicted) and where they come from."""

    gpu: str
    time_scale: float
    energy_scale: float
    warmup: int
    sources: tuple[RunSource, ...]

    def as_json(self) -> dict[str, Any]:
        """What the plan records under ``run_calibration``."""
        return {**asdict(self), "sources": [asdict(source) for source in self.sources]}


def fit_run_calibration(paths: Sequence[str | Path], warmup: int = 1) -> RunCalibration:
    """Fit the two scales on the iterations from ``warmup`` on of every run log in ``paths``."""
    time_ratios: list[float] = []
    energy_ratios: list[float] = []
    sources: list[RunSource] = []
    gpus: set[str] = set()
    for path in map(Path, paths):
        kept = [r for r in read_run_log(path) if r.iteration >= warmup]
        simulated = [r.iteration for r in kept if r.energy_source != "zeus"]
        if simulated:
            raise RunCalibrationError(
                f"{path}: iterations {simulated[:5]} have no measured energy (energy_source simulated: a CPU run); "
                "calibrate from runs on the GPU the plan is for"
            )
        if not kept:
            raise RunCalibrationError(f"{path}: no iteration after the {warmup} warm-up iteration(s)")
        gpus.update(r.gpu for r in kept)
        time_ratios += [r.time_ratio for r in kept]
        energy_ratios += [r.energy_ratio for r in kept]
        sources.append(RunSource(str(path), hashlib.sha256(path.read_bytes()).hexdigest(), len(kept)))
    if len(gpus) != 1:
        raise RunCalibrationError(
            f"the runs are of plans for several GPUs ({sorted(gpus)}); calibrate one GPU at a time"
        )
    return RunCalibration(
        gpu=gpus.pop(),
        time_scale=statistics.median(time_ratios),
        energy_scale=statistics.median(energy_ratios),
        warmup=warmup,
        sources=tuple(sources),
    )


def apply_run_calibration(data: Mapping[str, Any], calibration: RunCalibration) -> dict[str, Any]:
    """A copy of plan ``data`` with its prices scaled (see the module docstring)."""
    if data["gpu"] != calibration.gpu:
        raise RunCalibrationError(
            f"the runs were measured against {calibration.gpu} plans, but this plan is for {data['gpu']}; "
            f"plan with --gpu {calibration.gpu} or calibrate from runs on {data['gpu']}"
        )
    scaled = copy.deepcopy(dict(data))
    priced = [*scaled["iteration_frontier"], *(o for options in scaled["microbatch_options"].values() for o in options)]
    for entry in priced:
        entry["time_s"] *= calibration.time_scale
        for key in _ENERGY_KEYS:
            if key in entry:
                entry[key] *= calibration.energy_scale
    tail = scaled.get("step_tail")
    if tail is not None:  # the work after the last microbatch, included in every frontier point
        tail["time_s"] *= calibration.time_scale
        tail["energy_j"] *= calibration.energy_scale
        tail["parts_s"] = {part: t * calibration.time_scale for part, t in tail["parts_s"].items()}
    for method in scaled["methods"].values():
        method["frontier"] = [[t * calibration.time_scale, e * calibration.energy_scale] for t, e in method["frontier"]]
    scaled["run_calibration"] = calibration.as_json()
    return scaled
