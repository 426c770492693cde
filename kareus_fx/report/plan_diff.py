"""``kareus inspect --diff A B``: what changed between two plans or two graph dumps.

Plans: workload and provenance fields; partition types matched by structure (fingerprint, since
type ids are numbered in discovery order) — added, removed, count changes, renumbering; the
configuration at the max-throughput point per (stage, instruction) (clock, and per partition type
comm SMs and launch slot); the predicted iteration time and energy there; the frontier size; every
method's metrics; the tuning effort per type.

Dumps: header fields, per graph the totals (nodes, FLOPs, bytes, collectives) and the partition
types matched by their structural id (added, removed, count changes), partitions and leftovers.

The result is a list of :class:`Change` lines grouped by section; an empty list means no change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kareus_fx.plan.plan_format import Plan
from kareus_fx.report.dump_summary import summarise_graph
from kareus_fx.report.plan_summary import ranges_text

__all__ = ["Change", "diff_dumps", "diff_plans", "format_changes"]


@dataclass(frozen=True)
class Change:
    """One difference: the section it belongs to, what changed, and how."""

    section: str
    what: str
    detail: str


def format_changes(changes: Sequence[Change], a_name: str, b_name: str) -> str:
    """Text for the terminal: sections in order, one line per change."""
    if not changes:
        return f"no differences between {a_name} and {b_name}"
    lines = [f"--- {a_name}", f"+++ {b_name}"]
    for section in dict.fromkeys(c.section for c in changes):
        lines.append(f"[{section}]")
        lines += [f"  {c.what}: {c.detail}" for c in changes if c.section == section]
    return "\n".join(lines)


def _relative(a: float, b: float) -> str:
    return f"{(b / a - 1.0) * 100:+.2f}%" if a else "n/a"


def _value_changes(section: str, a: Mapping[str, Any], b: Mapping[str, Any], keys: Sequence[str]) -> list[Change]:
    return [Change(section, key, f"{a.get(key)!r} -> {b.get(key)!r}") for key in keys if a.get(key) != b.get(key)]


# ----- plans ------------------------------------------------------------------------------------
def _type_label(tid: str, rec: Mapping[str, Any]) -> str:
    c = rec["collective"]
    return (
        f"{tid} ({rec['graph']}, {c['kind']} {c['bytes'] / 2**20:.1f} MiB, {len(rec['slots'])} slots, x{rec['count']})"
    )


def _config_text(clock: int, cfg: Mapping[str, Any] | None) -> str:
    if cfg is None:
        return f"{clock} MHz, un-split"
    where = "sequential" if cfg["launch_slot"] is None else f"slot {cfg['launch_slot']}"
    return f"{clock} MHz, {cfg['comm_sms']} SMs, {where}"


def _chosen(plan: Plan) -> dict[tuple[str, int], tuple[int, dict[str, Any] | None]]:
    """(stage/instruction key, microbatch) -> (clock, {type fingerprint: config} or None)."""
    point = plan.point_index("max-throughput")
    fingerprint_of = {tid: rec["fingerprint"] for tid, rec in plan.data["partition_types"].items()}
    out = {}
    for key, indices in plan.frontier[point]["choices"].items():
        for microbatch, index in enumerate(indices):
            option = plan.data["microbatch_options"][key][index]
            configs = (
                None
                if option["configs"] is None
                else {fingerprint_of[tid]: dict(cfg) for tid, cfg in option["configs"].items()}
            )
            out[(key, microbatch)] = (option["clock_mhz"], configs)
    return out


def _option_changes(
    a: tuple[int, dict[str, Any] | None],
    b: tuple[int, dict[str, Any] | None],
    name_a: Mapping[str, str],
    name_b: Mapping[str, str],
) -> tuple[tuple[str, str], ...]:
    """(label suffix, detail) of each difference between two chosen microbatch options."""
    (clock_a, cfg_a), (clock_b, cfg_b) = a, b
    found = []
    if clock_a != clock_b:
        found.append(("", f"clock {clock_a} -> {clock_b} MHz"))
    if (cfg_a is None) != (cfg_b is None):
        mode_a, mode_b = ("un-split" if cfg is None else "nanobatched" for cfg in (cfg_a, cfg_b))
        found.append(("", f"{mode_a} -> {mode_b}"))
        return tuple(found)
    for fp in sorted((cfg_a or {}).keys() | (cfg_b or {}).keys(), key=lambda f: name_a.get(f, name_b.get(f, f))):
        ca, cb = (cfg_a or {}).get(fp), (cfg_b or {}).get(fp)
        if ca != cb:
            old = "absent" if ca is None else _config_text(clock_a, ca)
            new = "absent" if cb is None else _config_text(clock_b, cb)
            found.append((f" {name_a.get(fp) or name_b.get(fp)}", f"{old} -> {new}"))
    return tuple(found)


def diff_plans(a: Plan, b: Plan) -> list[Change]:
    """Every difference :mod:`plan_diff` reports between plans ``a`` and ``b``."""
    changes: list[Change] = []
    changes += _value_changes("workload", a.workload, b.workload, sorted(set(a.workload) | set(b.workload)))
    changes += _value_changes("provenance", a.data, b.data, ("gpu", "profiler", "simulated", "kareus_fx_version"))

    # partition types by structure
    types_a = {rec["fingerprint"]: (tid, rec) for tid, rec in a.data["partition_types"].items()}
    types_b = {rec["fingerprint"]: (tid, rec) for tid, rec in b.data["partition_types"].items()}
    for fp in types_a.keys() - types_b.keys():
        changes.append(Change("partition types", "removed", _type_label(*types_a[fp])))
    for fp in types_b.keys() - types_a.keys():
        changes.append(Change("partition types", "added", _type_label(*types_b[fp])))
    for fp in sorted(types_a.keys() & types_b.keys(), key=lambda f: types_a[f][0]):
        (tid_a, rec_a), (tid_b, rec_b) = types_a[fp], types_b[fp]
        name = tid_a if tid_a == tid_b else f"{tid_a} (now {tid_b})"
        if rec_a["count"] != rec_b["count"]:
            changes.append(Change("partition types", name, f"count {rec_a['count']} -> {rec_b['count']}"))
        if rec_a["launch_slots"] != rec_b["launch_slots"]:
            changes.append(
                Change("partition types", name, f"launch slots {rec_a['launch_slots']} -> {rec_b['launch_slots']}")
            )
        ta, tb = rec_a.get("tuning") or {}, rec_b.get("tuning") or {}
        if ta.get("measured") != tb.get("measured") or ta.get("space_size") != tb.get("space_size"):
            changes.append(
                Change(
                    "tuning",
                    name,
                    f"measured {ta.get('measured')} of {ta.get('space_size')} -> "
                    f"{tb.get('measured')} of {tb.get('space_size')}",
                )
            )

    # configuration at max throughput, per (stage, instruction, microbatch), types by structure
    name_b = {rec["fingerprint"]: tid for tid, rec in b.data["partition_types"].items()}
    name_a = {rec["fingerprint"]: tid for tid, rec in a.data["partition_types"].items()}
    chosen_a, chosen_b = _chosen(a), _chosen(b)
    per_microbatch: dict[str, dict[int, tuple[tuple[str, str], ...]]] = {}
    for where in sorted(chosen_a.keys() | chosen_b.keys()):
        found: tuple[tuple[str, str], ...]
        if where not in chosen_a or where not in chosen_b:
            found = (("", "only in " + ("A" if where in chosen_a else "B")),)
        else:
            found = _option_changes(chosen_a[where], chosen_b[where], name_a, name_b)
        per_microbatch.setdefault(where[0], {})[where[1]] = found
    for key, by_microbatch in per_microbatch.items():
        groups: dict[tuple[tuple[str, str], ...], list[int]] = {}
        for microbatch, found in sorted(by_microbatch.items()):
            groups.setdefault(found, []).append(microbatch)
        for found, microbatches in groups.items():
            label = f"{key} microbatch{'es' if len(microbatches) > 1 else ''} {ranges_text(microbatches)}"
            changes += [Change("max-throughput configuration", f"{label}{suffix}", detail) for suffix, detail in found]

    # predicted time and energy, frontier, metrics
    pa, pb = a.frontier[a.point_index("max-throughput")], b.frontier[b.point_index("max-throughput")]
    for key, unit in (("time_s", "s"), ("energy_j", "J")):
        if pa[key] != pb[key]:
            changes.append(
                Change(
                    "max-throughput prediction",
                    key,
                    f"{pa[key]:.6g} -> {pb[key]:.6g} {unit} ({_relative(pa[key], pb[key])})",
                )
            )
    if len(a.frontier) != len(b.frontier):
        changes.append(Change("iteration frontier", "points", f"{len(a.frontier)} -> {len(b.frontier)}"))
    for method in sorted(set(a.data["methods"]) | set(b.data["methods"])):
        ma, mb = a.data["methods"].get(method), b.data["methods"].get(method)
        if ma is None or mb is None:
            changes.append(Change("metrics", method, "only in " + ("A" if mb is None else "B")))
            continue
        for metric in sorted(set(ma["metrics"]) | set(mb["metrics"])):
            va, vb = ma["metrics"].get(metric), mb["metrics"].get(metric)
            if va != vb:
                changes.append(Change("metrics", f"{method} {metric}", f"{_percent(va)} -> {_percent(vb)}"))
    return changes


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


# ----- dumps ------------------------------------------------------------------------------------
def diff_dumps(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[Change]:
    """Every difference :mod:`plan_diff` reports between graph dumps ``a`` and ``b``."""
    changes = _value_changes("dump", a, b, ("gpu", "world_size", "schema_version", "kareus_fx_version"))
    graphs_a = {g["name"]: g for g in a["graphs"]}
    graphs_b = {g["name"]: g for g in b["graphs"]}
    for name in sorted(graphs_a.keys() ^ graphs_b.keys()):
        changes.append(Change("graphs", name, "only in " + ("A" if name in graphs_a else "B")))
    for name in sorted(graphs_a.keys() & graphs_b.keys()):
        ga, gb = graphs_a[name], graphs_b[name]
        sa, sb = summarise_graph(ga), summarise_graph(gb)
        for field in ("nodes", "compute_bound_ops", "memory_bound_ops", "flops", "bytes"):
            va, vb = getattr(sa, field), getattr(sb, field)
            if va != vb:
                changes.append(Change(name, field, f"{va:.6g} -> {vb:.6g} ({_relative(va, vb)})"))
        if sa.collectives != sb.collectives:
            changes.append(Change(name, "collectives", f"{dict(sa.collectives)} -> {dict(sb.collectives)}"))
        types_a = {t["type"]: t for t in ga.get("partition_types") or []}
        types_b = {t["type"]: t for t in gb.get("partition_types") or []}
        for tid in sorted(types_a.keys() - types_b.keys()):
            changes.append(
                Change(name, "partition type removed", f"{tid} ({types_a[tid]['label']}, x{types_a[tid]['count']})")
            )
        for tid in sorted(types_b.keys() - types_a.keys()):
            changes.append(
                Change(name, "partition type added", f"{tid} ({types_b[tid]['label']}, x{types_b[tid]['count']})")
            )
        for tid in sorted(types_a.keys() & types_b.keys()):
            ta, tb = types_a[tid], types_b[tid]
            if ta["count"] != tb["count"]:
                changes.append(Change(name, f"partition type {tid}", f"count {ta['count']} -> {tb['count']}"))
            if ta["launch_slots"] != tb["launch_slots"]:
                changes.append(
                    Change(name, f"partition type {tid}", f"launch slots {ta['launch_slots']} -> {tb['launch_slots']}")
                )
        pa, pb = len(ga.get("partitions") or []), len(gb.get("partitions") or [])
        if pa != pb:
            changes.append(Change(name, "partitions", f"{pa} -> {pb}"))
        la, lb = ga.get("leftover") or {}, gb.get("leftover") or {}
        if len(la.get("nodes", [])) != len(lb.get("nodes", [])):
            changes.append(Change(name, "leftover ops", f"{len(la.get('nodes', []))} -> {len(lb.get('nodes', []))}"))
    return changes
