"""Write one :class:`~kareus_fx.deploy.run_record.RunRecord` per iteration of a deployed plan.

Enabled by the backend option ``run_log``: a path (``options={"plan": ..., "run_log": "run.jsonl"}``)
or a dict of :class:`RunLogOptions` fields. Every deployed graph of the process reports each call
to the process's :class:`RunLog` of that path, so it works wherever a plan is deployed:
``torch.compile`` with a plan, stages under ``torch.distributed.pipelining``
(:func:`~kareus_fx.deploy.pipelining.kareus_stage` passes the options on) and blocks compiled by
the torchtitan integration.

Iteration boundary: an iteration starts at the first forward of microbatch 0 after a backward ran
(or the first call at all); this holds for a plain loop, a ``StepContext`` and every pipelining
schedule a plan deploys under (each starts with microbatch 0's forward), and for several graphs
or per-block graphs of one iteration (only the first forward of microbatch 0 opens it). So an
iteration is recorded when the next one starts, and the last one by :func:`close_run_logs`
(``follow_plan`` calls it on exit; a plain loop calls it after training, or it runs at exit).
The measured time is start to start: it includes the optimizer step and data loading between
two iterations, which the plan does not price.

Measurement: one Zeus window per iteration (:class:`~kareus_fx.runtime.energy.IterationEnergyMonitor`,
which synchronises CUDA at both ends) on this process's GPU (its energy covers that one GPU); on CPU Zeus measures time only, and
the energy written is the plan's price of the point run, labelled ``energy_source: simulated``.
With a process group of more than one rank each rank writes its own file: ``{rank}`` in the path
is replaced by the rank, otherwise ``.rank<R>`` goes before the suffix. Drift is checked per rank
(:mod:`kareus_fx.deploy.plan_drift`).

Bucketed plans (``deploy/bucket_dispatch.py``): every bucket's graphs report to the one run log of
the plan, naming their bucket; a record names the iteration's bucket and holds that bucket's
prediction and clocks. An iteration's microbatches are assumed to share a bucket (batches padded
to one length); when they do not, the record takes the largest bucket run, whose prediction
bounds the mix from above. A call that no bucket holds runs without the plan: it ends the open
iteration (recorded start to that call) and iterations until the next planned call are not
recorded, since there is no prediction to compare them with.
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kareus_fx.compose.pipeline_schedule import PipelineNode
from kareus_fx.deploy.plan_drift import DriftCheck
from kareus_fx.deploy.run_record import RunRecord, record_line
from kareus_fx.errors import OptionsError
from kareus_fx.plan.plan_format import Plan
from kareus_fx.runtime.energy import IterationEnergyMonitor

__all__ = ["RunLog", "RunLogOptions", "close_run_logs", "run_log_for"]


class RunLogOptions(BaseModel):
    """The backend option ``run_log`` as a dict (a bare path sets ``path`` only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path
    drift_threshold: float = Field(0.15, gt=0, description="relative drift of a median ratio that warns")
    drift_window: int = Field(5, ge=1, description="iterations whose median ratio is compared")
    warmup: int = Field(2, ge=0, description="first iterations the drift check skips (compilation)")
    compare_time_on_cpu: bool = Field(False, description="compare time with the plan without a GPU too")

    @classmethod
    def from_option(cls, value: Any) -> RunLogOptions:
        """Validate the option's raw value."""
        if isinstance(value, (str, Path)):
            value = {"path": value}
        if not isinstance(value, Mapping):
            raise OptionsError(f"option 'run_log' must be a path or a dict of RunLogOptions fields, got {value!r}")
        try:
            return cls(**value)
        except ValidationError as err:
            raise OptionsError(f"option 'run_log': {err}") from None


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_path(path: Path, rank: int, world: int) -> Path:
    """The file ``rank`` writes (see the module docstring)."""
    if "{rank}" in str(path):
        return Path(str(path).format(rank=rank))
    return path if world == 1 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


class RunLog:
    """One rank's run log of one plan (made by :func:`run_log_for`)."""

    def __init__(self, options: RunLogOptions, plan: Plan, clocks_requested: bool) -> None:
        self.options, self.plan, self.clocks_requested = options, plan, clocks_requested
        self.rank, world = _rank()
        self.path = rank_path(options.path, self.rank, world)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.monitor = IterationEnergyMonitor()
        self.drift = DriftCheck(
            options.drift_threshold, options.drift_window, options.warmup, options.compare_time_on_cpu
        )
        self.iterations = 0
        self._open_point: int | None = None
        self._open_bucket: int | None = None
        self._bucket_plans: dict[int, Plan] = {}
        self._saw_backward = False
        self._stages: set[int] = set()
        self._clocks_mhz: dict[str, int] = {}

    def called(self, node: PipelineNode, point: int, bucket: int | None = None) -> None:
        """A deployed graph runs ``node`` at frontier point ``point`` of ``bucket`` (None: a
        one-length plan); the dispatcher calls this."""
        if node.instruction == "forward" and node.microbatch == 0 and (self._open_point is None or self._saw_backward):
            self._end_iteration()
            self.monitor.begin_iteration()
            self._open_point, self._open_bucket, self._saw_backward = point, bucket, False
        if node.instruction == "backward":
            self._saw_backward = True
        if bucket is not None and self._open_bucket is not None and bucket > self._open_bucket:
            self._open_point, self._open_bucket = point, bucket  # the larger bucket's point and prediction
        self._stages.add(node.stage)
        option = self._plan_of(bucket).option(point, node.stage, node.instruction, node.microbatch)
        self._clocks_mhz[str(node)] = int(option["clock_mhz"])

    def unplanned(self) -> None:
        """A call runs without the plan (no bucket holds it): record the open iteration, if any."""
        self._end_iteration()

    def _plan_of(self, bucket: int | None) -> Plan:
        """The plan whose prediction and clocks hold for ``bucket``."""
        if bucket is None:
            return self.plan
        if bucket not in self._bucket_plans:
            self._bucket_plans[bucket] = self.plan.bucket(bucket)
        return self._bucket_plans[bucket]

    def close(self) -> None:
        """Record the open iteration, if any."""
        self._end_iteration()

    def _end_iteration(self) -> None:
        point = self._open_point
        if point is None:
            return
        measured = self.monitor.end_iteration()
        workload = self.plan.workload
        bucket = self._open_bucket
        predicted = self._plan_of(bucket).frontier[point]
        simulated = measured.energy_j is None
        pipeline_gpus = int(workload["tp"] * workload["cp"] * workload["pp"])
        record = RunRecord(
            iteration=self.iterations,
            rank=self.rank,
            stages=sorted(self._stages),
            plan=str(self.plan.source),
            gpu=self.plan.gpu,
            point=point,
            bucket=bucket,
            clocks_mhz=dict(sorted(self._clocks_mhz.items())),
            clocks_requested=self.clocks_requested,
            time_s=max(measured.time_s, 1e-9),
            energy_j=float(predicted["energy_j"]) if measured.energy_j is None else measured.energy_j,
            energy_source="simulated" if simulated else "zeus",
            gpus_measured=pipeline_gpus if simulated else 1,
            predicted_time_s=float(predicted["time_s"]),
            predicted_energy_j=float(predicted["energy_j"]),
            predicted_gpus=pipeline_gpus,
        )
        with self.path.open("a") as file:
            file.write(record_line(record))
        self.iterations += 1
        self._open_point = self._open_bucket = None
        self._stages.clear()
        self._clocks_mhz.clear()
        self.drift.observe(record)


_RUN_LOGS: dict[Path, RunLog] = {}


def run_log_for(options: RunLogOptions, plan: Plan, clocks_requested: bool) -> RunLog:
    """The process's run log of ``options.path`` (one per path, shared by every deployed graph)."""
    log = _RUN_LOGS.get(options.path)
    if log is None or log.plan.source != plan.source:
        if log is not None:
            log.close()
        log = _RUN_LOGS[options.path] = RunLog(options, plan, clocks_requested)
    return log


def close_run_logs() -> None:
    """Record every run log's last iteration and forget them (a later deployment starts a new file)."""
    for log in _RUN_LOGS.values():
        log.close()
    _RUN_LOGS.clear()


atexit.register(close_run_logs)
