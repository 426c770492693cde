"""MkDocs hook: the benchmark numbers of the docs, rendered from the committed results at build time.

A page writes ``<!-- results: NAME -->`` on a line of its own (indented inside a list item); the hook replaces it with the table
``NAME`` renders from ``bench/results/*.json`` or ``bench/baseline.json`` as committed. So the docs
show the numbers the last recorded bench run wrote, never a copy that can go stale, and a results
file whose shape changed fails the build (``mkdocs build --strict`` in the check command) with the
file and the marker named. Every number here is what a bench command printed; the pages say which
command and whether it is simulated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MARKER = re.compile(r"^( *)<!-- results: ([a-z_]+) -->$", re.MULTILINE)
"""A marker on a line of its own; its indentation (inside a list item) is kept for the table."""

METHODS = {
    "megatron+perseus": "M+P",
    "nanobatching+perseus": "N+P",
    "kareus": "Kareus",
}
END_TO_END_COLUMNS = {
    "mp_time_red": "M+P t",
    "np_time_red": "N+P t",
    "kareus_time_red": "K t",
    "mp_energy_red": "M+P e",
    "np_energy_red": "N+P e",
    "kareus_energy_red": "K e",
    "np_iso_time_energy_red": "N+P iso-t e",
    "kareus_iso_time_energy_red": "K iso-t e",
    "np_iso_energy_time_red": "N+P iso-e t",
    "kareus_iso_energy_time_red": "K iso-e t",
}
TARGETS_PP = {"time": 3, "energy": 3, "iso": 5, "ablation": 3}
"""bench/validate_end_to_end.py's targets per metric group (its ``TARGET_PP``), for the captions."""


def _load(name: str) -> Any:
    path = ROOT / name
    return json.loads(path.read_text())


def _pct(value: float | None, digits: int = 1) -> str:
    return "NA" if value is None else f"{value:.{digits}f}"


def _frac_pct(value: float | None, digits: int = 1) -> str:
    """A fraction as a percentage."""
    return "NA" if value is None else f"{100 * value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _end_to_end_rows(part: str) -> str:
    report = _load("bench/results/end_to_end.json")
    cells = report[f"{part}_cells"]
    rows = []
    for preset in dict.fromkeys(c["preset"] for c in cells):
        by_metric = {c["metric"]: c for c in cells if c["preset"] == preset}
        rows.append(
            [f"`{preset}`"]
            + [f"{_pct(by_metric[m]['paper'])} / {_pct(by_metric[m]['ours'])}" for m in END_TO_END_COLUMNS]
        )
    return _table(["preset (paper / ours, %)", *END_TO_END_COLUMNS.values()], rows)


def end_to_end_calibration() -> str:
    return _end_to_end_rows("calibration")


def end_to_end_validation() -> str:
    return _end_to_end_rows("validation")


def end_to_end_summary() -> str:
    """Cells within target per group, the largest and mean errors, calibration beside validation."""
    report = _load("bench/results/end_to_end.json")
    rows = []
    for group in ("time", "energy", "iso"):
        row = [f"{group} (target {TARGETS_PP[group]} pp)"]
        for part in ("validation", "calibration"):
            summary = report[part]
            row.append(
                f"{summary['within_target'][group]} of {summary['compared'][group]}, "
                f"max {summary['max_abs_err_pp'][group]:.1f}"
            )
        rows.append(row)
    ablation = report["validation"].get("ablation")
    if ablation:
        rows.append(
            [
                f"Table 8 ablation (target {TARGETS_PP['ablation']} pp)",
                f"{ablation['within_target']} of {ablation['compared']}, max {ablation['max_abs_err_pp']:.1f}",
                "",
            ]
        )
    rows.append(
        [
            "mean absolute error, all compared cells",
            f"{report['validation']['mean_abs_err_pp']:.2f} pp",
            f"{report['calibration']['mean_abs_err_pp']:.2f} pp",
        ]
    )
    not_below = report["validation"]["kareus_not_below"] + report["calibration"]["kareus_not_below"]
    rows.append(
        [
            "rows where Kareus is not >= N+P and >= M+P though the paper's is",
            ", ".join(f"`{r}`" for r in not_below) or "none",
            "",
        ]
    )
    return _table(["metric group", "validation rows: cells within target, max error (pp)", "calibration rows"], rows)


def end_to_end_ablation() -> str:
    cells = _load("bench/results/end_to_end.json")["ablation_cells"]
    rows = []
    for variant in dict.fromkeys(c["variant"] for c in cells):
        time, energy = (
            next(c for c in cells if c["variant"] == variant and c["metric"] == f"{kind}_increase")
            for kind in ("time", "energy")
        )
        rows.append(
            [
                variant.replace("_", " "),
                f"{_pct(time['paper'])} / {_pct(time['ours'])}",
                f"{_pct(energy['paper'])} / {_pct(energy['ours'])}",
            ]
        )
    return _table(["Table 8 variant (increase over Kareus, paper / ours, %)", "time", "energy"], rows)


