"""MBO frontier quality against exhaustive search and random search, per partition type.

    python bench/mbo_quality.py --preset llama3.2-3b-tp8-mbs8-seq4k [--json] [--seeds 5]
    python bench/mbo_quality.py --preset qwen3-1.7b-tp8-mbs8-seq4k
    python bench/mbo_quality.py --preset synthetic

Partition types: a preset of :mod:`kareus_fx.plan.presets` is traced at its tp / cp / microbatch size /
sequence length on the meta device with ``--layers`` layers (default 4; the types of a transformer
do not depend on the layer count, only their counts do: ``--verify-layers N`` traces N layers too
and checks that the types are the same), and the types are read back from the graph dump
(:func:`kareus_fx.capture.dump.partition_types_from_dump`), forward and backward. The dump is cached under
``--cache-dir`` keyed by preset, layers, GPU and a hash of the tracing code (``--retrace`` ignores
the cache). ``synthetic`` is the analytic types of :mod:`kareus_fx.tuner.synthetic` on their
analytic profiler; every other preset is measured on the simulated GPU
(:class:`~kareus_fx.cost_models.simulated_profiler.SimulatedProfiler`, a calibrated cost model,
not a real GPU).

For every type every configuration is measured once (the exhaustive frontier); MBO and random
search then read those same measurements (a table profiler), so the three are compared on identical
numbers. Per type it reports:

- ``hv_ratio``: HV(MBO's measured frontier) / HV(exhaustive frontier), mean over MBO seeds (and
  ``hv_ratio_min``, the worst seed), on normalised (time, total energy) with the reference point
  10 % (of the space's range) beyond the worst point *of the exhaustive frontier* (strict: only the
  region near the frontier counts); ``hv_ratio_loose`` uses a reference 10 % beyond the worst point
  of the whole space (random search also scores about 0.99 on it);
- ``measured`` / ``fraction``: configurations MBO measured (mean over seeds) and their share;
- ``random_hv_ratio``: random search with the same number of measurements as the MBO run of each
  seed, ``--random-seeds`` draws per MBO seed, mean (``random_hv_ratio_min``: worst draw);
  ``beats_random``: the number of MBO seeds whose HV ratio exceeds the mean of their random draws;
- ``frontier_sources``: share of MBO's final frontier found by each pass (mean over seeds);
- ``acq_seconds_per_batch``: surrogate training + acquisition time per batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kareus_fx.tuner import MBOSettings, exhaustive_search, frontier_hv_ratio, random_search, tune_partition
from kareus_fx.tuner.mbo import SOURCES
from kareus_fx.workload import Measurement, PartitionConfig, PartitionType, Profiler

SYNTHETIC = "synthetic"
DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / "kareus-fx-mbo-quality"


@dataclass
class TableProfiler:
    """Answers from a table of measurements (one per config) and counts the calls."""

    gpu_name: str
    table: dict[tuple[str, PartitionConfig], Measurement]
    calls: int = 0

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        self.calls += 1
        return self.table[(ptype.type_id, config)]


@dataclass(frozen=True)
class LabelledType:
    ptype: PartitionType
    label: str


def _tracing_code_hash() -> str:
    """Hash of torch's version and of every kareus_fx module that tracing and the dump import (the
    code that decides the partition types; the tuner's modules are left out)."""
    import importlib

    import torch

    for name in (
        "kareus_fx.capture.backend",
        "kareus_fx.capture.tracing",
        "kareus_fx.capture.dump",
        "kareus_fx.models",
    ):
        importlib.import_module(name)
    files = sorted(
        {
            Path(module.__file__)
            for name, module in list(sys.modules.items())
            if name.startswith("kareus_fx")
            and not name.startswith("kareus_fx.tuner")
            and getattr(module, "__file__", None)
        }
    )
    digest = hashlib.sha256(torch.__version__.encode())
    for path in files:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _trace_dump(preset_name: str, gpu: str, layers: int, cache_dir: Path | None) -> Path:
    """Path of the (cached) graph dump of ``preset_name`` traced with ``layers`` layers."""
    from kareus_fx.capture.tracing import TraceSpec, trace_full_size
    from kareus_fx.plan.presets import get_preset

    preset = get_preset(preset_name)
    cached = None
    if cache_dir is not None:
        cached = cache_dir / f"{preset.name}-L{layers}-{gpu}-{_tracing_code_hash()}.json"
        if cached.exists():
            return cached
    spec = TraceSpec(model=preset.model, tp=preset.tp, cp=preset.cp, mbs=preset.mbs, seq=preset.seq, layers=layers)
    out = Path(tempfile.mkdtemp(prefix="kareus-mbo-trace-"))
    print(f"tracing {preset.name} with {layers} layers on meta ...", file=sys.stderr, flush=True)
    (path,) = trace_full_size(spec, options={"dump_dir": str(out), "gpu": gpu}).dump_paths
    if cached is None:
        return path
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, cached)
    shutil.rmtree(out, ignore_errors=True)
    return cached


