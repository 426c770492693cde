"""Absolute scale: the simulated iteration's time and energy beside the paper's testbed.

    python bench/absolute_scale.py [--rerun | --from-plans bench/results/end_to_end.json]
                                   [--results bench/results/absolute_scale.json] [--json]

`validate_end_to_end.py` compares reductions (ratios within one plan). This compares what those
ratios rest on, the iteration itself, in two ways:

- Table 1 of the paper (Qwen 3 1.7B, CP2 x TP4 x PP2, 8 microbatches of 16 x 4K, 16 A100-SXM4-40GB;
  `../shared/paper/kareus-paper.txt`, the table before section 2.2): iteration time and static,
  dynamic and total energy of Megatron-LM, Megatron-LM + Perseus, Nanobatching and Nanobatching +
  Perseus at maximum throughput, against each method's fastest point in our plan (energy over all
  16 GPUs; static energy = the spec's static power x time, as the paper defines it).
- Kareus's TFLOPS per GPU (`kareus_tflops_per_gpu` of the calibration and validation CSVs):
  the testbed's iteration time is model FLOPs / (GPUs x TFLOPS per GPU). The paper does not say
  how it counts FLOPs, so both of Megatron-LM's conventions are shown: model FLOPs
  (`num_floating_point_operations`: forward, backward-data and backward-weight GEMMs, 3 passes)
  and with full activation recomputation counted (4 passes, the `checkpoint_activations_factor`
  of Megatron-DeepSpeed's throughput report). The paper used activation checkpointing (6.1).

``--from-plans FILE`` reads each preset's fastest points from ``validate_end_to_end.py``'s results
(the same plans, which keep them) instead of planning again.

Every "ours" number is a cost-model prediction of the simulated A100-SXM4-40GB. The Qwen rows and
Table 1 are validation data: reported here, never fitted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate_end_to_end import csv_number, labelled_testbed_rows

from kareus_fx.cost_models.hardware import canonical_gpu_name, gpu_spec
from kareus_fx.models.configs import ModelConfig, get_config
from kareus_fx.plan.planner import make_plan
from kareus_fx.plan.request import plan_request_from_preset

DEFAULT_RESULTS = Path(__file__).parent / "results" / "absolute_scale.json"

TABLE1_PRESET = "qwen3-1.7b-cp2tp4-mbs16-seq4k"
# Paper Table 1: iteration time (s), static, dynamic and total energy (J, 16 GPUs).
TABLE1 = {
    "megatron": (5.60, 5372.0, 21374.0, 26745.0),
    "megatron+perseus": (5.60, 5374.0, 19531.0, 24905.0),
    "nanobatching": (5.31, 5096.0, 21445.0, 26541.0),
    "nanobatching+perseus": (5.37, 5160.0, 19729.0, 24889.0),
}


def model_flops(cfg: ModelConfig, sequences: int, seq: int, passes: int) -> float:
    """Megatron-LM's FLOPs of ``sequences`` sequences of ``seq`` tokens (``num_floating_point_operations``:
    GQA, SwiGLU MLP, full attention score matrix, logits), with ``passes`` GEMM passes per weight
    (3: forward and both backward GEMMs; 4: a recomputed forward too)."""
    h = cfg.hidden_size
    query_ratio = cfg.num_heads * cfg.head_dim / h
    attention = (1.0 + cfg.num_kv_heads / cfg.num_heads + seq / h) * query_ratio
    mlp = cfg.ffn_size / h * 1.5
    logits = cfg.vocab_size / (2.0 * cfg.num_layers * h)
    return passes * 4.0 * sequences * seq * cfg.num_layers * h * h * (attention + mlp + logits)


def plan_absolute(preset: str) -> dict:
    """Each method's fastest point (time, energy over all GPUs) and the job's shape."""
    started = time.perf_counter()
    req = plan_request_from_preset(preset)
    outcome = make_plan(req, progress=False)
    fastest = {m: min(d["frontier"]) for m, d in outcome.data["methods"].items()}
    return {
        "fastest": {m: {"time_s": t, "energy_j": e} for m, (t, e) in fastest.items()},
        "gpus": req.tp * req.cp * req.pp,
        "model": req.model,
        "microbatches": req.microbatches,
        "mbs": req.mbs,
        "seq": req.seq,
        "gpu": canonical_gpu_name(req.gpu),
        "profiler": outcome.data["profiler"],
        "wall_s": time.perf_counter() - started,
    }


_PLAN_FIELDS = ("fastest", "gpus", "model", "microbatches", "mbs", "seq", "gpu", "profiler", "wall_s")
"""What this bench keeps of a plan (``plan_absolute``; ``validate_end_to_end.py`` keeps them too)."""


def _rows() -> list[dict[str, str]]:
    """The calibration and validation rows that give Kareus's TFLOPS per GPU."""
    return [r for r in labelled_testbed_rows() if csv_number(r["kareus_tflops_per_gpu"]) is not None]


