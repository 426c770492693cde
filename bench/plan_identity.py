"""Plans identical field for field: the check that a refactoring changed no plan.

    python bench/plan_identity.py --against REV [--presets P [P ...]] [--keep DIR]
    python bench/plan_identity.py --record DIR [--presets P [P ...]]
    python bench/plan_identity.py --compare DIR_A DIR_B

``--against REV`` plans every preset twice, with the code of git revision ``REV`` (checked out in a
temporary worktree and imported from there) and with this working tree, and compares the two
``plan.json`` files of each preset field for field, floats exactly. ``--record`` plans into ``DIR``
(one ``PRESET/plan.json`` each); ``--compare`` compares two recorded folders. Exit status 1 when a
plan differs; the differing paths are printed (at most 20 per preset).

The default presets are the README's main job, a CP2 x TP4 testbed row (untied embeddings, the
distributed optimizer's reduce-scatter and all-gather), the 70B PP10 emulation (balanced split, 320
pipeline nodes, parallel composition) and a workload without a preset (the traced order as it runs,
no framework settings). Fields that record when and how fast the plan was made (``created_utc``,
``wall_s``) are not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PRESETS = (
    "qwen3-1.7b-tp8-mbs8-seq4k",
    "llama3.2-3b-cp2tp4-mbs8-seq4k",
    "llama3.3-70b-pp10tp8-mb128",
    "custom:llama3.2-3b:tp=4,pp=2,microbatches=4,mbs=2,seq=2048",
)
"""Preset names, or ``custom:MODEL:FIELD=VALUE,...`` for a request without a preset."""
VOLATILE_FIELDS = ("created_utc", "wall_s")
"""Top-level plan fields that record when and how fast the plan was made, not what it is."""
PACKAGE_FOLDERS = {"kareus_fx": "kareus_fx", "passes": "passes", "runtime": "runtime", "cost_models": "cost_models"}
"""Where each part of the package lives in a checkout (``passes/`` installs as ``kareus_fx.passes``)."""


def request_for(name: str) -> Any:
    """The plan request a ``DEFAULT_PRESETS`` entry names."""
    from kareus_fx.plan.request import PlanRequest, plan_request_from_preset

    if not name.startswith("custom:"):
        return plan_request_from_preset(name)
    _, model, fields = name.split(":", 2)
    values = {k: int(v) for k, v in (item.split("=") for item in fields.split(","))}
    return PlanRequest(model=model, cp=values.pop("cp", 1), **values)


def record(out: Path, names: Sequence[str]) -> None:
    """Plan each of ``names`` into ``out / name / plan.json`` (in this process's ``kareus_fx``)."""
    import kareus_fx
    from kareus_fx.plan.planner import make_plan

    print(f"recording with {Path(kareus_fx.__file__).parent.resolve()}", flush=True)
    for name in names:
        folder = out / name.replace(":", "_").replace(",", "_").replace("=", "-")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="kareus-identity-") as work:
            outcome = make_plan(request_for(name), work, progress=False)
        (folder / "plan.json").write_text(json.dumps(outcome.data, indent=1, sort_keys=True))
        print(f"{name}: planned in {outcome.wall_s['total_s']:.1f} s", flush=True)


def differences(a: Any, b: Any, path: str = "") -> Iterator[str]:
    """Every path at which ``a`` and ``b`` differ (exact equality; floats included)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                yield f"{path}/{key}: only in {'the first' if key in a else 'the second'}"
            else:
                yield from differences(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path}: {len(a)} items against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            yield from differences(x, y, f"{path}[{i}]")
    elif a != b or type(a) is not type(b):
        yield f"{path}: {a!r} != {b!r}"


def compare(first: Path, second: Path) -> int:
    """Compare the plans recorded in two folders; the number of plans that differ."""
    names = sorted(p.parent.name for p in first.glob("*/plan.json"))
    if not names:
        raise SystemExit(f"no */plan.json under {first}: record plans there first (--record)")
    differing = 0
    for name in names:
        other = second / name / "plan.json"
        if not other.exists():
            print(f"{name}: missing from {second}")
            differing += 1
            continue
        a, b = (json.loads(p.read_text()) for p in (first / name / "plan.json", other))
        for field in VOLATILE_FIELDS:
            a.pop(field, None)
            b.pop(field, None)
        found = list(differences(a, b))
        print(f"{name}: {'identical' if not found else f'{len(found)} differences'}")
        for line in found[:20]:
            print(f"  {line}")
        differing += bool(found)
    return differing


def package_view(checkout: Path, into: Path) -> Path:
    """A folder that imports as ``kareus_fx`` from ``checkout``: links to its modules, with
    ``passes/``, ``runtime/`` and ``cost_models/`` under ``kareus_fx/`` as the install maps them."""
    package = into / "kareus_fx"
    package.mkdir(parents=True)
    for entry in (checkout / PACKAGE_FOLDERS["kareus_fx"]).iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in PACKAGE_FOLDERS.items():
        if name != "kareus_fx":
            (package / name).symlink_to(checkout / folder)
    return into


def record_revision(rev: str, out: Path, names: Sequence[str], scratch: Path) -> None:
    """Record ``names`` with the code of git revision ``rev`` (a detached worktree under ``scratch``),
    by that revision's own copy of this script, so that the planner names it imports are that revision's."""
    tree = scratch / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True)
    try:
        view = package_view(tree, scratch / "view")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(view), os.environ.get("PYTHONPATH", "")])}
        args = [sys.executable, str(tree / "bench" / Path(__file__).name), "--record", str(out), "--presets", *names]
        subprocess.run(args, check=True, env=env, cwd=tree)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--against", metavar="REV", help="plan with git revision REV and this tree, and compare")
    mode.add_argument("--record", metavar="DIR", type=Path, help="plan every preset into DIR")
    mode.add_argument("--compare", nargs=2, metavar="DIR", type=Path, help="compare two recorded folders")
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), help="preset names or custom: entries")
    parser.add_argument("--keep", type=Path, help="with --against: record into DIR/before and DIR/after")
    args = parser.parse_args(argv)
    names = args.presets
    if args.record:
        record(args.record, names)
        return 0
    if args.compare:
        return int(compare(*args.compare) > 0)
    with tempfile.TemporaryDirectory(prefix="kareus-identity-") as scratch:
        root = args.keep or Path(scratch)
        record_revision(args.against, root / "before", names, Path(scratch))
        record(root / "after", names)
        return int(compare(root / "before", root / "after") > 0)


if __name__ == "__main__":
    sys.exit(main())
