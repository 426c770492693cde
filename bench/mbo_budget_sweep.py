"""How much MBO measures against how close it gets to the exhaustive frontier, per budget setting.

    python bench/mbo_budget_sweep.py --preset llama3.2-3b-tp8-mbs8-seq4k --seeds 4 [--json]

Runs :func:`mbo_quality.evaluate_type` (exhaustive table, MBO seeds, random search at the same
number of measurements) for every partition type of the preset under each named setting of
``SETTINGS`` and prints, per setting, the measurements of all types together and each type's mean
and worst strict HV ratio. Used to choose :data:`kareus_fx.tuner.mbo.DEFAULT_BUDGETS` and to re-check the
stopping threshold on presets other than the one the profiling cost is reported on (the numbers
are in that module's docstring). Every number comes from the simulated GPU (a cost model).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mbo_quality import DEFAULT_CACHE_DIR, evaluate_type, load_types

from kareus_fx.tuner.mbo import Budget, MBOSettings, size_class


def _budgets(
    small: tuple[int, int, int], medium: tuple[int, int, int], large: tuple[int, int, int]
) -> dict[str, Budget]:
    return {"small": Budget(*small), "medium": Budget(*medium), "large": Budget(*large)}


BEFORE = MBOSettings(budgets=_budgets((16, 8, 5), (24, 12, 6), (40, 20, 6)))
"""The earlier settings (large partitions: batches of 20), for comparison."""


def _large(n_init: int, batch_size: int) -> MBOSettings:
    """The defaults with the large class's initial sample and batch replaced (6 batches)."""
    return replace(BEFORE, budgets=_budgets((16, 8, 5), (24, 12, 6), (n_init, batch_size, 6)))


SETTINGS: dict[str, MBOSettings] = {
    "before": BEFORE,
    "default": MBOSettings(),
    **{f"large-{n}x{b}": _large(n, b) for n, b in ((40, 10), (40, 8), (32, 10), (28, 12), (24, 12), (24, 10))},
    "threshold-0.005": MBOSettings(threshold=0.005),
    "threshold-0.01": MBOSettings(threshold=0.01),
    # The coarser grid of `kareus plan --clock-stride 60` (fewer GPU-hours), scored against its
    # own exhaustive search; against the 30 MHz one: mbo_quality.py --tune-clock-stride 60.
    "stride-60": MBOSettings(clock_stride_mhz=60),
    "stride-60-cap-0.25": MBOSettings(clock_stride_mhz=60, max_fraction=0.25),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--random-seeds", type=int, default=3)
    parser.add_argument("--gpu", default="A100-SXM4-40GB")
    parser.add_argument("--size", choices=("small", "medium", "large"), help="only types of this size class")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    types, profiler = load_types(args.preset, args.gpu, 0.0, 4, DEFAULT_CACHE_DIR)
    if args.size:
        types = [t for t in types if size_class(t.ptype) == args.size]
    out: dict[str, dict] = {}
    for name in args.settings:
        rows = [evaluate_type(t.ptype, profiler, SETTINGS[name], args.seeds, args.random_seeds) for t in types]
        out[name] = {
            "measured": sum(r["measured"] for r in rows),
            "hv_ratio": [round(r["hv_ratio"], 4) for r in rows],
            "hv_ratio_min": [round(r["hv_ratio_min"], 4) for r in rows],
            "random_hv_ratio": [round(r["random_hv_ratio"], 4) for r in rows],
            "beats_random": [f"{r['beats_random']}/{args.seeds}" for r in rows],
            "measured_per_type": [r["measured"] for r in rows],
        }
        if not args.json:
            o = out[name]
            print(
                f"{args.preset} {name:12s} measured {o['measured']:6.1f}  worst mean {min(o['hv_ratio']):.4f}"
                f"  worst seed {min(o['hv_ratio_min']):.4f}  per type {o['hv_ratio']}  random {o['random_hv_ratio']}"
                f"  wins {o['beats_random']}  n {o['measured_per_type']}",
                flush=True,
            )
    if args.json:
        json.dump({"preset": args.preset, "seeds": args.seeds, "settings": out}, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