def absolute_scale() -> str:
    report = _load("bench/results/absolute_scale.json")
    rows = [
        [
            row["method"],
            f"{row['paper']['time_s']:.2f} / {row['ours']['time_s']:.2f}",
            f"{row['paper']['total_j'] / 1e3:.1f} / {row['ours']['total_j'] / 1e3:.1f}",
            f"{row['paper_over_ours']['time']:.3f}",
            f"{row['paper_over_ours']['dynamic_power']:.3f}",
        ]
        for row in report["table1"]
    ]
    return _table(
        [
            "method (Table 1, Qwen CP2 x TP4 mbs16 4K)",
            "iteration s, paper / ours",
            "energy kJ, paper / ours",
            "time, paper / ours",
            "dynamic power, paper / ours",
        ],
        rows,
    )


def paper_tables() -> str:
    """Our simulated metrics for every preset ``bench/paper_tables.py`` planned."""
    report = _load("bench/results/paper_tables.json")
    rows = []
    for preset, entry in report.items():
        metrics = entry["metrics"]
        rows.append(
            [
                f"`{preset}`",
                entry["gpu"],
                *(
                    f"{_frac_pct(metrics[m]['max_throughput_time_reduction'])} / "
                    f"{_frac_pct(metrics[m]['max_throughput_energy_reduction'])}"
                    for m in METHODS
                ),
                _frac_pct(metrics["kareus"]["iso_time_energy_reduction"]),
                _frac_pct(metrics["kareus"]["iso_energy_time_reduction"]),
            ]
        )
    return _table(
        [
            "preset",
            "GPU (simulated)",
            *(f"{label} time / energy reduction at max throughput (%)" for label in METHODS.values()),
            "Kareus iso-time energy reduction vs M+P (%)",
            "Kareus iso-energy time reduction vs M+P (%)",
        ],
        rows,
    )


MOE_METHODS = {
    "megatron+perseus": "Megatron-LM + Perseus",
    "nanobatching": "nanobatching (two-microbatch overlap)",
    "nanobatching+perseus": "nanobatching + Perseus",
    "megatron+power-limit": "Zeus power limit",
    "kareus": "Kareus",
}


def moe_presets() -> str:
    """Every method's reductions against Megatron-LM on the presets ``bench/moe_presets.py`` planned."""
    report = _load("bench/results/moe_presets.json")
    rows = []
    for preset, entry in report.items():
        for method, label in MOE_METHODS.items():
            metrics = entry["metrics"].get(method)
            if metrics is None:
                continue
            rows.append(
                [
                    f"`{preset}`",
                    label,
                    _frac_pct(metrics["max_throughput_time_reduction"]),
                    _frac_pct(metrics["max_throughput_energy_reduction"]),
                    _frac_pct(metrics["iso_time_energy_reduction"]),
                    _frac_pct(metrics["iso_energy_time_reduction"]),
                ]
            )
    return _table(
        [
            "preset",
            "method",
            "time reduction at max throughput (%)",
            "energy reduction at max throughput (%)",
            "iso-time energy reduction vs M+P (%)",
            "iso-energy time reduction vs M+P (%)",
        ],
        rows,
    )


def stage_slack() -> str:
    report = _load("bench/results/stage_slack.json")
    rows = [
        [
            f"`{row['preset']}`",
            row["data"],
            f"{row['paper_mp_energy_red_pct']:.1f}",
            " / ".join(
                f"{'+'.join(map(str, s['stage_layers']))}: {s['ours_mp_energy_red_pct']:.1f} "
                f"({s['idle_share_pct']:.1f} idle)"
                for s in row["splits"]
            ),
            _pct(row.get("idle_share_pct_matching_paper")),
        ]
        for row in report["rows"]
    ]
    return _table(
        [
            "preset",
            "rows",
            "paper M+P energy reduction (%)",
            "ours per stage split: M+P energy reduction (faster stage idle share), %",
            "idle share matching the paper (%)",
        ],
        rows,
    )