def traced_types(preset_name: str, gpu: str, layers: int, cache_dir: Path | None) -> list[LabelledType]:
    """Every partition type of the preset's forward and backward graphs, in dump order."""
    from kareus_fx.capture.dump import load_dump, partition_types_from_dump

    dump = load_dump(_trace_dump(preset_name, gpu, layers, cache_dir))
    types = partition_types_from_dump(dump)
    labels = {
        rec["type"]: f"{graph['name']} {rec['label']}"
        for graph in dump["graphs"]
        for rec in graph.get("partition_types") or []
    }
    return [LabelledType(t, labels[tid]) for tid, t in types.items()]


def verify_layer_independence(
    preset_name: str, gpu: str, layers: int, more_layers: int, cache_dir: Path | None
) -> None:
    """Check that tracing ``more_layers`` layers gives the same partition types (ids, structure,
    launch slots); raise ``SystemExit`` naming the difference otherwise."""
    from kareus_fx.cost_models.profile_db import fingerprint

    def shape(types: list[LabelledType]) -> dict[str, tuple]:
        return {t.ptype.type_id: (fingerprint(t.ptype), t.ptype.graph, t.ptype.launch_slots) for t in types}

    few = shape(traced_types(preset_name, gpu, layers, cache_dir))
    many = shape(traced_types(preset_name, gpu, more_layers, cache_dir))
    if few != many:
        raise SystemExit(
            f"{preset_name}: partition types differ between {layers} and {more_layers} layers: "
            f"{sorted(set(few.items()) ^ set(many.items()))}"
        )
    print(
        f"{preset_name}: {len(few)} partition types, identical with {layers} and {more_layers} layers", file=sys.stderr
    )


def load_types(
    preset: str, gpu: str, noise: float, layers: int, cache_dir: Path | None
) -> tuple[list[LabelledType], Profiler]:
    if preset == SYNTHETIC:
        from kareus_fx.tuner.synthetic import SyntheticProfiler, synthetic_partition_types

        types = [LabelledType(t, "analytic") for t in synthetic_partition_types()]
        return types, SyntheticProfiler(gpu, noise_std=noise, seed=0)
    from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler

    return traced_types(preset, gpu, layers, cache_dir), SimulatedProfiler(gpu, noise_std=noise, seed=0)


def evaluate_type(
    ptype: PartitionType,
    profiler: Profiler,
    settings: MBOSettings,
    seeds: int,
    random_seeds: int,
    tune_settings: MBOSettings | None = None,
) -> dict:
    """``tune_settings`` (default ``settings``): the space MBO and random search draw from, a subset
    of ``settings``' (a coarser clock grid); the HV ratios are against ``settings``' exhaustive frontier."""
    tune_settings = tune_settings or settings
    exhaustive = exhaustive_search(ptype, profiler, settings=settings)
    table = TableProfiler(profiler.gpu_name, {(ptype.type_id, p.config): p.measurement for p in exhaustive.points})
    strict, loose, measured, rnd, rnd_loose, acq, batches, stops, wins = [], [], [], [], [], [], [], [], 0
    sources: dict[str, list[float]] = {}
    for seed in range(seeds):
        res = tune_partition(ptype, table, settings=tune_settings, seed=seed)
        strict.append(frontier_hv_ratio(res, exhaustive))
        loose.append(frontier_hv_ratio(res, exhaustive, strict=False))
        measured.append(res.stats.measured)
        acq.extend(res.stats.acq_seconds)
        batches.append(res.stats.batches)
        stops.append(res.stats.stop_reason)
        for name, share in res.frontier_sources().items():
            sources.setdefault(name, [0.0] * seeds)[seed] = share
        seed_rnd = []
        for r in range(random_seeds):
            base = random_search(ptype, table, res.stats.measured, settings=tune_settings, seed=1000 * seed + r)
            seed_rnd.append(frontier_hv_ratio(base, exhaustive))
            rnd_loose.append(frontier_hv_ratio(base, exhaustive, strict=False))
        rnd.extend(seed_rnd)
        wins += int(strict[-1] > np.mean(seed_rnd))
    space = exhaustive.stats.space_size
    return {
        "type": ptype.type_id,
        "graph": ptype.graph,
        "slots": len(ptype.slots),
        "space_size": space,
        "frontier_size": len(exhaustive.frontier),
        "measured": float(np.mean(measured)),
        "measured_max": int(np.max(measured)),
        "fraction": float(np.mean(measured)) / space,
        "fraction_max": float(np.max(measured)) / space,
        "hv_ratio": float(np.mean(strict)),
        "hv_ratio_min": float(np.min(strict)),
        "hv_ratio_per_seed": [float(v) for v in strict],
        "hv_ratio_loose": float(np.mean(loose)),
        "random_hv_ratio": float(np.mean(rnd)),
        "random_hv_ratio_min": float(np.min(rnd)),
        "random_hv_ratio_loose": float(np.mean(rnd_loose)),
        "beats_random": wins,
        "batches": float(np.mean(batches)),
        "stop_reasons": stops,
        "frontier_sources": {k: float(np.mean(v)) for k, v in sources.items()},
        "acq_seconds_per_batch": float(np.mean(acq)) if acq else 0.0,
        "acq_seconds_per_batch_max": float(np.max(acq)) if acq else 0.0,
        "acq_batches": len(acq),
    }


