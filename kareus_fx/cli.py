"""The ``kareus`` command line. Subcommands: ``dump``, ``inspect``.

Every bad-input error (:class:`~kareus_fx.errors.KareusError`) is printed as one line naming the
problem and the fix, with exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from kareus_fx.cost_models.hardware import DEFAULT_GPU, canonical_gpu_name
from kareus_fx.errors import KareusError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KareusError as err:
        print(f"kareus {args.command}: error: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kareus", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

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
    dump.add_argument("--gpu", default=DEFAULT_GPU, help=f"GPU spec for compute/memory-bound labels (default {DEFAULT_GPU})")
    dump.add_argument("--out", type=Path, required=True, help="directory for the JSON dumps")
    dump.add_argument("--no-nanobatch", action="store_true", help="trace without the nanobatch split")
    dump.set_defaults(run=_run_dump)

    inspect = sub.add_parser("inspect", help="summarise a graph dump: graphs, collectives, partition types")
    inspect.add_argument("file", type=Path, help="a kareus_graph_*.json dump")
    inspect.set_defaults(run=_run_inspect)
    return parser


def _run_dump(args: argparse.Namespace) -> int:
    from kareus_fx.dump import load_dump
    from kareus_fx.dump_summary import collectives_by_layer_text, summary_table
    from kareus_fx.tracing import TraceSpec, trace_full_size

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
    from kareus_fx.dump import load_dump
    from kareus_fx.inspector import print_dump

    try:
        dump = load_dump(args.file)
    except (OSError, ValueError) as err:
        print(f"kareus inspect: error: {err}", file=sys.stderr)
        return 2
    print_dump(dump, _console(), title=str(args.file))
    return 0


def _console() -> Console:
    """A console as wide as the terminal, and wide enough for the tables when printing to a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


if __name__ == "__main__":
    sys.exit(main())
