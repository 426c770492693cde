"""Wall time of tracing a reference model with backend="kareus" against "aot_eager", in one run.

Both backends run Dynamo + aot_autograd with the same partitioner and execute the graphs on the
meta device. Two kareus rows: "capture" (options nanobatch=False: node analysis, and the dump
when --dump) is what the capture adds, target at most 25% over aot_eager; "nanobatched" (the
default backend) also splits the graph into two nanobatches, which doubles the graphs that
Dynamo's output goes through in aot_autograd, and partitions and reorders them.
Runs are interleaved after one small warm-up trace per configuration; medians are compared.

    python bench/trace.py [--model llama3.2-3b --tp 8 --mbs 8 --seq 4096 --layers 28] [--repeats 1] [--dump] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from kareus_fx.capture.tracing import BENCH_TRACE_SPEC, add_trace_arguments, trace_full_size, trace_spec_from_args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_arguments(parser, BENCH_TRACE_SPEC)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dump", action="store_true", help="also write the JSON dumps (kareus only)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    spec = trace_spec_from_args(args)
    warmup = trace_spec_from_args(args, layers=1)
    with tempfile.TemporaryDirectory() as tmp:
        dump = {"dump_dir": tmp} if args.dump else {}
        configs: dict[str, tuple[str, dict | None]] = {
            "aot_eager": ("aot_eager", None),
            "kareus capture": ("kareus", {**dump, "nanobatch": False}),
            "kareus nanobatched": ("kareus", {**dump}),
        }
        for backend, options in configs.values():
            trace_full_size(warmup, backend=backend, options=options)
        times_s: dict[str, list[float]] = {label: [] for label in configs}
        for _ in range(args.repeats):
            for label, (backend, options) in configs.items():
                times_s[label].append(trace_full_size(spec, backend=backend, options=options).wall_s)

    median_s = {label: statistics.median(values) for label, values in times_s.items()}
    ratios = {label: median_s[label] / median_s["aot_eager"] for label in configs if label != "aot_eager"}
    result = {
        "spec": f"{spec.model} tp={spec.tp} cp={spec.cp} mbs={spec.mbs} seq={spec.seq} layers={spec.layers}",
        "dump": args.dump,
        "times_s": times_s,
        "ratio_over_aot_eager": ratios,
        "target_capture_ratio_max": 1.25,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"trace of {result['spec']} (forward + backward, meta device, fake process group)")
    for label, values in times_s.items():
        ratio = "" if label == "aot_eager" else f"  ratio over aot_eager {ratios[label]:.3f}"
        print(f"  {label:20s} {', '.join(f'{t:.1f}' for t in values)} s (median {median_s[label]:.1f} s){ratio}")
    verdict = "OK" if ratios["kareus capture"] <= 1.25 else "MISSED"
    print(f"  capture ratio {ratios['kareus capture']:.3f} (target <= 1.25): {verdict}")


if __name__ == "__main__":
    main()