def _print_row(row: dict, label: str) -> None:
    print(
        f"{row['type']:30s} {row['slots']:2d} {row['space_size']:5d} {row['measured']:6.1f} "
        f"{100 * row['fraction']:5.1f} %  {row['hv_ratio']:.4f} {row['hv_ratio_min']:.4f}  "
        f"{row['random_hv_ratio']:.4f} {row['random_hv_ratio_min']:.4f}  "
        f"{row['beats_random']}/{len(row['stop_reasons'])}  {label}",
        flush=True,
    )
    stops = {s: row["stop_reasons"].count(s) for s in dict.fromkeys(row["stop_reasons"])}
    print(
        f"{'':33s}batches {row['batches']:.1f}, stops: " + ", ".join(f"{s} x{n}" for s, n in stops.items()), flush=True
    )


def main(argv: list[str] | None = None) -> int:
    from kareus_fx.plan.presets import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        choices=[SYNTHETIC, *PRESETS],
        required=True,
        metavar="NAME",
        help=f"a preset of kareus_fx.plan.presets (e.g. llama3.2-3b-tp8-mbs8-seq4k) or {SYNTHETIC}",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--gpu", default="A100-SXM4-40GB")
    parser.add_argument("--seeds", type=int, default=5, help="MBO seeds per type")
    parser.add_argument("--random-seeds", type=int, default=5, help="random-search draws per MBO seed")
    parser.add_argument("--noise", type=float, default=0.0, help="profiler noise std (relative)")
    parser.add_argument("--layers", type=int, default=4, help="layers to trace (types do not depend on it)")
    parser.add_argument(
        "--verify-layers", type=int, metavar="N", help="also trace N layers and check the partition types are the same"
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="where traced dumps are kept")
    parser.add_argument("--retrace", action="store_true", help="trace even if a cached dump exists")
    parser.add_argument(
        "--tune-clock-stride",
        type=int,
        metavar="MHZ",
        help="MBO and random search on this clock grid (e.g. 60, kareus plan --clock-stride), "
        "scored against the exhaustive search of the paper's 30 MHz grid",
    )
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    cache_dir = None if args.retrace else args.cache_dir
    if args.verify_layers and args.preset != SYNTHETIC:
        verify_layer_independence(args.preset, args.gpu, args.layers, args.verify_layers, cache_dir)
    types, profiler = load_types(args.preset, args.gpu, args.noise, args.layers, cache_dir)
    settings = MBOSettings()
    tune_settings = (
        dataclasses.replace(settings, clock_stride_mhz=args.tune_clock_stride) if args.tune_clock_stride else settings
    )
    if not args.json:
        print(
            f"{args.preset} on the {'analytic' if args.preset == SYNTHETIC else 'simulated'} "
            f"{profiler.gpu_name}, {args.seeds} MBO seeds x {args.random_seeds} random draws"
        )
        print(f"{'type':30s} sl space  meas. share    HV mean  min     random  min     wins")
    rows = []
    for lt in types:
        rows.append(evaluate_type(lt.ptype, profiler, settings, args.seeds, args.random_seeds, tune_settings))
        rows[-1]["label"] = lt.label
        if not args.json:
            _print_row(rows[-1], lt.label)
    shares = {s: float(np.mean([r["frontier_sources"].get(s, 0.0) for r in rows])) for s in SOURCES}
    shares = {s: v for s, v in shares.items() if v > 0}
    n_acq = sum(r["acq_batches"] for r in rows)
    summary = {
        "preset": args.preset,
        "gpu": profiler.gpu_name,
        "seeds": args.seeds,
        "random_seeds": args.random_seeds,
        "noise_std": args.noise,
        "tune_clock_stride_mhz": tune_settings.clock_stride_mhz,
        "types": rows,
        "frontier_sources": shares,
        "acq_seconds_per_batch": (
            sum(r["acq_seconds_per_batch"] * r["acq_batches"] for r in rows) / n_acq if n_acq else 0.0
        ),
        "acq_seconds_per_batch_max": max((r["acq_seconds_per_batch_max"] for r in rows), default=0.0),
        "wall_seconds": time.perf_counter() - t0,
    }
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
        return 0
    print(
        "share of the final frontier by pass (mean over types and seeds): "
        + ", ".join(f"{k} {100 * v:.0f} %" for k, v in shares.items())
    )
    print(
        f"surrogate + acquisition {summary['acq_seconds_per_batch']:.2f} s/batch on average "
        f"(max {summary['acq_seconds_per_batch_max']:.2f}); {summary['wall_seconds']:.0f} s in all"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
