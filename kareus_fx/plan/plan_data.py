"""Step 4 of ``kareus plan``: the plan file's data (``plan_format.py``) from the traced stages, the
tuned partition types and the composed frontiers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from kareus_fx import __version__
from kareus_fx.compose.microbatch import MicrobatchPoint
from kareus_fx.compose.pipeline_schedule import INSTRUCTIONS
from kareus_fx.cost_models.hardware import canonical_gpu_name
from kareus_fx.cost_models.profile_db import fingerprint
from kareus_fx.frameworks.registry import framework_for
from kareus_fx.frameworks.traced_order import model_layers
from kareus_fx.plan.composition import Composed
from kareus_fx.plan.methods import BASELINES, METHODS
from kareus_fx.plan.plan_format import PLAN_FORMAT, PLAN_SCHEMA_VERSION, instruction_key
from kareus_fx.plan.power_limit_baseline import POWER_LIMIT_METHOD
from kareus_fx.plan.request import LIVE_GRAPH_MODEL, PlanRequest
from kareus_fx.tuner.mbo import TuningResult
from kareus_fx.workload import GraphName, PartitionType


def _option_record(point: MicrobatchPoint) -> dict[str, Any]:
    return {
        "clock_mhz": point.clock_mhz,
        "sequential": point.sequential,
        "configs": None
        if point.configs is None
        else {
            tid: {"comm_sms": c.comm_sms, "launch_slot": c.launch_slot, "comm_library": c.comm_library}
            for tid, c in point.configs
        },
        "time_s": point.time_s,
        "energy_j": point.energy_j,
        "dynamic_energy_j": point.dynamic_energy_j,
        "static_energy_j": point.static_energy_j,
    }


def _type_record(ptype: PartitionType, result: TuningResult, counts: Mapping[str, int]) -> dict[str, Any]:
    return {
        "graph": ptype.graph,
        "count": counts[ptype.type_id],
        "fingerprint": fingerprint(ptype),
        "collective": dataclasses.asdict(ptype.collective),
        "slots": [
            {"bound": s.bound, "flops": s.flops, "bytes": s.bytes, "ops": [op.target for op in s.ops]}
            for s in ptype.slots
        ],
        "launch_slots": list(ptype.launch_slots),
        "frontier": [
            {**dataclasses.asdict(p.config), **dataclasses.asdict(p.measurement), "found_by": p.source}
            for p in result.frontier
        ],
        "tuning": {
            "space_size": result.stats.space_size,
            "measured": result.stats.measured,
            "fraction_measured": result.stats.fraction_measured,
            "batches": result.stats.batches,
            "stop_reason": result.stats.stop_reason,
            "frontier_sources": result.frontier_sources(),
        },
    }


def _measurement_provenance(req: PlanRequest, device: str | None = None) -> str:
    """Where the plan's times and energies come from, in words (``device``: a distributed profiler's words)."""
    if req.profiler == "cpu-replay":
        return (
            f"{device or 'test device'}: partitions replayed with their real collectives; times are the "
            f"slowest rank's wall clock, energies a fixed power model; NOT a GPU measurement"
        )
    if device is not None:
        return (
            f"measured on {device}: partitions replayed with their real collectives over SM-limited "
            f"communicators; CUDA-event time (slowest rank), Zeus energy summed over each group over "
            f">= {req.device_window_s:g} s windows"
        )
    if req.profiler == "simulated":
        return "simulated GPU: every time and energy is a cost-model prediction, nothing was measured"
    clocks = (
        "each configuration's SM clock locked while measuring"
        if (req.clock_mode or "real") == "real"
        else "clock mode dry-run: every point measured at the card's current clock, not at its clock_mhz"
    )
    return (
        f"measured on one GPU: CUDA-event time, NVML energy over >= {req.device_window_s:g} s windows; "
        f"collectives as a local SM-limited reduce (no link time); {clocks}"
    )


def plan_data(
    req,
    traced,
    ptypes,
    local_to_plan,
    tuned,
    composed: Composed,
    profiler_kind: str,
    wall: Mapping[str, float],
    device: str | None = None,
) -> dict[str, Any]:
    stage_group = {s: g for g, stage in enumerate(traced) for s in stage.stages}
    counts: dict[tuple[int, GraphName], dict[str, int]] = {}
    for (g, name, local), plan_id in local_to_plan.items():
        count = next(t.count for t in traced[g].partitioned[name].ptypes if t.type_id == local)
        counts.setdefault((g, name), {})[plan_id] = count
    stages = []
    for s in range(req.num_stages):
        g = stage_group[s]
        graphs = {}
        for name in INSTRUCTIONS:
            partitioned = traced[g].partitioned
            graphs[name] = {
                "fingerprint": (
                    partitioned[name].fingerprint if partitioned else traced[g].sequential[name].fingerprint
                ),
                "sequential_fingerprint": traced[g].sequential[name].fingerprint,
                "partition_types": {
                    local: pid for (gg, nn, local), pid in sorted(local_to_plan.items()) if gg == g and nn == name
                },
                "counts": counts.get((g, name), {}),
            }
        stages.append({"stage": s, "graphs": graphs})
    max_count = {pid: max(c.get(pid, 0) for c in counts.values()) for pid in ptypes}

    kareus = composed.iteration["kareus"]
    options = {
        instruction_key(s, name): [_option_record(p) for p in kareus.options[(s, name)]]
        for s in range(req.num_stages)
        for name in INSTRUCTIONS
    }
    frontier = []
    for point in kareus.points:
        choices: dict[str, list[int]] = {
            instruction_key(s, n): [0] * req.microbatches
            for s in range(req.num_stages)
            for n in ("forward", "backward")
        }
        for node, index in zip(kareus.nodes, point.choices):
            choices[instruction_key(node.stage, node.instruction)][node.microbatch] = int(index)
        frontier.append(
            {"time_s": point.time_s, "energy_j": point.energy_j * composed.energy_scale, "choices": choices}
        )
    methods: dict[str, dict[str, Any]] = {
        m: {
            "frontier": [[p.time_s, p.energy_j * composed.energy_scale] for p in composed.iteration[m].points],
            "metrics": composed.metrics[m],
        }
        for m in METHODS
    }
    chosen = composed.power_limit_choice
    if chosen is not None:
        methods[POWER_LIMIT_METHOD] = {
            "frontier": [[chosen.time_s, chosen.energy_j]],
            "metrics": composed.metrics[POWER_LIMIT_METHOD],
            "chosen_power_limit_w": chosen.power_limit_w,
            "power_limits": [[p.power_limit_w, p.time_s, p.energy_j] for p in composed.power_limits],
        }
    if composed.kareus_power_limits:
        methods["kareus"]["power_limits"] = [
            [p.power_limit_w, p.time_s, p.energy_j] for p in composed.kareus_power_limits
        ]
        methods["kareus"]["locked_power_limits"] = [
            [p.power_limit_w, p.time_s, p.energy_j] for p in composed.kareus_locked_power_limits
        ]
    tail = composed.step_tail
    step_tail_record = (
        None
        if tail is None
        else {
            "time_s": tail.time_s,
            "energy_j": tail.energy_j * composed.energy_scale,
            "parts_s": dict(tail.parts_s),
            "parameters_per_gpu": list(tail.parameters_per_gpu),
        }
    )
    live = req.model == LIVE_GRAPH_MODEL
    layers = req.layers if live else model_layers(req)
    stage_layers = None if live else framework_for(req).stage_layer_counts(req)
    return {
        "format": PLAN_FORMAT,
        "schema_version": PLAN_SCHEMA_VERSION,
        "kareus_fx_version": __version__,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "workload": {
            "model": req.model,
            "tp": req.tp,
            "cp": req.cp,
            "pp": req.pp,
            "virtual_stages": req.virtual_stages,
            "microbatches": req.microbatches,
            "mbs": req.mbs,
            "seq": req.seq,
            "layers": layers,
            "stage_layers": stage_layers,
            "world_size": req.world_size,
            "dp": req.dp,
            "preset": req.preset,
            "dtype": req.dtype,
            "recompute": req.recompute,
            "compile_unit": req.compile_unit,
            **({"ep": req.ep, "expert_imbalance": req.expert_imbalance} if req.ep > 1 else {}),
        },
        "gpu": canonical_gpu_name(req.gpu),
        "profiler": profiler_kind,
        "simulated": req.profiler == "simulated",
        "measurement": _measurement_provenance(req, device),
        "energy_scope": (
            f"one pipeline: {req.world_size} GPUs (tp x cp x pp); every rank of a stage "
            f"assumed to cost what the traced rank costs"
            if req.dp == 1
            else f"the job: {req.dp} data-parallel replicas x {req.world_size} GPUs (tp x cp x pp) = "
            f"{req.dp * req.world_size} GPUs; every rank assumed to cost what the traced rank of its stage "
            f"costs; their gradient all-reduce is in step_tail where the plan records it"
        ),
        "baselines": list(BASELINES),
        "max_clock_only": req.max_clock_only,
        "stages": stages,
        "partition_types": {pid: _type_record(p, tuned[pid], max_count) for pid, p in ptypes.items()},
        "microbatch_options": options,
        "iteration_frontier": frontier,
        "methods": methods,
        **({} if step_tail_record is None else {"step_tail": step_tail_record}),
        "wall_s": dict(wall),
    }
