"""Perseus's profile CSV and frequency plans, so profiles and plans move between Perseus and
kareus-fx.

Profile CSV (what the Perseus planner reads; the columns of the artifact's
``sosp24_data/emulation/stage_profile/*.csv``)::

    stage,instruction,frequency,time,energy
    0,forward,1410,0.0501,23.81

one row per (stage, instruction, clock): time in seconds and energy in joules of one forward or
backward microbatch of that stage on one GPU. It reads into the option mapping that
:func:`kareus_fx.compose.iteration.compose_iteration` takes (knob = the clock in MHz).

Frequency plan: per stage, the clock of each of its instructions in the stage's 1F1B order (the
``freqs_pipeline_NNNNN.py`` lists the Perseus planner writes). Written as a Python list literal
and read back with ``ast.literal_eval`` (never ``eval``).
"""

from __future__ import annotations

import ast
import csv
import math
import os
from collections.abc import Mapping, Sequence
from typing import IO, Any

from kareus_fx.compose.iteration import InstructionOption, IterationFrontier, IterationPoint
from kareus_fx.compose.pipeline import (
    INSTRUCTIONS,
    CompositionError,
    Instruction,
    PipelineNode,
    one_f_one_b_order,
)

__all__ = [
    "PROFILE_COLUMNS",
    "plan_frequencies",
    "read_perseus_plan",
    "read_perseus_profile",
    "write_perseus_plan",
    "write_perseus_profile",
]

PROFILE_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")

Profile = dict[tuple[int, Instruction], list[InstructionOption]]
PathOrFile = str | os.PathLike | IO[str]


def _open(source: PathOrFile, mode: str):
    if isinstance(source, (str, os.PathLike)):
        return open(source, mode, newline="", encoding="utf-8")
    return _NoClose(source)


class _NoClose:
    def __init__(self, f: IO[str]) -> None:
        self.f = f

    def __enter__(self) -> IO[str]:
        return self.f

    def __exit__(self, *exc: object) -> None:
        return None


def read_perseus_profile(source: PathOrFile) -> Profile:
    """Read a Perseus profile CSV into ``{(stage, instruction): [InstructionOption, ...]}``.

    Options keep the file's row order; ``knob`` is the clock in MHz.

    Raises:
        CompositionError: wrong header, a malformed or non-finite value, a negative stage, an
            unknown instruction, a time <= 0, a negative energy, a repeated
            (stage, instruction, frequency), or no rows.
    """
    name = str(source) if isinstance(source, (str, os.PathLike)) else "<stream>"
    profile: Profile = {}
    seen: set[tuple[int, str, int]] = set()
    with _open(source, "r") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != PROFILE_COLUMNS:
            raise CompositionError(
                f"{name}: expected the header {','.join(PROFILE_COLUMNS)}, got {header!r}"
            )
        for line, row in enumerate(reader, start=2):
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(PROFILE_COLUMNS):
                raise CompositionError(f"{name}:{line}: expected 5 fields, got {len(row)}")
            try:
                stage = int(row[0])
                frequency = int(row[2])
                time_s = float(row[3])
                energy_j = float(row[4])
            except ValueError as e:
                raise CompositionError(f"{name}:{line}: {e}") from None
            instruction = row[1].strip()
            if stage < 0:
                raise CompositionError(f"{name}:{line}: negative stage {stage}")
            if instruction not in INSTRUCTIONS:
                raise CompositionError(
                    f"{name}:{line}: unknown instruction {instruction!r}; use one of {INSTRUCTIONS}"
                )
            if not (math.isfinite(time_s) and time_s > 0):
                raise CompositionError(f"{name}:{line}: time must be > 0 seconds, got {row[3]}")
            if not (math.isfinite(energy_j) and energy_j >= 0):
                raise CompositionError(f"{name}:{line}: energy must be >= 0 joules, got {row[4]}")
            if (stage, instruction, frequency) in seen:
                raise CompositionError(
                    f"{name}:{line}: repeated row for stage {stage} {instruction} "
                    f"at {frequency} MHz"
                )
            seen.add((stage, instruction, frequency))
            profile.setdefault((stage, instruction), []).append(  # type: ignore[arg-type]
                InstructionOption(time_s=time_s, energy_j=energy_j, knob=frequency)
            )
    if not profile:
        raise CompositionError(f"{name}: no rows")
    return profile


def _frequency_of(option: Any) -> int:
    knob = getattr(option, "knob", None)
    if isinstance(knob, int) and not isinstance(knob, bool):
        return knob
    clock = getattr(option, "clock_mhz", None)
    if clock is None:
        clock = getattr(knob, "clock_mhz", None)
    if isinstance(clock, int):
        return clock
    raise CompositionError(
        f"option {option!r} has no clock: need an integer knob (MHz) or a clock_mhz attribute"
    )


def write_perseus_profile(
    target: PathOrFile, profile: Mapping[tuple[int, Instruction], Sequence[Any]]
) -> None:
    """Write options (``InstructionOption`` with a MHz knob, or ``MicrobatchPoint``) as a Perseus
    profile CSV, by stage then instruction (forward first), each in the given option order.

    Floats are written with ``repr`` so that reading the file back gives the same numbers.
    """
    order = {inst: i for i, inst in enumerate(INSTRUCTIONS)}
    for key in profile:
        if key[1] not in order:
            raise CompositionError(f"unknown instruction {key[1]!r}; use one of {INSTRUCTIONS}")
    with _open(target, "w") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(PROFILE_COLUMNS)
        for stage, instruction in sorted(profile, key=lambda k: (k[0], order[k[1]])):
            for option in profile[(stage, instruction)]:
                writer.writerow(
                    [
                        stage,
                        instruction,
                        _frequency_of(option),
                        repr(float(option.time_s)),
                        repr(float(option.energy_j)),
                    ]
                )


def plan_frequencies(frontier: IterationFrontier, point: IterationPoint) -> list[list[int]]:
    """Per stage, the clock (MHz) of each instruction at ``point``, in the stage's 1F1B order."""
    plan = frontier.plan(point)
    return [
        [
            _frequency_of(plan[PipelineNode(stage, inst, mb)])
            for inst, mb in one_f_one_b_order(frontier.num_stages, frontier.num_microbatches, stage)
        ]
        for stage in range(frontier.num_stages)
    ]


def write_perseus_plan(target: PathOrFile, frequencies: Sequence[Sequence[int]]) -> None:
    """Write a per-stage frequency plan as the Perseus planner's list literal."""
    with _open(target, "w") as f:
        f.write("[\n")
        for stage_freqs in frequencies:
            f.write(f"{[int(x) for x in stage_freqs]},\n")
        f.write("]\n")


def read_perseus_plan(source: PathOrFile) -> list[list[int]]:
    """Read a Perseus frequency plan list literal (``ast.literal_eval``; never ``eval``).

    Lines starting with ``#`` (the planner's trailing comments) are ignored.
    """
    with _open(source, "r") as f:
        text = f.read()
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    try:
        value = ast.literal_eval(body)
    except (ValueError, SyntaxError) as e:
        raise CompositionError(
            f"not a Perseus frequency plan (a list of lists of ints): {e}"
        ) from None
    if not (
        isinstance(value, list)
        and all(isinstance(s, list) and all(isinstance(x, int) for x in s) for s in value)
    ):
        raise CompositionError("not a Perseus frequency plan (a list of lists of ints)")
    return value
