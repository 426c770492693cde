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
import io
import os
from collections.abc import Mapping, Sequence
from typing import IO, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, TypeAdapter, ValidationError

from kareus_fx.capture.validated_input import MAX_MAGNITUDE, error_text, read_bounded_text
from kareus_fx.compose.iteration import InstructionOption, IterationFrontier, IterationPoint
from kareus_fx.compose.pipeline_schedule import (
    INSTRUCTIONS,
    CompositionError,
    Instruction,
    PipelineNode,
    interleaved_order,
)

__all__ = [
    "MAX_PROFILE_BYTES",
    "PROFILE_COLUMNS",
    "PerseusProfileRow",
    "plan_frequencies",
    "read_perseus_plan",
    "read_perseus_profile",
    "write_perseus_plan",
    "write_perseus_profile",
]

PROFILE_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
MAX_PROFILE_BYTES = 64 * 2**20
"""A profile has a row per (stage, instruction, clock): a few thousand rows, well under 1 MB."""
_FREQUENCY_PLAN = TypeAdapter(list[list[Annotated[StrictInt, Field(gt=0, le=100_000)]]])

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


class PerseusProfileRow(BaseModel):
    """One row of a Perseus profile CSV, from its text cells: a stage >= 0, a known instruction,
    a clock in MHz, a finite time > 0 s and a finite energy >= 0 J."""

    model_config = ConfigDict(frozen=True, str_strip_whitespace=True)

    stage: Annotated[int, Field(ge=0, le=1_000_000)]
    instruction: Instruction
    frequency: Annotated[int, Field(gt=0, le=100_000)]
    time: Annotated[float, Field(gt=0, le=MAX_MAGNITUDE, allow_inf_nan=False)]
    energy: Annotated[float, Field(ge=0, le=MAX_MAGNITUDE, allow_inf_nan=False)]


def read_perseus_profile(source: PathOrFile) -> Profile:
    """Read a Perseus profile CSV into ``{(stage, instruction): [InstructionOption, ...]}``.

    Options keep the file's row order; ``knob`` is the clock in MHz. Each row is validated by
    :class:`PerseusProfileRow`; a file larger than :data:`MAX_PROFILE_BYTES` is refused unread.

    Raises:
        CompositionError: naming the file, line and column: wrong header, a malformed or
            non-finite value, a negative stage, an unknown instruction, a time <= 0, a negative
            energy, a repeated (stage, instruction, frequency), or no rows.
    """
    name = str(source) if isinstance(source, (str, os.PathLike)) else "<stream>"
    if isinstance(source, (str, os.PathLike)):
        text = read_bounded_text(source, MAX_PROFILE_BYTES, CompositionError, "Perseus profile CSV")
    else:
        text = source.read(MAX_PROFILE_BYTES + 1)
        if len(text) > MAX_PROFILE_BYTES:
            raise CompositionError(f"{name}: more than {MAX_PROFILE_BYTES} characters; not a Perseus profile CSV")
    profile: Profile = {}
    seen: set[tuple[int, str, int]] = set()
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != PROFILE_COLUMNS:
            raise CompositionError(f"{name}: expected the header {','.join(PROFILE_COLUMNS)}, got {header!r}")
        for line, cells in enumerate(reader, start=2):
            if not cells or all(not cell.strip() for cell in cells):
                continue
            if len(cells) != len(PROFILE_COLUMNS):
                raise CompositionError(f"{name}:{line}: expected 5 fields, got {len(cells)}")
            try:
                row = PerseusProfileRow.model_validate(dict(zip(PROFILE_COLUMNS, cells)))
            except ValidationError as err:
                raise CompositionError(error_text(err, f"{name}:{line}")) from None
            key = (row.stage, row.instruction, row.frequency)
            if key in seen:
                raise CompositionError(
                    f"{name}:{line}: repeated row for stage {row.stage} {row.instruction} at {row.frequency} MHz"
                )
            seen.add(key)
            profile.setdefault((row.stage, row.instruction), []).append(
                InstructionOption(time_s=row.time, energy_j=row.energy, knob=row.frequency)
            )
    except csv.Error as err:
        raise CompositionError(f"{name}: not a CSV file: {err}") from None
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
    raise CompositionError(f"option {option!r} has no clock: need an integer knob (MHz) or a clock_mhz attribute")


def write_perseus_profile(target: PathOrFile, profile: Mapping[tuple[int, Instruction], Sequence[Any]]) -> None:
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
    """Per GPU (a stage under 1F1B), the clock (MHz) of each instruction at ``point``, in the order
    the GPU runs them (1F1B, or interleaved 1F1B over its chunks)."""
    plan = frontier.plan(point)
    return [
        [
            _frequency_of(plan[PipelineNode(*action)])
            for action in interleaved_order(frontier.num_gpus, frontier.virtual_stages, frontier.num_microbatches, rank)
        ]
        for rank in range(frontier.num_gpus)
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

    Lines starting with ``#`` (the planner's trailing comments) are ignored. The value must be a
    list of lists of clocks (integers in MHz); a file larger than :data:`MAX_PROFILE_BYTES` is
    refused unread.
    """
    if isinstance(source, (str, os.PathLike)):
        text = read_bounded_text(source, MAX_PROFILE_BYTES, CompositionError, "Perseus frequency plan")
    else:
        text = source.read(MAX_PROFILE_BYTES + 1)
    if len(text) > MAX_PROFILE_BYTES:
        raise CompositionError(f"more than {MAX_PROFILE_BYTES} characters: not a Perseus frequency plan")
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    try:
        value = ast.literal_eval(body)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        raise CompositionError(f"not a Perseus frequency plan (a list of lists of ints): {e}") from None
    try:
        return _FREQUENCY_PLAN.validate_python(value)
    except ValidationError as err:
        name = str(source) if isinstance(source, (str, os.PathLike)) else "<stream>"
        raise CompositionError(
            f"{error_text(err, name)}: not a Perseus frequency plan (a list of lists of clocks in MHz)"
        ) from None