def tflops_rows(plans: dict) -> list[dict]:
    """Per row: the testbed's iteration time implied by its TFLOPS under both FLOP conventions, ours."""
    out = []
    for row in _rows():
        p = plans[row["preset"]]
        cfg = get_config(p["model"])
        sequences = p["microbatches"] * p["mbs"]
        ours_s = p["fastest"]["kareus"]["time_s"]
        entry = {
            "preset": row["preset"],
            "data": row["data"],
            "paper_tflops_per_gpu": float(row["kareus_tflops_per_gpu"]),
            "ours_kareus_time_s": ours_s,
        }
        for name, passes in (("model_flops", 3), ("with_recompute", 4)):
            paper_s = model_flops(cfg, sequences, p["seq"], passes) / (p["gpus"] * entry["paper_tflops_per_gpu"] * 1e12)
            entry[name] = {"paper_time_s": paper_s, "paper_over_ours": paper_s / ours_s}
        out.append(entry)
    return out


def table1(plans: dict) -> list[dict]:
    """Table 1's methods: paper and ours, time and energy split into static and dynamic."""
    p = plans[TABLE1_PRESET]
    static_w = gpu_spec(p["gpu"]).static_power_w * p["gpus"]
    out = []
    for method, (t, static, dynamic, total) in TABLE1.items():
        ours = p["fastest"][method]
        ours_static = static_w * ours["time_s"]
        ours_dynamic = ours["energy_j"] - ours_static
        out.append(
            {
                "method": method,
                "paper": {"time_s": t, "static_j": static, "dynamic_j": dynamic, "total_j": total},
                "ours": {
                    "time_s": ours["time_s"],
                    "static_j": ours_static,
                    "dynamic_j": ours_dynamic,
                    "total_j": ours["energy_j"],
                },
                "paper_over_ours": {
                    "time": t / ours["time_s"],
                    "dynamic": dynamic / ours_dynamic,
                    "dynamic_power": (dynamic / t) / (ours_dynamic / ours["time_s"]),
                },
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--rerun", action="store_true", help="plan again even if the results file has the preset")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--from-plans",
        type=Path,
        default=None,
        help="take the presets' fastest points from validate_end_to_end.py's results file instead of planning",
    )
    args = parser.parse_args(argv)
    stored = json.loads(args.results.read_text()) if args.results.exists() else {}
    plans = {} if args.rerun else dict(stored.get("plans", {}))
    if args.from_plans is not None:
        planned = json.loads(args.from_plans.read_text())["plans"]
        plans = {k: {f: v[f] for f in _PLAN_FIELDS} for k, v in planned.items() if "fastest" in v and "+" not in k}
    for preset in sorted({r["preset"] for r in _rows()} | {TABLE1_PRESET}):
        if preset not in plans:
            print(f"planning {preset} ...", file=sys.stderr, flush=True)
            plans[preset] = plan_absolute(preset)
    result = {
        "note": "ours: simulated A100-SXM4-40GB (cost model); paper: measured on 16 A100-SXM4-40GB",
        "plans": plans,
        "table1": table1(plans),
        "tflops": tflops_rows(plans),
    }

    def ratio_range(convention: str) -> list[float]:
        ratios = [r[convention]["paper_over_ours"] for r in result["tflops"]]
        return [round(min(ratios), 3), round(max(ratios), 3)]

    result["summary"] = {
        "table1_time_paper_over_ours": [round(r["paper_over_ours"]["time"], 3) for r in result["table1"]],
        "table1_dynamic_power_paper_over_ours": [
            round(r["paper_over_ours"]["dynamic_power"], 3) for r in result["table1"]
        ],
        "kareus_time_paper_over_ours_with_recompute": ratio_range("with_recompute"),
        "kareus_time_paper_over_ours_model_flops": ratio_range("model_flops"),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps({k: result[k] for k in ("table1", "tflops", "summary")}, indent=1))
        return 0
    print("Table 1 (Qwen3-1.7B CP2 x TP4 mbs16 4K, 16 GPUs): paper / ours")
    for r in result["table1"]:
        pa, us = r["paper"], r["ours"]
        print(
            f"  {r['method']:22s} time {pa['time_s']:.2f} / {us['time_s']:.2f} s   static {pa['static_j']:.0f} / "
            f"{us['static_j']:.0f} J   dynamic {pa['dynamic_j']:.0f} / {us['dynamic_j']:.0f} J   total "
            f"{pa['total_j']:.0f} / {us['total_j']:.0f} J"
        )
    print("Kareus iteration time, testbed (from its TFLOPS per GPU) / ours:")
    for r in result["tflops"]:
        print(
            f"  {r['preset']:32s} ({r['data']}) {r['paper_tflops_per_gpu']:6.1f} TFLOPS: "
            f"{r['model_flops']['paper_time_s']:.2f} s (model FLOPs) or {r['with_recompute']['paper_time_s']:.2f} s "
            f"(recompute counted) / ours {r['ours_kareus_time_s']:.2f} s: x{r['model_flops']['paper_over_ours']:.2f} "
            f"or x{r['with_recompute']['paper_over_ours']:.2f}"
        )
    print("summary:", json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
