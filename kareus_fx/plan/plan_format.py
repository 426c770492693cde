"""The plan file (``plan.json``): a versioned, validated, never-executed JSON artifact.

``kareus plan`` writes it; ``torch.compile(..., options={"plan": PATH})``, ``kareus inspect`` and
``kareus bench`` read it. Loading validates every field this module relies on and raises
:class:`PlanFormatError` naming the offending field; nothing in a plan is evaluated as code.

Layout (schema version 1)::

    format: "kareus-plan", schema_version: 1, kareus_fx_version, created_utc
    workload: model, tp, cp, pp, microbatches, mbs, seq, layers (null for a live graph), world_size
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

Times are seconds and energies joules of one iteration of one pipeline (``energy_scope``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus_fx.errors import KareusError

__all__ = [
    "PLAN_FORMAT",
    "PLAN_SCHEMA_VERSION",
    "Plan",
    "PlanFormatError",
    "Target",
    "instruction_key",
    "load_plan",
    "write_plan",
]

PLAN_FORMAT = "kareus-plan"
PLAN_SCHEMA_VERSION = 1
INSTRUCTIONS = ("forward", "backward")
WORKLOAD_FIELDS = ("model", "tp", "cp", "pp", "microbatches", "mbs", "seq", "layers", "world_size")


class PlanFormatError(KareusError, ValueError):
    """A plan file that is not valid: names the file, the field and what was expected."""


def instruction_key(stage: int, instruction: str) -> str:
    """The key of one (stage, instruction) in ``microbatch_options`` and ``choices``."""
    return f"{stage}/{instruction}"


Target = str | Mapping[str, float]
"""``"max-throughput"``, ``{"deadline_s": X}`` or ``{"energy_budget_j": Y}``."""


@dataclass(frozen=True)
class Plan:
    """A validated plan. ``data`` is the JSON object as loaded (read it, do not mutate it)."""

    data: Mapping[str, Any]
    source: str = "<memory>"

    @property
    def workload(self) -> Mapping[str, Any]:
        return self.data["workload"]

    @property
    def gpu(self) -> str:
        return self.data["gpu"]

    @property
    def frontier(self) -> list[Mapping[str, Any]]:
        return self.data["iteration_frontier"]

    def point_index(self, target: Target = "max-throughput") -> int:
        """The frontier point ``target`` selects (see :data:`Target`).

        A deadline picks the least-energy point finishing by it; a budget the fastest point
        within it. Raises :class:`PlanFormatError` when no point meets the target.
        """
        points = self.frontier
        if target == "max-throughput":
            return min(range(len(points)), key=lambda i: (points[i]["time_s"], points[i]["energy_j"]))
        # (limited field, optimised field, what the limit is, its unit)
        rules = {"deadline_s": ("time_s", "energy_j", "meets the deadline", "s"),
                 "energy_budget_j": ("energy_j", "time_s", "fits the energy budget", "J")}
        if isinstance(target, Mapping) and len(target) == 1 and next(iter(target)) in rules:
            (key, limit), = target.items()
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
            f"target must be 'max-throughput', {{'deadline_s': X}} or {{'energy_budget_j': Y}}, "
            f"got {target!r}"
        )

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
    """Read and validate a plan file; any problem raises :class:`PlanFormatError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise PlanFormatError(f"cannot read plan file {path}: {err.strerror}; check the path") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanFormatError(
            f"{path} is not a kareus plan: invalid JSON at line {err.lineno} column {err.colno} "
            f"({err.msg}); regenerate it with `kareus plan`"
        ) from None
    validate_plan(data, str(path))
    return Plan(data=data, source=str(path))


# ----- validation -------------------------------------------------------------------------------
class _Checker:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> None:
        raise PlanFormatError(f"{self.source}: {where}: {what}; regenerate the plan with `kareus plan`")

    def obj(self, value: Any, where: str, keys: tuple[str, ...] = ()) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            self.fail(where, f"expected an object, got {type(value).__name__}")
        missing = [k for k in keys if k not in value]
        if missing:
            self.fail(where, f"missing {', '.join(missing)}")
        return value

    def array(self, value: Any, where: str, non_empty: bool = False) -> list[Any]:
        if not isinstance(value, list):
            self.fail(where, f"expected a list, got {type(value).__name__}")
        if non_empty and not value:
            self.fail(where, "must not be empty")
        return value

    def integer(self, value: Any, where: str, low: int = 0) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            self.fail(where, f"expected an integer >= {low}, got {value!r}")
        return value

    def number(self, value: Any, where: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            self.fail(where, f"expected a finite number >= 0, got {value!r}")
        return float(value)


def validate_plan(data: Any, source: str = "<plan>") -> None:
    """Raise :class:`PlanFormatError` unless ``data`` is a schema-1 plan whose parts agree."""
    c = _Checker(source)
    top = c.obj(data, "plan", ("format", "schema_version", "workload", "gpu", "stages",
                               "partition_types", "microbatch_options", "iteration_frontier", "methods"))
    if top["format"] != PLAN_FORMAT:
        c.fail("format", f"expected {PLAN_FORMAT!r}, got {top['format']!r} (not a kareus plan)")
    if top["schema_version"] != PLAN_SCHEMA_VERSION:
        c.fail("schema_version", f"this kareus-fx reads version {PLAN_SCHEMA_VERSION}, got {top['schema_version']!r}")
    workload = c.obj(top["workload"], "workload", WORKLOAD_FIELDS)
    for key in WORKLOAD_FIELDS[1:]:
        if key == "layers" and workload[key] is None:
            continue  # a plan of a live graph: no reference model, layer count unknown
        c.integer(workload[key], f"workload.{key}", low=1)
    if not isinstance(top["gpu"], str):
        c.fail("gpu", "expected a GPU name")
    pp, microbatches = workload["pp"], workload["microbatches"]

    ptypes = c.obj(top["partition_types"], "partition_types")
    for tid, record in ptypes.items():
        where = f"partition_types.{tid}"
        c.obj(record, where, ("graph", "count", "fingerprint", "collective", "slots", "launch_slots", "frontier"))
        c.integer(record["count"], f"{where}.count", low=1)
        n_slots = len(c.array(record["slots"], f"{where}.slots", non_empty=True))
        for i, slot in enumerate(c.array(record["launch_slots"], f"{where}.launch_slots")):
            if c.integer(slot, f"{where}.launch_slots[{i}]") >= n_slots:
                c.fail(f"{where}.launch_slots[{i}]", f"slot {slot} outside the type's {n_slots} slots")

    stages = c.array(top["stages"], "stages")
    if len(stages) != pp:
        c.fail("stages", f"expected {pp} stages (workload.pp), got {len(stages)}")
    for s, stage in enumerate(stages):
        graphs = c.obj(c.obj(stage, f"stages[{s}]", ("stage", "graphs"))["graphs"], f"stages[{s}].graphs", INSTRUCTIONS)
        for name in INSTRUCTIONS:
            g = c.obj(graphs[name], f"stages[{s}].graphs.{name}", ("fingerprint", "partition_types"))
            for local, plan_tid in c.obj(g["partition_types"], f"stages[{s}].graphs.{name}.partition_types").items():
                if plan_tid not in ptypes:
                    c.fail(f"stages[{s}].graphs.{name}.partition_types.{local}", f"unknown partition type {plan_tid!r}")

    options = c.obj(top["microbatch_options"], "microbatch_options")
    for s in range(pp):
        for name in INSTRUCTIONS:
            key = instruction_key(s, name)
            if key not in options:
                c.fail("microbatch_options", f"missing {key!r}")
            for i, option in enumerate(c.array(options[key], f"microbatch_options.{key}", non_empty=True)):
                where = f"microbatch_options.{key}[{i}]"
                c.obj(option, where, ("clock_mhz", "sequential", "configs", "time_s", "energy_j"))
                c.integer(option["clock_mhz"], f"{where}.clock_mhz", low=1)
                c.number(option["time_s"], f"{where}.time_s")
                c.number(option["energy_j"], f"{where}.energy_j")
                if option["sequential"] != (option["configs"] is None):
                    c.fail(where, "configs must be null exactly when sequential is true")
                for tid, config in (option["configs"] or {}).items():
                    if tid not in ptypes:
                        c.fail(f"{where}.configs", f"unknown partition type {tid!r}")
                    c.obj(config, f"{where}.configs.{tid}", ("comm_sms", "launch_slot"))
                    c.integer(config["comm_sms"], f"{where}.configs.{tid}.comm_sms", low=1)
                    if config["launch_slot"] is not None:  # None: that type runs sequentially
                        c.integer(config["launch_slot"], f"{where}.configs.{tid}.launch_slot")

    for p, point in enumerate(c.array(top["iteration_frontier"], "iteration_frontier", non_empty=True)):
        where = f"iteration_frontier[{p}]"
        c.obj(point, where, ("time_s", "energy_j", "choices"))
        c.number(point["time_s"], f"{where}.time_s")
        c.number(point["energy_j"], f"{where}.energy_j")
        choices = c.obj(point["choices"], f"{where}.choices")
        for key, per_microbatch in choices.items():
            if key not in options:
                c.fail(f"{where}.choices", f"unknown (stage, instruction) {key!r}")
            indices = c.array(per_microbatch, f"{where}.choices.{key}")
            if len(indices) != microbatches:
                c.fail(f"{where}.choices.{key}", f"expected {microbatches} entries (one per microbatch), got {len(indices)}")
            for m, index in enumerate(indices):
                if c.integer(index, f"{where}.choices.{key}[{m}]") >= len(options[key]):
                    c.fail(f"{where}.choices.{key}[{m}]", f"option {index} out of range")
        if len(choices) != 2 * pp:
            c.fail(f"{where}.choices", f"expected {2 * pp} (stage, instruction) entries, got {len(choices)}")

    for name, method in c.obj(top["methods"], "methods").items():
        for i, pt in enumerate(c.array(c.obj(method, f"methods.{name}", ("frontier", "metrics"))["frontier"],
                                       f"methods.{name}.frontier", non_empty=True)):
            if not (isinstance(pt, list) and len(pt) == 2):
                c.fail(f"methods.{name}.frontier[{i}]", "expected [time_s, energy_j]")
            c.number(pt[0], f"methods.{name}.frontier[{i}][0]")
            c.number(pt[1], f"methods.{name}.frontier[{i}][1]")
