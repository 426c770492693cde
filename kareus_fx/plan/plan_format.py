"""The plan file (``plan.json``): a versioned, validated, never-executed JSON artifact.

``kareus plan`` writes it; ``torch.compile(..., options={"plan": PATH})``, ``kareus inspect`` and
``kareus bench`` read it. Loading checks the file against :mod:`plan_schema` (every field any
reader uses: types, finite ranges, cross-references) and raises :class:`PlanFormatError` naming
the file and the offending field; readers get only the validated fields. Nothing in a plan is
evaluated as code.

Layout (schema version 1)::

    format: "kareus-plan", schema_version: 1, kareus_fx_version, created_utc
    workload: model, tp, cp, pp, microbatches, mbs, seq, layers (null for a live graph), stage_layers
      (decoder layers per pipeline stage; null for a live graph), world_size
    gpu: canonical GPU name;  profiler: the profiler's database key;  energy_scope;
    simulated, measurement: whether times and energies are predictions, and how they were taken
    stages: [{stage, graphs: {forward|backward: {fingerprint, sequential_fingerprint,
                                                 partition_types: {local type id: plan type id}}}}]
    partition_types: {plan type id: {graph, count, fingerprint, collective, slots, launch_slots,
                                     frontier: [config + measurement + found_by], tuning}}
    microbatch_options: {"<stage>/<instruction>": [{clock_mhz, sequential, configs, time_s,
                                                   energy_j, dynamic_energy_j, static_energy_j}]}
        configs: {plan type id: {comm_sms, launch_slot (null: that type sequential)}},
        or null when the whole microbatch runs un-split
    iteration_frontier: [{time_s, energy_j, choices: {"<stage>/<instruction>": [option index
                                                       per microbatch]}}], fastest first
    methods: {method: {frontier: [[time_s, energy_j], ...], metrics: {...}}}
    buckets (optional; ``kareus plan --seq 2048,4096,8192``): [{seq, stages, partition_types,
        microbatch_options, iteration_frontier, methods}] in increasing seq, one plan per
        sequence-length bucket; the top-level fields and ``workload.seq`` are the largest
        bucket's, so readers of one-length plans read a bucketed plan as that bucket.
    profiling (optional): {measurements, duplicates, groups, gpus_per_group, window_s, cooldown_s,
                           wall_s_on_device, gpu_hours, device, by_purpose: {tuning, nanobatching,
                           sequences}}: what profiling costs on the device

Times are seconds and energies joules of one iteration of one pipeline (``energy_scope``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus_fx.capture.validated_input import parse_json, read_bounded_text, validated_document
from kareus_fx.errors import KareusError
from kareus_fx.plan.plan_schema import BUCKET_FIELDS, INSTRUCTIONS, PlanFile, cross_check, instruction_key

__all__ = [
    "INSTRUCTIONS",
    "MAX_PLAN_BYTES",
    "PLAN_FORMAT",
    "PLAN_SCHEMA_VERSION",
    "Plan",
    "PlanFormatError",
    "Target",
    "bucketed_plan_data",
    "instruction_key",
    "load_plan",
    "validate_plan",
    "write_plan",
]

PLAN_FORMAT = "kareus-plan"
PLAN_SCHEMA_VERSION = 1
MAX_PLAN_BYTES = 256 * 2**20
"""A plan of a 70B model over 10 stages and 128 microbatches is a few MB; a file beyond this is
refused before it is read."""
_FIX = "regenerate the plan with `kareus plan`"


class PlanFormatError(KareusError, ValueError):
    """A plan file that is not valid: names the file, the field and what was expected."""


Target = str | Mapping[str, float]
"""``"max-throughput"``, ``{"deadline_s": X}``, ``{"energy_budget_j": Y}``, ``{"zeus_cost": eta}``
(Zeus's time-energy cost, ``eta_knob`` in [0, 1]) or ``{"max_slowdown": factor}`` (the least
energy at most ``factor`` x slower than the fastest point): :mod:`kareus_fx.policies.objectives`."""


@dataclass(frozen=True)
class Plan:
    """A validated plan. ``data`` is what :func:`validate_plan` returns: the fields the schema
    names, optional ones filled with their defaults (read it, do not mutate it)."""

    data: Mapping[str, Any]
    source: str = "<memory>"

    @property
    def workload(self) -> Mapping[str, Any]:
        return self.data["workload"]

    @property
    def gpu(self) -> str:
        return self.data["gpu"]

    @property
    def compile_unit(self) -> str:
        """What the plan's graphs are: a whole stage (``"stage"``; plans older than the field) or
        one transformer block compiled on its own (``"block"``, ``kareus plan --compile-unit block``)."""
        return str(self.workload.get("compile_unit", "stage"))

    @property
    def locks_clocks(self) -> bool:
        """False for a plan made with ``--max-clock-only``: every option runs at the maximum clock
        and deployment requests no clock (a user who may not lock clocks deploys the schedule)."""
        return not self.data.get("max_clock_only", False)

    @property
    def frontier(self) -> list[Mapping[str, Any]]:
        return self.data["iteration_frontier"]

    @property
    def buckets(self) -> tuple[int, ...]:
        """The sequence lengths of a bucketed plan, increasing; empty for a one-length plan."""
        return tuple(b["seq"] for b in self.data.get("buckets") or ())

    def bucket(self, seq: int) -> Plan:
        """Bucket ``seq`` of a bucketed plan as a one-length plan (``workload.seq`` = ``seq``)."""
        (chosen,) = [b for b in self.data["buckets"] if b["seq"] == seq]
        data = {
            **self.data,
            **{name: chosen[name] for name in BUCKET_FIELDS},
            "workload": {**self.workload, "seq": seq},
            "buckets": None,
        }
        return Plan(data=data, source=f"{self.source} (bucket seq={seq})")

    def bucket_for(self, seq: int) -> int | None:
        """The smallest bucket holding a call of ``seq`` tokens; None when it is longer than all."""
        return next((b for b in self.buckets if seq <= b), None)

    def point_index(self, target: Target = "max-throughput") -> int:
        """The frontier point ``target`` selects (see :data:`Target`).

        A deadline picks the least-energy point finishing by it; a budget the fastest point
        within it; ``zeus_cost`` and ``max_slowdown`` as Zeus's selectors of the same names (the
        cost's maximum power is the GPU's TDP x the plan's world size). Raises
        :class:`PlanFormatError` when no point meets the target or its value is out of range.
        """
        points = self.frontier
        if target == "max-throughput":
            return min(range(len(points)), key=lambda i: (points[i]["time_s"], points[i]["energy_j"]))
        if isinstance(target, Mapping) and len(target) == 1 and next(iter(target)) in ("zeus_cost", "max_slowdown"):
            return self._objective_point(target)
        # (limited field, optimised field, what the limit is, its unit)
        rules = {
            "deadline_s": ("time_s", "energy_j", "meets the deadline", "s"),
            "energy_budget_j": ("energy_j", "time_s", "fits the energy budget", "J"),
        }
        if isinstance(target, Mapping) and len(target) == 1 and next(iter(target)) in rules:
            ((key, limit),) = target.items()
            limited, optimised, what, unit = rules[key]
            ok = [i for i, p in enumerate(points) if p[limited] <= float(limit)]
            if not ok:
                best = min(p[limited] for p in points)
                raise PlanFormatError(
                    f"no plan point {what} {float(limit):.4g} {unit} (best: {best:.4g} {unit}); "
                    f"relax the target or use target 'max-throughput'"
                )
            return min(ok, key=lambda i: (points[i][optimised], points[i][limited]))
        raise PlanFormatError(
            f"target must be 'max-throughput', {{'deadline_s': X}}, {{'energy_budget_j': Y}}, "
            f"{{'zeus_cost': eta}} or {{'max_slowdown': factor}}, got {target!r}"
        )

    def _objective_point(self, target: Mapping[str, float]) -> int:
        """``{"zeus_cost": eta}`` or ``{"max_slowdown": factor}`` (see :data:`Target`)."""
        from kareus_fx.cost_models.hardware import gpu_spec
        from kareus_fx.policies.base import FrontierPoint
        from kareus_fx.policies.objectives import ObjectiveError, max_slowdown_point, zeus_cost_point

        points = [FrontierPoint.from_plan_point(i, p) for i, p in enumerate(self.frontier)]
        ((key, value),) = target.items()
        try:
            if key == "zeus_cost":
                max_power_w = gpu_spec(self.gpu).tdp_w * self.workload["world_size"]
                return zeus_cost_point(points, value, max_power_w).index
            return max_slowdown_point(points, value).index
        except ObjectiveError as err:
            raise PlanFormatError(f"target {dict(target)!r}: {err}") from None

    def option(self, point_index: int, stage: int, instruction: str, microbatch: int) -> Mapping[str, Any]:
        """The microbatch option (clock, per-type configs) a node runs at a frontier point."""
        key = instruction_key(stage, instruction)
        index = self.frontier[point_index]["choices"][key][microbatch]
        return self.data["microbatch_options"][key][index]

    def comm_sm_counts(self, point_index: int) -> frozenset[int]:
        """Every collective SM count the options at frontier point ``point_index`` use (all stages)."""
        options = self.data["microbatch_options"]
        return frozenset(
            config["comm_sms"]
            for key, indices in self.frontier[point_index]["choices"].items()
            for index in indices
            for config in (options[key][index]["configs"] or {}).values()
        )


def bucketed_plan_data(plans: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """One bucketed plan from one-length plans of the same workload, keyed by sequence length."""
    seqs = sorted(plans)
    largest = plans[seqs[-1]]
    buckets = [{"seq": seq, **{name: plans[seq][name] for name in BUCKET_FIELDS}} for seq in seqs]
    return {**largest, "buckets": buckets}


def write_plan(path: str | Path, data: Mapping[str, Any]) -> Path:
    """Validate ``data`` and write it atomically to ``path``."""
    path = Path(path)
    validate_plan(data, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False))
    os.replace(tmp, path)
    return path


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; any problem raises :class:`PlanFormatError`.

    Refused before parsing: a file larger than :data:`MAX_PLAN_BYTES`, or not UTF-8 text."""
    text = read_bounded_text(path, MAX_PLAN_BYTES, PlanFormatError, "kareus plan")
    data = parse_json(text, str(path), PlanFormatError, "kareus plan", _FIX)
    return Plan(data=validate_plan(data, str(path)), source=str(path))


def validate_plan(data: Any, source: str = "<plan>") -> dict[str, Any]:
    """The plan ``data`` as validated (:mod:`plan_schema`: every field a reader uses, nothing
    else), or :class:`PlanFormatError` naming the source, the field and the fix."""
    if not isinstance(data, dict):
        raise PlanFormatError(f"{source}: expected a JSON object, got {type(data).__name__}; {_FIX}")
    if data.get("format") != PLAN_FORMAT:
        raise PlanFormatError(
            f"{source}: format: expected {PLAN_FORMAT!r}, got {data.get('format')!r} (not a kareus plan); {_FIX}"
        )
    if data.get("schema_version") != PLAN_SCHEMA_VERSION or isinstance(data.get("schema_version"), bool):
        raise PlanFormatError(
            f"{source}: schema_version: this kareus-fx reads version {PLAN_SCHEMA_VERSION}, "
            f"got {data.get('schema_version')!r}; {_FIX}"
        )
    return validated_document(PlanFile, data, cross_check, source, PlanFormatError, _FIX)
