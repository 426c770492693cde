"""Backend options: what ``torch.compile(..., backend="kareus", options={...})`` accepts.

Options are validated the first time Dynamo hands a graph to the backend (torch.compile itself
does not call backends eagerly). An unknown key, a wrong type or an unknown GPU raises
:class:`~kareus_fx.errors.OptionsError` listing what is valid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kareus_fx.cost_models.hardware import DEFAULT_GPU, canonical_gpu_name
from kareus_fx.errors import OptionsError, UnknownGPUError

if TYPE_CHECKING:
    from kareus_fx.deploy.run_log import RunLogOptions
    from kareus_fx.deploy.switching import PointSwitcher
    from kareus_fx.runtime.clock_controller import ClockController

_OPTION_HELP: dict[str, str] = {
    "dump_dir": "directory to write one JSON graph dump per compiled graph (str or Path)",
    "gpu": f"GPU whose spec labels ops compute- or memory-bound (default {DEFAULT_GPU})",
    "nanobatch": "split each microbatch into two nanobatches (bool, default True)",
    "inductor": "Inductor generates the code of the scheduled graphs (bool, default True); False runs them op by op",
    "plan": "plan.json to deploy (str or Path; see kareus_fx/deploy/deployment.py)",
    "target": "frontier point: 'max-throughput' (default), {'deadline_s': X}, {'energy_budget_j': Y}, "
    "{'zeus_cost': eta in [0, 1]} or {'max_slowdown': factor >= 1}",
    "stage": "pipeline stage this rank compiles (int, default 0)",
    "tune": "tune at compile time: 'simulated' or 'cuda' (needs plan_out): the live graph, or tune_request's",
    "plan_out": "where 'tune' writes the plan (str or Path)",
    "tune_request": "plan a reference model instead of the live graph: a dict of kareus_fx.plan.planner.PlanRequest fields",
    "microbatches": "microbatches per iteration when 'tune' plans the live graph (int, default 1)",
    "tune_seq": "sequence-length buckets 'tune' plans when the live graph's sequence length is symbolic "
    "(list of ints; default: the lengths it has seen)",
    "clock_controller": "a kareus_fx.runtime.clock_controller.ClockController the clock hooks request from",
    "power_limit": "deploy the plan as one GPU power limit instead of clocks: 'real' (through Zeus) or 'dry-run'",
    "run_log": "write one JSON line per iteration of the deployed plan: a path, or a dict of "
    "kareus_fx.deploy.run_log.RunLogOptions fields (path, drift_threshold, drift_window, warmup, compare_time_on_cpu)",
    "switching": "a kareus_fx.deploy.switching.PointSwitcher (it names the plan and target): switch frontier "
    "points between iterations",
}
_TARGET_VALUE_OK = {
    "deadline_s": lambda v: v > 0,
    "energy_budget_j": lambda v: v > 0,
    "zeus_cost": lambda v: 0 <= v <= 1,  # eta_knob
    "max_slowdown": lambda v: v >= 1,  # factor
}
_TUNE_PROFILERS = ("simulated", "cuda")


@dataclass(frozen=True)
class KareusOptions:
    """Validated backend options. Field names equal the user-facing option keys."""

    dump_dir: Path | None = None
    gpu: str = DEFAULT_GPU
    nanobatch: bool = True
    inductor: bool = True
    plan: Path | None = None
    target: str | Mapping[str, float] = "max-throughput"
    stage: int = 0
    tune: str | None = None
    plan_out: Path | None = None
    tune_request: Mapping[str, Any] | None = None
    microbatches: int = 1
    tune_seq: tuple[int, ...] | None = None
    clock_controller: ClockController | None = None
    power_limit: Literal["real", "dry-run"] | None = None
    switching: PointSwitcher | None = None
    run_log: RunLogOptions | None = None

    @classmethod
    def from_user(cls, options: Any) -> KareusOptions:
        """Validate the raw ``options`` value given to ``torch.compile``."""
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise OptionsError(
                f"backend='kareus' options must be a dict, got {type(options).__name__} "
                f"({options!r}); for example options={{'dump_dir': 'dumps'}}. Valid keys: " + _valid_keys_text()
            )
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise OptionsError(
                f"unknown backend='kareus' option(s) {', '.join(map(repr, unknown))}; valid options: "
                + _valid_keys_text()
            )
        values: dict[str, Any] = {}
        if options.get("dump_dir") is not None:
            dump_dir = options["dump_dir"]
            if not isinstance(dump_dir, (str, Path)):
                raise OptionsError(f"option 'dump_dir' must be a str or Path, got {type(dump_dir).__name__}")
            values["dump_dir"] = Path(dump_dir)
        if "gpu" in options:
            if not isinstance(options["gpu"], str):
                raise OptionsError(f"option 'gpu' must be a GPU name string, got {options['gpu']!r}")
            try:
                values["gpu"] = canonical_gpu_name(options["gpu"])
            except UnknownGPUError as err:
                raise OptionsError(f"option 'gpu': {err}") from None
        for key in ("nanobatch", "inductor"):
            if key in options:
                if not isinstance(options[key], bool):
                    raise OptionsError(f"option {key!r} must be True or False, got {options[key]!r}")
                values[key] = options[key]
        values.update(_deployment_options(options))
        return cls(**values)


def _int_option(options: Mapping[str, Any], key: str, low: int, what: str) -> int:
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise OptionsError(f"option {key!r} must be {what} (int >= {low}), got {value!r}")
    return value


def _deployment_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """plan, target, stage, tune, plan_out, tune_request, microbatches, tune_seq, clock_controller (see
    deploy/deployment.py), power_limit (deploy/power_limit_mode.py), run_log (deploy/run_log.py)."""
    values: dict[str, Any] = {}
    for key in ("plan", "plan_out"):
        if options.get(key) is not None:
            if not isinstance(options[key], (str, Path)):
                raise OptionsError(f"option {key!r} must be a path (str or Path), got {type(options[key]).__name__}")
            values[key] = Path(options[key])
    if "target" in options:
        values["target"] = _target(options["target"])
    if "stage" in options:
        values["stage"] = _int_option(options, "stage", 0, "a pipeline stage index")
    if options.get("tune") is not None:
        if options["tune"] not in _TUNE_PROFILERS:
            raise OptionsError(f"option 'tune' must be one of {', '.join(_TUNE_PROFILERS)}, got {options['tune']!r}")
        if options.get("plan") is not None:
            raise OptionsError("give option 'plan' (deploy a plan) or 'tune' (make one), not both")
        values["tune"] = options["tune"]
    if options.get("tune_request") is not None:
        if not isinstance(options["tune_request"], Mapping):
            raise OptionsError(
                f"option 'tune_request' must be a dict of PlanRequest fields, got {options['tune_request']!r}"
            )
        values["tune_request"] = dict(options["tune_request"])
    if "microbatches" in options:
        values["microbatches"] = _int_option(options, "microbatches", 1, "a number of microbatches")
    if options.get("tune_seq") is not None:
        seqs = options["tune_seq"]
        if (
            not isinstance(seqs, (list, tuple))
            or not seqs
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in seqs)
        ):
            raise OptionsError(
                f"option 'tune_seq' must be a non-empty list of sequence lengths (ints >= 1), got {seqs!r}"
            )
        values["tune_seq"] = tuple(sorted(set(seqs)))
    if options.get("clock_controller") is not None:
        from kareus_fx.runtime.clock_controller import ClockController

        if not isinstance(options["clock_controller"], ClockController):
            raise OptionsError(
                "option 'clock_controller' must be a kareus_fx.runtime.clock_controller.ClockController "
                f"(e.g. ClockController.open('dry-run')), got {type(options['clock_controller']).__name__}"
            )
        values["clock_controller"] = options["clock_controller"]
    if options.get("power_limit") is not None:
        if options["power_limit"] not in ("real", "dry-run"):
            raise OptionsError(f"option 'power_limit' must be 'real' or 'dry-run', got {options['power_limit']!r}")
        if options.get("plan") is None:
            raise OptionsError("option 'power_limit' deploys a plan's power-limit curve: give option 'plan' too")
        values["power_limit"] = options["power_limit"]
    if options.get("switching") is not None:
        values.update(_switching_options(options, values))
    if options.get("run_log") is not None:
        from kareus_fx.deploy.run_log import RunLogOptions

        values["run_log"] = RunLogOptions.from_option(options["run_log"])
    return values


def _switching_options(options: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """The PointSwitcher names the plan and the target; option 'target', if given, must agree
    (option 'plan' is checked against the switcher's plan when the deployment loads it)."""
    from kareus_fx.deploy.switching import PointSwitcher

    switcher = options["switching"]
    if not isinstance(switcher, PointSwitcher):
        raise OptionsError(
            "option 'switching' must be a kareus_fx.deploy.switching.PointSwitcher "
            f"(e.g. PointSwitcher('plan.json', candidates=5)), got {type(switcher).__name__}"
        )
    for other in ("tune", "power_limit"):
        if other in values:
            raise OptionsError(
                f"option 'switching' deploys the switcher's plan's clocks; it cannot be combined with {other!r}"
            )
    if "target" in values and values["target"] != switcher.target:
        raise OptionsError(
            f"option 'target' {values['target']!r} differs from the PointSwitcher's target {switcher.target!r}; "
            "give the target to the PointSwitcher only"
        )
    return {"switching": switcher, "target": switcher.target}


def _target(target: Any) -> str | dict[str, float]:
    if target == "max-throughput":
        return target
    if isinstance(target, Mapping) and len(target) == 1 and next(iter(target)) in _TARGET_VALUE_OK:
        ((key, value),) = target.items()
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if numeric and _TARGET_VALUE_OK[key](value):
            return {key: float(value)}
    raise OptionsError(
        f"option 'target' must be 'max-throughput', {{'deadline_s': X}} or {{'energy_budget_j': Y}} "
        f"with a positive number, {{'zeus_cost': eta}} with 0 <= eta <= 1 or {{'max_slowdown': factor}} "
        f"with factor >= 1, got {target!r}"
    )


def _valid_keys_text() -> str:
    return "; ".join(f"{key}: {text}" for key, text in _OPTION_HELP.items())
