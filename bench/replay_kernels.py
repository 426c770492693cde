"""How many kernels (and input buffers) the on-device profiler holds to replay an un-split microbatch.

Traces tiny-llama (TP=2, microbatch 2 x 64) un-split at several layer counts and prints, per
graph, the ops replayed and the distinct kernels :func:`~kareus_fx.runtime.kernel_rebuild.build_kernels`
builds for them (ops with the same target and recorded shapes share one kernel and its inputs).
A count that stays flat as layers grow means the replay holds about one layer's buffers.

    python bench/replay_kernels.py [--layers 4 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile

from kareus_fx.capture.dump import load_dump
from kareus_fx.capture.tracing import TraceSpec, trace_full_size
from kareus_fx.plan.graph_workload import sequential_graphs
from kareus_fx.runtime.kernel_rebuild import kernel_signature, node_tables_from_dump


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rows = []
    for layers in args.layers:
        spec = TraceSpec(model="tiny-llama", tp=2, mbs=2, seq=64, layers=layers)
        with tempfile.TemporaryDirectory() as dump_dir:
            (path,) = trace_full_size(spec, options={"dump_dir": dump_dir, "nanobatch": False}).dump_paths
            dump = load_dump(path)
        tables = node_tables_from_dump(dump)
        for name, graph in sequential_graphs(dump).items():
            kernels = len({kernel_signature(op, tables[name]) for op in graph.ops})
            rows.append({"layers": layers, "graph": name, "ops": len(graph.ops), "kernels": kernels})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        print(f"{row['layers']} layers, {row['graph']}: {row['ops']} ops replayed by {row['kernels']} kernels")


if __name__ == "__main__":
    main()
