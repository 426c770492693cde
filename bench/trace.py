"""Wall time of tracing a reference model with backend="kareus" against "aot_eager", in one run.

Both backends run Dynamo + aot_autograd with the same partitioner and execute the graphs on the
meta device; the difference is what kareus adds (node analysis, and the dump when --dump).
Runs are interleaved (aot_eager, kareus, aot_eager, kareus, ...) after one small warm-up trace
per backend, and the ratio of medians is printed. Target: kareus adds at most 25%.

    python bench/trace.py [--model llama3.2-3b --tp 8 --mbs 8 --seq 4096 --layers 28] [--repeats 2] [--dump]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from kareus_fx.tracing import TraceSpec, trace_full_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-3b")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--mbs", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dump", action="store_true", help="also write the JSON dumps (kareus only)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    spec = TraceSpec(model=args.model, tp=args.tp, cp=args.cp, mbs=args.mbs, seq=args.seq, layers=args.layers)
    warmup = TraceSpec(model=args.model, tp=args.tp, cp=args.cp, mbs=args.mbs, seq=args.seq, layers=1)
    with tempfile.TemporaryDirectory() as tmp:
        kareus_options = {"dump_dir": tmp} if args.dump else {}
        for backend in ("aot_eager", "kareus"):
            trace_full_size(warmup, backend=backend, options=kareus_options if backend == "kareus" else None)
        times_s: dict[str, list[float]] = {"aot_eager": [], "kareus": []}
        for _ in range(args.repeats):
            times_s["aot_eager"].append(trace_full_size(spec, backend="aot_eager").wall_s)
            times_s["kareus"].append(trace_full_size(spec, backend="kareus", options=kareus_options).wall_s)

    median_s = {backend: statistics.median(values) for backend, values in times_s.items()}
    ratio = median_s["kareus"] / median_s["aot_eager"]
    result = {
        "spec": f"{spec.model} tp={spec.tp} cp={spec.cp} mbs={spec.mbs} seq={spec.seq} layers={spec.layers}",
        "dump": args.dump,
        "aot_eager_s": times_s["aot_eager"],
        "kareus_s": times_s["kareus"],
        "ratio_kareus_over_aot_eager": ratio,
        "target_ratio_max": 1.25,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"trace of {result['spec']} (forward + backward, meta device, fake process group)")
    print(f"  aot_eager: {', '.join(f'{t:.1f}' for t in times_s['aot_eager'])} s (median {median_s['aot_eager']:.1f} s)")
    print(f"  kareus{' +dump' if args.dump else ''}: {', '.join(f'{t:.1f}' for t in times_s['kareus'])} s "
          f"(median {median_s['kareus']:.1f} s)")
    print(f"  ratio kareus / aot_eager = {ratio:.3f} (target <= 1.25): {'OK' if ratio <= 1.25 else 'MISSED'}")


if __name__ == "__main__":
    main()
