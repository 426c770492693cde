"""What a plan shows people: the metrics table, the frontier plot, frontier.csv and report.html.

Everything here reads only the plan's JSON (``plan_format``), so a plan can be rendered anywhere
without the model or the profiler.
"""

from __future__ import annotations

import base64
import csv
import html
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.table import Table

from kareus_fx.report.figure_png import figure_png

__all__ = [
    "METRIC_LABELS",
    "frontier_png",
    "metrics_table",
    "report_html",
    "write_frontier_csv",
    "write_report_html",
]

METRIC_LABELS = {
    "max_throughput_time_reduction": "max-throughput time reduction vs Megatron-LM",
    "max_throughput_energy_reduction": "max-throughput energy reduction vs Megatron-LM",
    "iso_time_energy_reduction": "iso-time energy reduction vs Megatron-LM + Perseus",
    "iso_energy_time_reduction": "iso-energy time reduction vs Megatron-LM + Perseus",
}
_METHOD_STYLE = {
    "megatron": ("Megatron-LM", "black", "s"),
    "megatron+perseus": ("Megatron-LM + Perseus", "tab:blue", "o"),
    "nanobatching": ("Nanobatching", "tab:gray", "D"),
    "nanobatching+perseus": ("Nanobatching + Perseus", "tab:orange", "^"),
    "kareus": ("Kareus", "tab:green", "v"),
    "megatron+power-limit": ("Megatron-LM + power limit (Zeus)", "tab:red", "x"),
}


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _fastest(method: Mapping[str, Any]) -> tuple[float, float]:
    return min((tuple(p) for p in method["frontier"]), key=lambda p: (p[0], p[1]))


def _provenance(plan: Mapping[str, Any]) -> str:
    w = plan["workload"]
    source = "simulated GPU (a calibrated cost model, not a measurement)" if plan.get("simulated") else plan["profiler"]
    return (
        f"{w['model']} TP{w['tp']} CP{w['cp']} PP{w['pp']} DP{w.get('dp', 1)}, {w['microbatches']} microbatches of "
        f"{w['mbs']} x {w['seq']} tokens, {plan['gpu']}; times and energies from the {source}; "
        f"energy of {plan['energy_scope']}"
    )


def profiling_text(plan: Mapping[str, Any]) -> str:
    """One line: what the plan's measurements cost or would cost on the device (empty for an old plan)."""
    p = plan.get("profiling")
    if not p:
        return ""
    window = (
        ""
        if p.get("window_s") is None or p.get("cooldown_s") is None
        else f" ({p['window_s']:g} s window + {p['cooldown_s']:g} s cooldown each)"
    )
    split = p.get("by_purpose")
    purposes = f" ({', '.join(f'{k} {v}' for k, v in split.items())})" if split else ""
    return (
        f"profiling: {p['measurements']} measurements{purposes}{window}, {p['duplicates']} duplicates, "
        f"{p['groups']} parallel group(s): {p['wall_s_on_device'] / 3600:.2f} h on the device, {p['gpu_hours']:.1f} GPU-hours"
        + (f"; {p['device']}" if p.get("device") else "")
    )


def metrics_table(plan: Mapping[str, Any]) -> Table:
    """Per method: fastest iteration time and its energy, and the four reductions."""
    table = Table(title="iteration time and energy per method", caption=_provenance(plan))
    table.add_column("method")
    table.add_column("fastest time (s)", justify="right")
    table.add_column("energy there (kJ)", justify="right")
    for key in METRIC_LABELS:
        table.add_column(key.replace("_", " "), justify="right")
    for name, method in plan["methods"].items():
        t, e = _fastest(method)
        table.add_row(
            _METHOD_STYLE.get(name, (name,))[0],
            f"{t:.4f}",
            f"{e / 1e3:.3f}",
            *(_percent(method["metrics"].get(k)) for k in METRIC_LABELS),
        )
    return table


def write_frontier_csv(plan: Mapping[str, Any], path: str | Path) -> Path:
    """``method,time_s,energy_j``: every method's iteration frontier, fastest first."""
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "time_s", "energy_j"])
        for name, method in plan["methods"].items():
            for t, e in method["frontier"]:
                writer.writerow([name, repr(float(t)), repr(float(e))])
    return path


def frontier_png(plan: Mapping[str, Any]) -> bytes:
    """The iteration time-energy frontiers of every method as a PNG image."""

    def draw(ax: Any) -> None:
        for name, method in plan["methods"].items():
            label, color, marker = _METHOD_STYLE.get(name, (name, None, "."))
            points = sorted(tuple(p) for p in method["frontier"])
            ax.plot(
                [p[0] for p in points],
                [p[1] / 1e3 for p in points],
                marker=marker,
                markersize=4,
                linewidth=1.2,
                color=color,
                label=label,
            )
        ax.set_xlabel("iteration time (s)")
        ax.set_ylabel("iteration energy (kJ)")
        w = plan["workload"]
        ax.set_title(
            f"{w['model']} TP{w['tp']} CP{w['cp']} PP{w['pp']} mbs{w['mbs']} seq{w['seq']}"
            + (" (simulated GPU)" if plan.get("simulated") else "")
        )
        ax.grid(alpha=0.3)
        ax.legend()

    return figure_png(draw, figsize=(7, 4.5))


def _metrics_html(plan: Mapping[str, Any]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for label in METRIC_LABELS.values())
    rows = []
    for name, method in plan["methods"].items():
        t, e = _fastest(method)
        cells = "".join(f"<td>{_percent(method['metrics'].get(k))}</td>" for k in METRIC_LABELS)
        rows.append(
            f"<tr><td>{html.escape(_METHOD_STYLE.get(name, (name,))[0])}</td>"
            f"<td>{t:.4f}</td><td>{e / 1e3:.3f}</td>{cells}</tr>"
        )
    return (
        f"<table><tr><th>method</th><th>fastest time (s)</th><th>energy there (kJ)</th>{head}</tr>"
        f"{''.join(rows)}</table>"
    )


def report_html(plan: Mapping[str, Any], png: bytes | None = None, extra_sections: str = "") -> str:
    """A self-contained HTML page: provenance, the frontier image (inline PNG), the metrics.

    ``png``: the frontier image if already rendered; ``extra_sections``: trusted HTML appended."""
    image = base64.b64encode(png if png is not None else frontier_png(plan)).decode()
    w = plan["workload"]
    title = f"kareus plan: {w['model']} TP{w['tp']} CP{w['cp']} PP{w['pp']}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:75em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #bbb;padding:.3em .6em;text-align:right}}th{{background:#eee}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>{html.escape(_provenance(plan))}</p>
<h2>Iteration time-energy frontiers</h2>
<img id="frontier" alt="iteration time-energy frontiers" src="data:image/png;base64,{image}">
<h2>Metrics</h2>
{_metrics_html(plan)}
<h2>Profiling cost</h2>
<p id="profiling">{html.escape(profiling_text(plan) or "not recorded in this plan")}</p>
{extra_sections}
</body></html>
"""


def write_report_html(plan: Mapping[str, Any], out_dir: str | Path) -> Path:
    """Write ``report.html`` (self-contained) and ``frontier.png`` beside it into ``out_dir``."""
    out = Path(out_dir)
    png = frontier_png(plan)
    (out / "frontier.png").write_bytes(png)
    path = out / "report.html"
    path.write_text(report_html(plan, png))
    return path
