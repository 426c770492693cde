"""The ``kareus`` command line. Subcommands: ``plan``, ``dump``, ``inspect``, ``bench``, ``clocks``.

Every bad-input error (:class:`~kareus_fx.errors.KareusError`) is printed as one line naming the
problem and the fix, with exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from kareus_fx.cost_models.hardware import DEFAULT_GPU, canonical_gpu_name
from kareus_fx.errors import KareusError, OptionsError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except KareusError as err:
        print(f"kareus {args.command}: error: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kareus", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)

    dump = sub.add_parser(
        "dump",
        help="trace a reference model at full size (meta device, fake process group) and dump its graphs",
    )
    dump.add_argument("--model", required=True, help="reference model, e.g. llama3.2-3b, qwen3-1.7b, llama3.3-70b")
    dump.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    dump.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    dump.add_argument("--mbs", type=int, required=True, help="microbatch size")
    dump.add_argument("--seq", type=int, required=True, help="sequence length")
    dump.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    dump.add_argument(
        "--gpu", default=DEFAULT_GPU, help=f"GPU spec for compute/memory-bound labels (default {DEFAULT_GPU})"
    )
    dump.add_argument("--out", type=Path, required=True, help="directory for the JSON dumps")
    dump.add_argument("--no-nanobatch", action="store_true", help="trace without the nanobatch split")
    dump.set_defaults(run=_run_dump)

    inspect = sub.add_parser(
        "inspect",
        help="summarise a graph dump or a plan (text or --html), or compare two (--diff A B)",
    )
    inspect.add_argument("file", type=Path, nargs="?", help="a kareus_graph_*.json dump or a plan.json")
    inspect.add_argument("--html", type=Path, metavar="OUT", help="also write a self-contained HTML report to OUT")
    inspect.add_argument(
        "--diff",
        type=Path,
        nargs=2,
        metavar=("A", "B"),
        help="compare two dumps or two plans instead of summarising one file",
    )
    inspect.add_argument(
        "--run",
        dest="run_logs",
        type=Path,
        nargs="+",
        metavar="RUN",
        help="run log(s) (JSON lines) to hold against --plan",
    )
    inspect.add_argument("--plan", type=Path, help="with --run: the plan the run is compared with")
    inspect.add_argument("--warmup", type=int, default=1, help="with --run: iterations left out of the ratios")
    inspect.add_argument("--json", action="store_true", help="with --run: print the comparison as JSON")
    inspect.set_defaults(run=_run_inspect)
    _add_bench_parser(sub)
    _add_clocks_parser(sub)
    return parser


def _add_clocks_parser(sub: argparse._SubParsersAction) -> None:
    clocks = sub.add_parser(
        "clocks",
        help="list GPU clock locks left by processes that are gone; --reset-stale restores those GPUs",
        description="Every ClockController records the clock it holds locked in a lock directory "
        "($KAREUS_CLOCK_LOCK_DIR, else kareus-clock-locks-<uid> in the temporary directory) until it restores "
        "it. A record whose process is gone is stale: the GPU may still run at that clock.",
    )
    clocks.add_argument("--reset-stale", action="store_true", help="restore every GPU with a stale lock")
    clocks.add_argument("--lock-dir", type=Path, default=None, help="the lock directory (default: see above)")
    clocks.set_defaults(run=_run_clocks)


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from kareus_fx.regression.runner import ABLATIONS, SUITES

    bench = sub.add_parser(
        "bench",
        help="plan a suite of presets on the simulated GPU and compare its metrics with a baseline file",
        description="Run the suite's presets through `kareus plan` (simulated profiler), record the frontier "
        "metrics against the baselines, the tuner's hypervolume ratio against exhaustive search and its "
        "measured fraction, and the wall time of each phase; compare with the baseline file under per-metric "
        "tolerances and exit 1 when any metric regressed.",
    )
    bench.add_argument("--suite", choices=sorted(SUITES), default="smoke", help="smoke (CI) or paper (releases)")
    bench.add_argument("--baseline", type=Path, default=Path("bench/baseline.json"), help="baseline file")
    bench.add_argument(
        "--update", action="store_true", help="record this run's cases in the baseline file (other cases kept)"
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bench.add_argument(
        "--ablate",
        choices=sorted(ABLATIONS),
        default=None,
        help="turn a part of the planner off (checks that the runner catches a worse planner)",
    )
    bench.set_defaults(run=_run_bench)


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="trace, tune and compose a training step's time-energy frontier; write plan.json and a report",
        description="Plan a workload (a --preset, or --model or --hf-config with its layout) on a GPU: trace on the "
        "meta device (each pipeline stage as a slice of its layers extended to its layer count), partitions, MBO "
        "tuning per partition type, microbatch and iteration frontiers, "
        "and the baselines (Megatron-LM, Megatron-LM + Perseus, Nanobatching, Nanobatching + Perseus).",
    )
    plan.add_argument(
        "--preset", help="a named workload (see kareus_fx/plan/presets.py), e.g. qwen3-1.7b-tp8-mbs8-seq4k"
    )
    plan.add_argument("--model", help="reference model (instead of --preset)")
    plan.add_argument(
        "--hf-config",
        type=Path,
        metavar="PATH",
        help="your own architecture: a Hugging Face config.json (or its directory), planned at "
        "full size on the meta device, no weights (instead of --model; needs transformers)",
    )
    for name, what in (
        ("tp", "tensor-parallel degree"),
        ("cp", "context-parallel degree"),
        ("pp", "pipeline stages (GPUs of one pipeline)"),
        ("virtual-stages", "model chunks per pipeline GPU: above 1, interleaved 1F1B (default 1)"),
        ("dp", "data-parallel replicas: energies count every GPU of the job (default 1)"),
        (
            "ep",
            "expert-parallel degree of a mixture-of-experts model: its all-to-alls span the TP groups of "
            "ep / tp data-parallel replicas (default 1)",
        ),
        ("microbatches", "microbatches per iteration"),
        ("mbs", "microbatch size"),
        ("layers", "decoder layers (default: the model's)"),
    ):
        plan.add_argument(f"--{name}", type=int, default=None, help=what)
    plan.add_argument(
        "--expert-imbalance",
        type=float,
        default=None,
        metavar="F",
        help="mixture-of-experts routing: the busiest expert-parallel rank's token load over the uniform "
        "share, priced on every rank (default 1: uniform)",
    )
    plan.add_argument(
        "--seq",
        type=_seq_buckets,
        default=None,
        metavar="N[,N...]",
        help="sequence length; several (2048,4096,8192) plan one frontier per bucket, "
        "deployed per call on the smallest bucket that holds it",
    )
    plan.add_argument("--gpu", default=None, help=f"GPU to plan for (default: the preset's, else {DEFAULT_GPU})")
    plan.add_argument("--dtype", default="bfloat16", help="model dtype: bfloat16 (default), float16, float32")
    plan.add_argument(
        "--profiler",
        default="simulated",
        help="simulated (default: the cost model, CPU only), cuda (measure on this machine's GPU; under "
        "torchrun or --nproc on every GPU, in groups of tp x cp with the real NCCL collectives) or "
        "cpu-replay (a CPU test device: real replays and gloo collectives, wall-clock time, fixed-power "
        "energy; for testing the distributed profiler)",
    )
    plan.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="with --profiler cpu-replay or cuda: start N processes on this machine as torchrun would "
        "(groups of tp x cp ranks profile in parallel); under torchrun leave it out",
    )
    plan.add_argument(
        "--peer-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --nproc or torchrun: how long a profiling group waits for a peer before it stops "
        "with an error (default 300 s)",
    )
    plan.add_argument(
        "--clock-mode",
        choices=("real", "dry-run"),
        default=None,
        help="with --profiler cuda: real (default) locks each measured clock; dry-run leaves the "
        "card's clock alone (every point measured at its current clock) and records the requests",
    )
    plan.add_argument(
        "--device-window",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --profiler cuda: the least energy window of one measurement (default 5 s, "
        "at least 1 s: NVML's energy counter updates about every 100 ms)",
    )
    plan.add_argument(
        "--stage-layers",
        type=_stage_layers,
        default=None,
        metavar="even|balanced|N,N,...",
        help="how the pipeline stages split the decoder layers: even (Megatron-LM's default; the "
        "default with --model), balanced (the split that evens out the stages' step times on the "
        "simulated GPU; the emulation presets' default) or one count per stage (e.g. 15,13: what "
        "your job runs, and the testbed presets' default, as the paper's artifact configs)",
    )
    plan.add_argument(
        "--recompute",
        choices=("none", "full", "selective"),
        default=None,
        help="activation checkpointing of the traced model: none, full (every decoder layer, "
        "Megatron-LM's full recompute; the presets' default, as the paper's testbed) or selective "
        "(core attention only); the plan deploys only on a model checkpointed the same way",
    )
    plan.add_argument(
        "--compile-unit",
        choices=("stage", "block"),
        default="stage",
        help="what your job compiles as one graph: the whole pipeline stage (torch.compile(stage)), or "
        "each transformer block (torchtitan; kareus_fx.integrations.torchtitan.compile_blocks): the plan "
        "then holds one block's graphs and prices a stage as its blocks",
    )
    plan.add_argument(
        "--framework",
        default=None,
        metavar="NAME",
        help="the training framework whose step the plan prices: traced-order (the traced model as it runs), "
        "megatron-lm (Megatron-LM/TE under the preset's settings) or torchtitan-fsdp (torchtitan's FSDP2 + TP "
        "step tail); default: megatron-lm for the presets that carry Megatron settings, else traced-order",
    )
    plan.add_argument(
        "--calibrate-from",
        nargs="+",
        type=Path,
        default=None,
        metavar="RUN",
        help="run logs (JSON lines of the backend option run_log) measured on this GPU: rescale the simulated "
        "GPU's time and energy by the medians of measured over predicted (cost_models/run_calibration.py)",
    )
    plan.add_argument(
        "--full-trace",
        action="store_true",
        help="trace every layer of each stage instead of a 2- and 3-layer slice extended to the "
        "stage's layer count (slower; the plan is the same)",
    )
    plan.add_argument(
        "--max-clock-only",
        action="store_true",
        help="Kareus without frequency scaling: every microbatch at the GPU's maximum clock, only the "
        "kernel schedule (collective SMs, launch slot) tuned; deployment then locks no clock (for "
        "a job that may not set GPU clocks)",
    )
    plan.add_argument(
        "--exact-min-cut",
        action="store_true",
        help="compose the iteration frontiers with lowtime's own min-cut (the exact reference; "
        "several times slower) instead of SciPy's Dinic",
    )
    plan.add_argument("--seed", type=int, default=0, help="tuning seed")
    plan.add_argument("--workers", type=int, default=1, help="tuning processes")
    plan.add_argument(
        "--clock-stride", type=int, default=None, help="tuning clock stride in MHz (default: the paper's 30 MHz grid)"
    )
    plan.add_argument("--out", type=Path, default=Path("kareus-plan"), help="output directory")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.set_defaults(run=_run_plan)


def _seq_buckets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,... (sequence lengths), got {text!r}") from None


def _stage_layers(text: str) -> str | tuple[int, ...]:
    if text in ("even", "balanced"):
        return text
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected even, balanced or one layer count per stage (N,N,...), got {text!r}"
        ) from None


def _plan_request(args: argparse.Namespace):
    from kareus_fx.models.configs import HF_CONFIG_PREFIX
    from kareus_fx.plan.request import PlanRequest, plan_request_from_preset

    shape = {
        k: getattr(args, k)
        for k in ("tp", "cp", "pp", "virtual_stages", "dp", "ep", "microbatches", "mbs", "seq", "layers")
    }
    if shape["seq"] is not None:
        shape["seq"] = max(shape["seq"])  # the largest bucket (the others: _run_plan)
    common = {
        "profiler": args.profiler,
        "dtype": args.dtype,
        "seed": args.seed,
        "workers": args.workers,
        "clock_mode": args.clock_mode,
        "full_trace": args.full_trace,
        "max_clock_only": args.max_clock_only,
        "exact_min_cut": args.exact_min_cut,
        "compile_unit": args.compile_unit,
    }
    if args.gpu is not None:
        common["gpu"] = args.gpu
    if args.clock_stride is not None:
        common["clock_stride_mhz"] = args.clock_stride
    if args.calibrate_from:
        common["calibrate_from"] = tuple(map(str, args.calibrate_from))
    if args.device_window is not None:
        common["device_window_s"] = args.device_window
    if args.stage_layers is not None:
        common["stage_layers"] = args.stage_layers
    if args.recompute is not None:
        common["recompute"] = args.recompute
    if args.framework is not None:
        common["framework"] = args.framework
    if args.expert_imbalance is not None:
        common["expert_imbalance"] = args.expert_imbalance
    given = [
        flag
        for flag, value in (("--preset", args.preset), ("--model", args.model), ("--hf-config", args.hf_config))
        if value
    ]
    if len(given) > 1:
        raise OptionsError(f"give one of --preset, --model and --hf-config, not {' and '.join(given)}")
    if args.preset:
        return plan_request_from_preset(args.preset, **{k: v for k, v in shape.items() if v is not None}, **common)
    if not given:
        raise OptionsError(
            "give --preset NAME, or --model (or --hf-config PATH) with --tp/--cp/--pp/--microbatches/--mbs/--seq"
        )
    model = args.model or f"{HF_CONFIG_PREFIX}{args.hf_config.resolve()}"
    defaults = {"tp": 1, "cp": 1, "pp": 1, "virtual_stages": 1, "dp": 1, "ep": 1, "microbatches": 1}
    missing = [f"--{k}" for k in ("mbs", "seq") if shape[k] is None]
    if missing:
        raise OptionsError(f"{given[0]} needs {' and '.join(missing)}")
    # argparse's values (Any) for PlanRequest's typed fields; planning validates the request
    sizes: dict[str, Any] = {k: (defaults.get(k) if v is None else v) for k, v in shape.items()}
    return PlanRequest(model=model, **sizes, **common)


def _run_plan(args: argparse.Namespace) -> int:

    from kareus_fx.compose.perseus_csv import write_perseus_profile
    from kareus_fx.plan.bucketed_plan import make_bucketed_plan, validate_buckets
    from kareus_fx.plan.plan_format import write_plan
    from kareus_fx.plan.planner import make_plan
    from kareus_fx.plan.request import validate_plan_request
    from kareus_fx.report.plan_report import metrics_table, profiling_text, write_frontier_csv, write_report_html

    request = _plan_request(args)
    validate_plan_request(request)  # every bad-input error before any tracing
    buckets = validate_buckets(request, args.seq) if args.seq is not None and len(args.seq) > 1 else None
    distributed = _distributed_mode(args, request)
    if buckets is not None and distributed is not None:
        raise OptionsError(
            "a bucketed plan (--seq with several lengths) is profiled in one process: give one "
            "--seq per distributed run, or drop --profiler cpu-replay/cuda with --nproc"
        )
    if distributed == "launch":
        from kareus_fx.plan.launcher import launch, without_nproc

        return launch(args.nproc, without_nproc(args.argv))
    args.out.mkdir(parents=True, exist_ok=True)
    if distributed == "run":
        from kareus_fx.plan.distributed_plan import DEFAULT_PEER_TIMEOUT_S, make_plan_distributed

        outcome = make_plan_distributed(
            request,
            args.out / "work",
            progress=not args.json,
            peer_timeout_s=args.peer_timeout or DEFAULT_PEER_TIMEOUT_S,
        )
        if outcome is None:  # not rank 0: rank 0 writes the plan
            return 0
    elif buckets is None:
        outcome = make_plan(request, args.out / "work", progress=not args.json)
    else:
        outcome = make_bucketed_plan(request, buckets, args.out / "work", progress=not args.json)
    write_plan(args.out / "plan.json", outcome.data)
    write_frontier_csv(outcome.data, args.out / "frontier.csv")
    # The sequential (Megatron-LM) microbatch profile in Perseus's CSV format, per GPU: the input
    # the Perseus planner takes, measured on the same profiler.
    write_perseus_profile(args.out / "perseus_profile.csv", outcome.iteration["megatron+perseus"].options)
    write_report_html(outcome.data, args.out)
    if args.json:
        methods = {
            name: {"frontier": m["frontier"], "metrics": m["metrics"]} for name, m in outcome.data["methods"].items()
        }
        print(
            json.dumps(
                {
                    "methods": methods,
                    "profiling": outcome.data.get("profiling"),
                    "wall_s": outcome.wall_s["total_s"],
                    "phases_s": outcome.wall_s,
                    "out": str(args.out),
                }
            )
        )
        return 0
    console = _console()
    console.print(metrics_table(outcome.data))
    console.print(profiling_text(outcome.data))
    phases = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in outcome.wall_s.items())
    console.print(f"{phases}; wrote {args.out / 'plan.json'}, frontier.csv, report.html, perseus_profile.csv")
    return 0


def _distributed_mode(args: argparse.Namespace, request) -> str | None:
    """ "launch" (--nproc: start the processes), "run" (one process of a distributed plan) or None."""
    from kareus_fx.plan.distributed_plan import distributed_env
    from kareus_fx.plan.request import DISTRIBUTED_PROFILERS

    env = distributed_env()
    if args.nproc is not None and env is None:
        if request.profiler not in DISTRIBUTED_PROFILERS:
            raise OptionsError(
                f"--nproc starts the processes of a distributed profiler: add --profiler cpu-replay "
                f"or --profiler cuda (got --profiler {request.profiler})"
            )
        return "launch"
    if args.peer_timeout is not None and request.profiler not in DISTRIBUTED_PROFILERS:
        raise OptionsError("--peer-timeout applies to --profiler cpu-replay or cuda with --nproc or torchrun")
    if request.profiler == "cpu-replay" or (request.profiler == "cuda" and env is not None and env[1] > 1):
        return "run"
    return None


def _run_dump(args: argparse.Namespace) -> int:
    from kareus_fx.capture.dump import load_dump
    from kareus_fx.capture.tracing import TraceSpec, trace_full_size
    from kareus_fx.report.dump_summary import collectives_by_layer_text, summary_table

    gpu = canonical_gpu_name(args.gpu)
    spec = TraceSpec(model=args.model, tp=args.tp, cp=args.cp, mbs=args.mbs, seq=args.seq, layers=args.layers)
    console = _console()
    options = {"dump_dir": str(args.out), "gpu": gpu, "nanobatch": not args.no_nanobatch}
    with console.status(f"tracing {spec.model} (tp={spec.tp}, cp={spec.cp}) on the meta device"):
        result = trace_full_size(spec, options=options)
    console.print(f"traced in {result.wall_s:.1f} s; dumps: {', '.join(map(str, result.dump_paths))}")
    for path in result.dump_paths:
        dump = load_dump(path)
        console.print(summary_table(dump, title=f"{path.name} ({gpu})"))
        console.print(collectives_by_layer_text(dump))
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    from kareus_fx.report.inspector import (
        InspectedDump,
        InspectedPlan,
        inspected_html,
        load_inspectable,
        print_inspected,
    )
    from kareus_fx.report.plan_diff import diff_dumps, diff_plans, format_changes

    if args.run_logs is not None:
        return _inspect_run(args)
    if args.diff is not None:
        if args.file is not None or args.html is not None:
            raise OptionsError("--diff A B compares two files; give no other FILE and no --html with it")
        a, b = (load_inspectable(path) for path in args.diff)
        if isinstance(a, InspectedPlan) and isinstance(b, InspectedPlan):
            changes = diff_plans(a.plan, b.plan)
        elif isinstance(a, InspectedDump) and isinstance(b, InspectedDump):
            changes = diff_dumps(a.dump, b.dump)
        else:
            raise OptionsError(f"--diff compares two plans or two dumps; {a.path} and {b.path} are one of each")
        print(format_changes(changes, str(a.path), str(b.path)))
        return 0
    if args.file is None:
        raise OptionsError("give a dump or plan FILE to inspect, or --diff A B")
    item = load_inspectable(args.file)
    print_inspected(item, _console())
    if args.html is not None:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(inspected_html(item))
        print(f"wrote {args.html}")
    return 0


def _inspect_run(args: argparse.Namespace) -> int:
    """``kareus inspect --run RUN.jsonl --plan PLAN.json``: planned against measured per iteration."""
    from kareus_fx.deploy.run_record import read_run_logs
    from kareus_fx.plan.plan_format import load_plan
    from kareus_fx.report.run_vs_plan import compare_run, comparison_html, print_comparison

    if args.plan is None or args.file is not None or args.diff is not None:
        raise OptionsError("--run RUN.jsonl needs --plan PLAN.json (the plan to compare with) and no other FILE")
    comparison = compare_run(read_run_logs(args.run_logs), load_plan(args.plan), warmup=args.warmup)
    if args.json:
        print(json.dumps(comparison.as_json(), indent=1))
    else:
        print_comparison(comparison, _console())
    if args.html is not None:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(comparison_html(comparison))
        if not args.json:
            print(f"wrote {args.html}")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from kareus_fx.regression.runner import run_bench_command

    return run_bench_command(
        args.suite, args.baseline, update=args.update, as_json=args.json, ablate=args.ablate, console=_console()
    )


def _run_clocks(args: argparse.Namespace) -> int:
    from kareus_fx.runtime.clock_locks import default_lock_dir, repair_stale_locks, stale_locks

    lock_dir = args.lock_dir or default_lock_dir()
    if not args.reset_stale:
        found = stale_locks(lock_dir)
        for _, lock in found:
            print(f"stale: GPU {lock.gpu} locked at {lock.clock_mhz} MHz by process {lock.pid}, which is gone")
        print(f"{len(found)} stale lock(s) in {lock_dir}" + ("; restore with --reset-stale" if found else ""))
        return 0
    repaired = repair_stale_locks(lock_dir)
    for item in repaired:
        print(item.describe())
    print(f"{len(repaired)} stale lock(s) in {lock_dir}")
    return 1 if any(item.error is not None for item in repaired) else 0


def _console() -> Console:
    """A console as wide as the terminal, and wide enough for the tables when printing to a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


if __name__ == "__main__":
    sys.exit(main())
