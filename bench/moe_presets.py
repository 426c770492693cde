"""The mixture-of-experts presets' metrics beside dense ones, every method, on the simulated GPU.

    python bench/moe_presets.py [--presets NAME ...] [--results bench/results/moe_presets.json] [--rerun] [--json]

For each preset it runs ``kareus plan`` in-process (seed 0) unless the results file already holds it
(``--rerun`` plans again), stores per method the paper's four metrics (``kareus_fx.plan.metrics``) and
the fastest point's iteration time and energy, the partition types whose collective is an all-to-all, and the
planning wall time, then prints one table. Every number is the simulated GPU's (a cost model, not a
measurement): the expert all-to-alls are priced from DeepEP's published bandwidths
(``cost_models/data/calibration/SOURCES.md``), at the routing load the preset states.

Method names of the MoE literature, as the plan's methods run them:

- Megatron-LM MoE, no overlap: ``megatron`` (the un-split microbatch, each collective alone);
- the two-microbatch overlap DeepSeek-V3 describes (one half's all-to-all beside the other half's
  computation): ``nanobatching``, and with Perseus's per-microbatch clock: ``nanobatching+perseus``;
- ``megatron+perseus``, ``kareus``, and Zeus's job-wide power limit on Megatron-LM: ``megatron+power-limit``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_tables import planned_presets

from kareus_fx.plan.planner import make_plan
from kareus_fx.plan.presets import PRESETS
from kareus_fx.plan.request import plan_request_from_preset

DEFAULT_RESULTS = Path(__file__).parent / "results" / "moe_presets.json"
MOE_PRESETS = tuple(name for name, preset in PRESETS.items() if preset.ep > 1)
DENSE_PRESETS = ("qwen3-1.7b-tp8-mbs8-seq4k",)
"""A dense testbed workload planned the same way, for scale."""
METHOD_LABELS = {
    "megatron": "Megatron-LM (MoE: no overlap)",
    "megatron+perseus": "Megatron-LM + Perseus",
    "nanobatching": "nanobatching (two-microbatch overlap)",
    "nanobatching+perseus": "nanobatching + Perseus",
    "megatron+power-limit": "Zeus power limit",
    "kareus": "Kareus",
}


def run_preset(name: str) -> dict:
    """Plan ``name`` and keep what the table shows."""
    started = time.perf_counter()
    outcome = make_plan(plan_request_from_preset(name), progress=False)
    wall_s = time.perf_counter() - started
    data = outcome.data
    all_to_all = {
        type_id: {"graph": record["graph"], "count": record["count"], "bytes": record["collective"]["bytes"]}
        for type_id, record in data["partition_types"].items()
        if record["collective"]["kind"] == "all_to_all"
    }
    return {
        "metrics": {m: d["metrics"] for m, d in data["methods"].items()},
        "fastest_point": {m: min(d["frontier"]) for m, d in data["methods"].items()},
        "all_to_all_partition_types": all_to_all,
        "partition_types": len(data["partition_types"]),
        "wall_s": wall_s,
        "profiler": data["profiler"],
        "gpu": data["gpu"],
    }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"


def table_rows(results: dict) -> list[str]:
    """One row per (preset, method): the four reductions in percent (against Megatron-LM for
    max-throughput, against Megatron-LM + Perseus for iso-time energy and iso-energy time)."""
    rows = [
        "| preset | method | max-tput time | max-tput energy | iso-time energy | iso-energy time |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for method, label in METHOD_LABELS.items():
            m = result["metrics"].get(method)
            if m is None:
                continue
            cells = [
                _pct(m[k])
                for k in (
                    "max_throughput_time_reduction",
                    "max_throughput_energy_reduction",
                    "iso_time_energy_reduction",
                    "iso_energy_time_reduction",
                )
            ]
            rows.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", default=[*MOE_PRESETS, *DENSE_PRESETS])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--rerun", action="store_true", help="plan again even if the results file has the preset")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    unknown = [name for name in args.presets if name not in PRESETS]
    if unknown:
        parser.error(f"unknown preset {unknown[0]!r}")
    results = planned_presets(args.presets, args.results, args.rerun, run_preset)
    shown = {name: results[name] for name in args.presets if name in results}
    if args.json:
        print(json.dumps(shown))
        return 0
    print("\n".join(table_rows(shown)))
    print()
    for name, result in shown.items():
        types = result["all_to_all_partition_types"]
        print(
            f"{name}: {len(types)} of {result['partition_types']} partition types overlap an all-to-all; "
            f"planned in {result['wall_s']:.1f} s ({result['profiler']} {result['gpu']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
