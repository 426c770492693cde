"""Training-step time of backend="kareus" against plain Inductor, CPU, TP=2 over gloo.

A GPT-2-size decoder (4 layers, d=512, 8 heads, FFN 2048; vocabulary 8192 so the LM head does
not dominate a CPU step), tensor-parallel over 2 gloo processes, fp32, batch 8 x seq 256. Each
rank compiles four versions of one model: eager, ``torch.compile`` (Inductor), kareus with the
nanobatch split off, and kareus nanobatched (no plan). Then ``--steps`` rounds (default 10) each
run one step of every version in turn (interleaved, so load changes hit all alike); a step is
forward + backward between two barriers.

Compile time is measured apart, cold: Inductor and kareus (split off) each in their own pair of
processes with a fresh Inductor cache directory (the FX graph and AOTAutograd caches off), so
neither reuses kernels the other generated. Compile time = first step minus the median of the
next three.

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
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kareus_fx.models import ModelConfig, ParallelLayout, build_model

VERSIONS = ("eager", "inductor", "kareus", "kareus_nanobatched")


def _config(layers: int) -> ModelConfig:
    return ModelConfig(
        name="gpt2-size",
        hidden_size=512,
        num_layers=layers,
        num_heads=8,
        num_kv_heads=8,
        head_dim=64,
        ffn_size=2048,
        vocab_size=8192,
        norm_eps=1e-5,
        rope_theta=10000.0,
        tie_embeddings=False,
    )


def _step_s(fn, model, batch) -> float:
    model.zero_grad(set_to_none=True)
    dist.barrier()
    start_s = time.perf_counter()
    fn(**batch).backward()
    dist.barrier()
    return time.perf_counter() - start_s


def _compiled(version: str, model: torch.nn.Module):
    if version == "eager":
        return model
    if version == "inductor":
        return torch.compile(model, fullgraph=True)
    return torch.compile(
        model, backend="kareus", fullgraph=True, options={"nanobatch": version == "kareus_nanobatched"}
    )


def _rank(
    rank: int, world_size: int, port: int, args: argparse.Namespace, versions: tuple[str, ...], steps: int, results
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    torch.manual_seed(0)
    model = build_model(_config(args.layers), ParallelLayout.from_default_group(tp=world_size), dtype=torch.float32)
    model.init_weights(seed=0)
    batch = model.example_batch(mbs=args.mbs, seq=args.seq)
    fns = {version: _compiled(version, model) for version in versions}
    first_s = {name: _step_s(fn, model, batch) for name, fn in fns.items()}
    steps_s: dict[str, list[float]] = {name: [] for name in versions}
    for _ in range(steps):
        for name, fn in fns.items():
            steps_s[name].append(_step_s(fn, model, batch))
    dist.destroy_process_group()
    if rank == 0:
        results.put({"first_s": first_s, "median_step_s": {n: statistics.median(t) for n, t in steps_s.items()}})


def _run(args: argparse.Namespace, versions: tuple[str, ...], steps: int) -> dict:
    """One pair of TP ranks running ``versions``, with a fresh Inductor cache directory."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # the spawned ranks inherit it
        procs = [ctx.Process(target=_rank, args=(r, 2, port, args, versions, steps, results)) for r in range(2)]
        for p in procs:
            p.start()
        result = results.get()
        for p in procs:
            p.join()
    return result


def _summary(args: argparse.Namespace) -> dict:
    compile_s = {}
    for version in ("inductor", "kareus"):
        cold = _run(args, (version,), steps=3)
        compile_s[version] = cold["first_s"][version] - cold["median_step_s"][version]
    median_s = _run(args, VERSIONS, steps=args.steps)["median_step_s"]
    return {
        "median_step_s": median_s,
        "compile_s": compile_s,
        "steps": args.steps,
        "kareus_over_inductor": median_s["kareus"] / median_s["inductor"],
        "kareus_nanobatched_over_inductor": median_s["kareus_nanobatched"] / median_s["inductor"],
        "eager_over_inductor": median_s["eager"] / median_s["inductor"],
        "compile_kareus_over_inductor": compile_s["kareus"] / compile_s["inductor"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mbs", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    summary = _summary(args)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for name, value in summary["median_step_s"].items():
        print(f"{name:>20}: median step {value * 1e3:.1f} ms")
    print(
        f"kareus/inductor {summary['kareus_over_inductor']:.3f} (target <= 1.03), nanobatched/inductor "
        f"{summary['kareus_nanobatched_over_inductor']:.3f}, eager/inductor {summary['eager_over_inductor']:.3f}, "
        f"compile kareus/inductor {summary['compile_kareus_over_inductor']:.2f} (target <= 1.3)"
    )


if __name__ == "__main__":
    main()
