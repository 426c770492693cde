"""Time of kareus's graph passes against the whole trace, in one run.

Traces a reference model at full size (meta device, fake process group) with backend="kareus"
and times, inside that same trace, the nanobatch split (Dynamo graph), the nanobatch labels,
the partition pass and the issue-order reorder (aten graphs). Prints passes / trace as a ratio.
Target: the passes take at most 10% of the trace time.

    python bench/passes.py [--model llama3.2-3b --tp 8 --mbs 8 --seq 4096 --layers 28] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import kareus_fx.capture.compile_step as compile_step
from kareus_fx.capture.tracing import BENCH_TRACE_SPEC, add_trace_arguments, trace_full_size, trace_spec_from_args

_TIMED = ("split_nanobatches", "label_nanobatches", "partition_graph", "apply_issue_order")


def _timed(name: str, fn: Callable[..., Any], totals_s: dict[str, float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start_s = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals_s[name] += time.perf_counter() - start_s

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_arguments(parser, BENCH_TRACE_SPEC)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    spec = trace_spec_from_args(args)

    trace_full_size(trace_spec_from_args(args, layers=1))
    totals_s: dict[str, float] = defaultdict(float)
    originals = {name: getattr(compile_step, name) for name in _TIMED}
    for name, fn in originals.items():
        setattr(compile_step, name, _timed(name, fn, totals_s))
    try:
        trace_s = trace_full_size(spec).wall_s
    finally:
        for name, fn in originals.items():
            setattr(compile_step, name, fn)

    passes_s = sum(totals_s.values())
    result = {
        "spec": f"{spec.model} tp={spec.tp} cp={spec.cp} mbs={spec.mbs} seq={spec.seq} layers={spec.layers}",
        "trace_s": trace_s,
        "passes_s": passes_s,
        "per_pass_s": dict(totals_s),
        "ratio_passes_over_trace": passes_s / trace_s,
        "target_ratio_max": 0.10,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"trace of {result['spec']} with backend='kareus' (Dynamo + aot_autograd + passes, fwd + bwd): {trace_s:.1f} s"
    )
    for name in _TIMED:
        print(f"  {name:20s} {totals_s[name]:6.2f} s")
    ratio = result["ratio_passes_over_trace"]
    print(f"  passes / trace = {ratio:.3f} (target <= 0.10): {'OK' if ratio <= 0.10 else 'MISSED'}")


if __name__ == "__main__":
    main()
