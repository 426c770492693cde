"""Kernels the analysis prices against the kernels Inductor generates, per decoder layer.

For each reference model at small size on CPU (one process, no parallelism, fp32), compiles one
training step with backend="kareus" twice, with 1 and with 2 decoder layers, and reads per
graph (forward, backward):

- the analysis: its kernels (``passes/kernel_groups.py``; distinct ``kernel`` ids of the
  computation nodes in the graph dump) and their bytes (the nodes' summed shares);
- Inductor: the kernels its scheduler made (``kareus_fx.capture.codegen.reading_kernels``),
  fused and extern, and its own estimate of the bytes each reads and writes.

Per decoder layer = the 2-layer count (bytes) minus the 1-layer one, so embedding, final norm
and loss cancel. Prints per model and graph the relative errors |analysis - inductor| / inductor
and their maxima ``max_count_err`` (target <= 0.10) and ``max_bytes_err`` (target <= 0.15).

    python bench/kernel_fidelity.py [--models tiny-llama tiny-qwen] [--mbs 2 --seq 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from kareus_fx.capture.codegen import reading_kernels
from kareus_fx.models import build_model

_NOT_KERNELS = ("kareus.clock_hook", "kareus.comm_", "_c10d_functional.")


def _step_kernels(
    model_name: str, layers: int, mbs: int, seq: int, dtype: torch.dtype = torch.float32
) -> dict[str, dict[str, float]]:
    """Analysis and Inductor kernel counts and bytes of one training step, per graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(model_name, num_layers=layers, dtype=dtype)
    model.init_weights(seed=0)
    batch = model.example_batch(mbs=mbs, seq=seq)
    with tempfile.TemporaryDirectory() as dump_dir, reading_kernels() as readout:
        compiled = torch.compile(model, backend="kareus", fullgraph=True, options={"dump_dir": dump_dir})
        loss = compiled(**batch)
        split = len(readout)  # the forward is compiled at the first call, the backward at backward()
        loss.backward()
        (path,) = Path(dump_dir).glob("kareus_graph_*.json")
        graphs = json.loads(path.read_text())["graphs"]
    result = {}
    for graph in graphs:
        compute = [n for n in graph["nodes"] if n["kind"] == "compute"]
        ours = {n["kernel"] for n in compute}
        result[graph["name"]] = {"analysis_kernels": len(ours), "analysis_bytes": sum(n["bytes"] for n in compute)}
    for name, kernels in (("forward", readout[:split]), ("backward", readout[split:])):
        real = [k for k in kernels if k.origins and not all(t.startswith(_NOT_KERNELS) for t in k.targets)]
        result[name].update(inductor_kernels=len(real), inductor_bytes=sum(k.bytes for k in real))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "tiny-qwen"])
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the models' dtype (bfloat16: the casts around norms and softmax are real nodes)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for model_name in args.models:
        one, two = (_step_kernels(model_name, layers, args.mbs, args.seq, dtype) for layers in (1, 2))
        for graph in ("forward", "backward"):
            per_layer = {key: two[graph][key] - one[graph][key] for key in two[graph]}
            rows.append(
                {
                    "model": model_name,
                    "graph": graph,
                    **per_layer,
                    "count_err": abs(per_layer["analysis_kernels"] - per_layer["inductor_kernels"])
                    / per_layer["inductor_kernels"],
                    "bytes_err": abs(per_layer["analysis_bytes"] - per_layer["inductor_bytes"])
                    / per_layer["inductor_bytes"],
                }
            )
    summary = {
        "per_layer": rows,
        "max_count_err": max(r["count_err"] for r in rows),
        "max_bytes_err": max(r["bytes_err"] for r in rows),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for r in rows:
        print(
            f"{r['model']:>12} {r['graph']:>8}: kernels/layer analysis {r['analysis_kernels']:.0f} vs inductor "
            f"{r['inductor_kernels']:.0f} (err {r['count_err']:.2f}); bytes/layer {r['analysis_bytes'] / 1e6:.2f} MB "
            f"vs {r['inductor_bytes'] / 1e6:.2f} MB (err {r['bytes_err']:.2f})"
        )
    print(
        f"max_count_err {summary['max_count_err']:.3f} (target <= 0.10), "
        f"max_bytes_err {summary['max_bytes_err']:.3f} (target <= 0.15)"
    )


if __name__ == "__main__":
    main()
