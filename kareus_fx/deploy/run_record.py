"""The run log's format: one JSON object per line, one line per iteration a deployed plan ran.

Each line is a :class:`RunRecord` (``version`` 1). A reader validates every line and names the
first bad one (:class:`RunLogFormatError`: the file, the line number, what is wrong and how to fix
it); a record never mixes measured and simulated numbers without saying so (``energy_source``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kareus_fx.errors import KareusError

__all__ = ["RUN_RECORD_VERSION", "RunLogFormatError", "RunRecord", "read_run_log", "read_run_logs", "record_line"]

RUN_RECORD_VERSION = 1


class RunLogFormatError(KareusError, ValueError):
    """A run log line that is not a valid :class:`RunRecord` (the message names the line)."""


class RunRecord(BaseModel):
    """One iteration of one rank: what ran, what it measured and what the plan predicted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    iteration: int = Field(ge=0, description="0-based iteration of this rank (iteration 0 includes compilation)")
    rank: int = Field(ge=0, description="process rank in the default group (0 without one)")
    stages: list[int] = Field(description="pipeline stages this rank ran in the iteration")
    plan: str = Field(description="the plan file deployed")
    gpu: str = Field(description="the GPU the plan was made for")
    point: int = Field(ge=0, description="frontier point index whose variants and clocks ran")
    bucket: int | None = Field(
        None, ge=1, description="sequence-length bucket of a bucketed plan whose point ran (None: a one-length plan)"
    )
    clocks_mhz: dict[str, int] = Field(description="planned clock of each instruction run, e.g. {'F0@S0': 1410}")
    clocks_requested: bool = Field(description="the clocks were requested from a clock controller")
    time_s: float = Field(gt=0, description="measured wall time of the iteration")
    energy_j: float = Field(ge=0, description="energy of the iteration (see energy_source)")
    energy_source: Literal["zeus", "simulated"] = Field(
        description="zeus: measured on this rank's GPUs through a Zeus window; simulated: the plan's price "
        "of the point run (no GPU to measure)"
    )
    gpus_measured: int = Field(ge=1, description="GPUs energy_j covers")
    predicted_time_s: float = Field(gt=0, description="the plan's iteration time at point")
    predicted_energy_j: float = Field(gt=0, description="the plan's iteration energy at point")
    predicted_gpus: int = Field(ge=1, description="GPUs predicted_energy_j covers (one pipeline: tp x cp x pp)")

    @property
    def time_ratio(self) -> float:
        """Measured over predicted iteration time."""
        return self.time_s / self.predicted_time_s

    @property
    def energy_ratio(self) -> float:
        """Measured over predicted energy per GPU (assumes every GPU of the pipeline costs alike)."""
        return (self.energy_j / self.gpus_measured) / (self.predicted_energy_j / self.predicted_gpus)


def record_line(record: RunRecord) -> str:
    """The record as one JSON line (with its newline)."""
    return record.model_dump_json() + "\n"


def read_run_log(path: str | Path) -> list[RunRecord]:
    """Every record of a run log, in file order; blank lines are skipped."""
    path = Path(path)
    records = []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            records.append(RunRecord.model_validate_json(text))
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in err.errors())
            raise RunLogFormatError(
                f"{path}:{number}: not a run log record (version {RUN_RECORD_VERSION}): {problems}. Each line must be "
                f"one JSON object as docs/formats.md describes; delete or repair the line (a run cut off mid-write "
                f"leaves a partial last line) or record the run again"
            ) from None
    if not records:
        raise RunLogFormatError(f"{path}: no run log records; deploy a plan with options run_log={str(path)!r}")
    return records


def read_run_logs(paths: Sequence[str | Path]) -> list[RunRecord]:
    """The records of several run logs, file after file."""
    return [record for path in paths for record in read_run_log(path)]