def carbon_replay() -> str:
    """Time and carbon of each policy over the same work (bench/carbon_replay.py --json), per trace."""
    report = _load("bench/results/carbon_replay.json")

    def time_carbon(result: dict[str, float]) -> str:
        return f"{100 * result['time_increase']:+.2f} % / {-100 * result['carbon_reduction']:+.2f} %"

    def carbon(result: dict[str, float]) -> str:
        return f"{-100 * result['carbon_reduction']:+.2f} %"

    rows = []
    for trace, entry in report.items():
        vs_max, vs_megatron = entry["vs_always_max_throughput"], entry["vs_megatron"]
        rows.append(
            [
                trace,
                time_carbon(vs_max["kareus+carbon"]),
                time_carbon(entry["same_knob"]["kareus-power-limit+carbon vs its full power"]),
                time_carbon(vs_megatron["chase-power-limit"]),
                time_carbon(vs_megatron["kareus+carbon"]),
                f"{carbon(vs_max['kareus+carbon (foresight)'])} / {carbon(vs_megatron['chase-power-limit (foresight)'])}",
                f"{carbon(vs_max['kareus+carbon (clocks + power limits)'])} / "
                f"{carbon(vs_max['kareus+carbon (clocks + power limits) (foresight)'])}",
            ]
        )
    return _table(
        [
            "trace",
            "Kareus + carbon vs always-max-throughput (time / carbon)",
            "power limit only on Kareus's schedule vs its full power",
            "power limit only on Megatron-LM vs Megatron-LM at full power",
            "Kareus + carbon vs Megatron-LM",
            "perfect-foresight bounds, carbon (Kareus / power limit on Megatron-LM)",
            "Kareus over clocks + power limits, carbon (policy / bound)",
        ],
        rows,
    )


def carbon_verdicts() -> str:
    """bench/carbon_replay.py's verdicts per trace, with the trace's daily swing."""
    report = _load("bench/results/carbon_replay.json")
    names = list(dict.fromkeys(name for entry in report.values() for name in entry["verdicts"]))
    rows = [
        [trace, f"{100 * entry['daily_swing']:.0f} %", *("yes" if entry["verdicts"][n] else "no" for n in names)]
        for trace, entry in report.items()
    ]
    return _table(["trace", "daily swing (of the daily mean)", *(n.replace("_", " ") for n in names)], rows)


def straggler_replay() -> str:
    report = _load("bench/results/straggler_replay.json")
    return _table(
        ["replicas", "hours (with a straggler)", "energy, always-max-throughput / straggler policy (kWh)", "saved"],
        [
            [
                str(report["replicas"]),
                f"{report['hours']} ({report['hours_with_a_straggler']})",
                f"{report['energy_kwh']['always-max-throughput']:,.0f} / {report['energy_kwh']['straggler']:,.0f}",
                f"{100 * report['energy_reduction']:.2f} %",
            ]
        ],
    )


def step_time_cpu() -> str:
    report = _load("bench/results/step_time_cpu.json")
    inductor = report["median_step_s"]["inductor"]
    rows = [[name, f"{seconds:.2f}", f"{seconds / inductor:.3f}"] for name, seconds in report["median_step_s"].items()]
    caption = f"{report['machine']}; {report['steps']} steps, median; recorded {report['date']}"
    return _table(["version", "median step (s)", "/ Inductor"], rows) + f"\n\n{caption}."


def smoke_baseline() -> str:
    """The perf-regression baseline's metrics (``kareus bench --suite smoke``)."""
    baseline = _load("bench/baseline.json")
    rows = []
    for case, result in baseline["results"].items():
        for metric, value in result["metrics"].items():
            rows.append([f"`{case}`", f"`{metric}`", f"{value:.4g}"])
    return _table(["case", "metric", "baseline"], rows) + f"\n\nRecorded {baseline['updated_utc']}."


RENDERERS: dict[str, Callable[[], str]] = {
    render.__name__: render
    for render in (
        end_to_end_calibration,
        end_to_end_validation,
        end_to_end_summary,
        end_to_end_ablation,
        absolute_scale,
        paper_tables,
        moe_presets,
        stage_slack,
        carbon_replay,
        carbon_verdicts,
        straggler_replay,
        step_time_cpu,
        smoke_baseline,
    )
}


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replace each results marker of the page with its table."""

    def render(match: re.Match[str]) -> str:
        indent, name = match.group(1), match.group(2)
        if name not in RENDERERS:
            raise PluginError(f"{page.file.src_uri}: unknown results table {name!r} (known: {sorted(RENDERERS)})")
        try:
            table = RENDERERS[name]()
        except (KeyError, TypeError, ValueError, StopIteration, OSError) as error:
            raise PluginError(
                f"{page.file.src_uri}: results table {name!r} cannot be rendered from the committed results "
                f"(bench/results/, bench/baseline.json): {type(error).__name__}: {error}"
            ) from error
        return "\n".join(indent + line if line else line for line in table.split("\n"))

    return MARKER.sub(render, markdown)
