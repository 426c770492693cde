"""Training-step time of backend="kareus" against plain Inductor, CPU, TP=2 over gloo.

A GPT-2-size decoder (4 layers, d=512, 8 heads, FFN 2048; vocabulary 8192 so the LM head does
not dominate a CPU step), tensor-parallel over 2 gloo processes, fp32, batch 8 x seq 256. Each
rank compiles four versions of one model: eager, ``torch.compile`` (Inductor), kareus with the
nanobatch split off, and kareus nanobatched (no plan). The FX graph and AOTAutograd caches are
off, so each compile generates its code. Compile time of a version = its first step minus its
median step. Then ``--steps`` rounds (default 10) each run one step of every version in turn
(interleaved, so load changes hit all alike); a step is forward + backward between two barriers.

Prints the median step time of each version and the ratios ``kareus_over_inductor`` (target
<= 1.03), ``kareus_nanobatched_over_inductor``, ``eager_over_inductor`` and
``compile_kareus_over_inductor`` (target <= 1.3; kareus with the split off).

    python bench/step_time.py [--steps 10] [--layers 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kareus_fx.models import ModelConfig, ParallelLayout, build_model

VERSIONS = ("eager", "inductor", "kareus", "kareus_nanobatched")


def _config(layers: int) -> ModelConfig:
    return ModelConfig(name="gpt2-size", hidden_size=512, num_layers=layers, num_heads=8, num_kv_heads=8,
                       head_dim=64, ffn_size=2048, vocab_size=8192, norm_eps=1e-5, rope_theta=10000.0,
                       tie_embeddings=False)


def _step_s(fn, model, batch) -> float:
    model.zero_grad(set_to_none=True)
    dist.barrier()
    start_s = time.perf_counter()
    fn(**batch).backward()
    dist.barrier()
    return time.perf_counter() - start_s


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    torch.manual_seed(0)
    model = build_model(_config(args.layers), ParallelLayout.from_default_group(tp=world_size), dtype=torch.float32)
    model.init_weights(seed=0)
    batch = model.example_batch(mbs=args.mbs, seq=args.seq)
    fns = {
        "eager": model,
        "inductor": torch.compile(model, fullgraph=True),
        "kareus": torch.compile(model, backend="kareus", fullgraph=True, options={"nanobatch": False}),
        "kareus_nanobatched": torch.compile(model, backend="kareus", fullgraph=True),
    }
    first_s = {name: _step_s(fn, model, batch) for name, fn in fns.items()}
    steps_s: dict[str, list[float]] = {name: [] for name in VERSIONS}
    for _ in range(args.steps):
        for name, fn in fns.items():
            steps_s[name].append(_step_s(fn, model, batch))
    dist.destroy_process_group()
    if rank == 0:
        median_s = {name: statistics.median(times) for name, times in steps_s.items()}
        compile_s = {name: first_s[name] - median_s[name] for name in ("inductor", "kareus", "kareus_nanobatched")}
        results.put({
            "median_step_s": median_s, "compile_s": compile_s, "steps": args.steps,
            "kareus_over_inductor": median_s["kareus"] / median_s["inductor"],
            "kareus_nanobatched_over_inductor": median_s["kareus_nanobatched"] / median_s["inductor"],
            "eager_over_inductor": median_s["eager"] / median_s["inductor"],
            "compile_kareus_over_inductor": compile_s["kareus"] / compile_s["inductor"],
        })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mbs", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, results)) for r in range(2)]
    for p in procs:
        p.start()
    summary = results.get()
    for p in procs:
        p.join()
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for name, value in summary["median_step_s"].items():
        print(f"{name:>20}: median step {value * 1e3:.1f} ms")
    print(f"kareus/inductor {summary['kareus_over_inductor']:.3f} (target <= 1.03), nanobatched/inductor "
          f"{summary['kareus_nanobatched_over_inductor']:.3f}, eager/inductor {summary['eager_over_inductor']:.3f}, "
          f"compile kareus/inductor {summary['compile_kareus_over_inductor']:.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
