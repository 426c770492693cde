"""Switch frontier points between iterations without recompiling.

A plan holds a whole iteration frontier; a :class:`PointSwitcher` lets the job move along it
while it trains::

    switcher = PointSwitcher("plan.json", candidates=5, target="max-throughput", group=replica_group)
    switcher.prepare_collectives([tp_group])            # every candidate's SM-limited communicators
    compiled = torch.compile(model, backend="kareus",
                             options={"switching": switcher, "clock_controller": controller})
    for step in range(steps):
        train_one_iteration(compiled)                     # every microbatch's forward and backward
        switcher.step(policy, switcher.observation(power_budget_w=budget_w))

- Candidates: the frontier points whose variants are compiled, once, before training: a number
  (default :data:`DEFAULT_CANDIDATES`, spread evenly over the frontier's time range, see
  :func:`spread_candidates`) or explicit frontier indices. The compile-time target's point is
  always one, and the job starts on it. A point outside the set is refused
  (:class:`PointSwitchError`), never compiled during training.
- Compile: each Dynamo graph's :class:`~kareus_fx.deploy.deployment.Deployment` compiles the
  variants every candidate needs (two points sharing a variant share its compile) and dispatches
  each call to the variant, clock schedule and split of the switcher's current point.
- Switch: :meth:`PointSwitcher.switch_to` / :meth:`PointSwitcher.step` are collective over the
  switcher's ``group`` (the ranks of one pipeline: one data-parallel replica; default the whole
  job): the group's first rank decides (it alone runs the policy) and broadcasts the frontier
  index, so every rank of a pipeline changes point at the same iteration boundary. A call while
  an iteration is under way (a microbatch's forward ran without its backward, a StepContext is
  running an instruction) is refused.
- Clocks: the next instruction's clock hook requests the new point's clock; an active
  :class:`~kareus_fx.runtime.step_context.StepContext` gets the new point's clock schedule.
- Power limits (``limit_candidates``, ``power_limit``): candidates may also be points of the
  plan's Kareus power-limit curve (``methods.kareus.power_limits``, ``plan/kareus_power_limit_curves.py``:
  the max-throughput point's schedule, every clock request at the maximum, under one job-wide
  limit). Such a point has index ``len(plan.frontier) + j`` (``j``: its row of the curve); it runs
  the max-throughput point's variants, requests the maximum clock for every instruction and sets
  its limit through the :class:`~kareus_fx.runtime.power_limit_controller.PowerLimitController`; a clock
  point runs under the curve's first (unlimited: the TDP) limit. A switch sets the limit only when
  it changes, at the same iteration boundary as the clocks.

Assumptions: one process drives one GPU and runs one pipeline stage (as the deployment); the
plan is not bucketed by sequence length (a bucketed plan's buckets have their own frontiers).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.deploy.plan_clocks import clock_schedule
from kareus_fx.errors import KareusError, OptionsError
from kareus_fx.plan.plan_format import Plan, Target, load_plan
from kareus_fx.policies.base import FrontierPoint, Observation, Policy
from kareus_fx.runtime.collectives import prepare_comm_groups
from kareus_fx.runtime.power_limit_controller import PowerLimitController
from kareus_fx.runtime.step_context import ClockSchedule, active_step_context

__all__ = ["DEFAULT_CANDIDATES", "PointSwitchError", "PointSwitcher", "Switch", "spread_candidates"]

_FAILED = -1
"""What the deciding rank broadcasts when it has no valid decision."""

DEFAULT_CANDIDATES = 5
"""Candidate points compiled when the user names no number: a handful spread over the frontier."""


class _Cursor(Protocol):
    @property
    def microbatches(self) -> int: ...

    def at_iteration_boundary(self) -> bool: ...


class _Attached(Protocol):
    """What the switcher reads of a Deployment (``deploy/deployment.py`` imports this module, so
    the switcher names only these two attributes instead of importing it back)."""

    @property
    def stage(self) -> int: ...

    @property
    def cursor(self) -> _Cursor: ...


class PointSwitchError(KareusError, ValueError):
    """A switch the deployment cannot make: a point outside the candidates, or mid-iteration."""


@dataclass(frozen=True)
class Switch:
    """One change of point: after ``iteration`` iterations, from one frontier index to another."""

    iteration: int
    from_index: int
    to_index: int


def spread_candidates(plan: Plan, count: int, target: Target = "max-throughput") -> tuple[int, ...]:
    """``count`` frontier indices spread over the frontier's time range, plus ``target``'s point.

    For each of ``count`` evenly spaced times from the fastest to the slowest point, the point
    nearest in time (ties: less energy); duplicates collapse, so a frontier of fewer points gives
    fewer. Returned sorted by predicted time."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PointSwitchError(f"candidates must be a positive number of points or a list of indices, got {count!r}")
    points = plan.frontier
    times = [float(p["time_s"]) for p in points]
    low, high = min(times), max(times)
    chosen = {plan.point_index(target)}
    for k in range(count):
        goal = low if count == 1 else low + (high - low) * k / (count - 1)
        chosen.add(min(range(len(points)), key=lambda i: (abs(times[i] - goal), points[i]["energy_j"])))
    return tuple(sorted(chosen, key=lambda i: (times[i], points[i]["energy_j"])))


class PointSwitcher:
    """The candidate points of one plan, the point the job runs, and the collective switch.

    ``plan``: a plan file or :class:`~kareus_fx.plan.plan_format.Plan` (not bucketed).
    ``candidates``: how many points to compile (spread over the frontier) or their frontier
    indices. ``target``: the compile-time target; its point is always a candidate and runs first.
    ``group``: the ranks of this pipeline (one data-parallel replica), who switch together; None:
    every rank of the job (or a single process without torch.distributed).
    ``limit_candidates``: rows of the plan's Kareus power-limit curve to add as candidates, set
    through ``power_limit`` (module docstring).
    """

    def __init__(
        self,
        plan: str | Path | Plan,
        *,
        candidates: int | Sequence[int] = DEFAULT_CANDIDATES,
        target: Target = "max-throughput",
        group: dist.ProcessGroup | None = None,
        limit_candidates: Sequence[int] = (),
        power_limit: PowerLimitController | None = None,
    ) -> None:
        self.plan = plan if isinstance(plan, Plan) else load_plan(plan)
        if self.plan.buckets:
            raise OptionsError(
                f"the plan {self.plan.source} is bucketed by sequence length; point switching needs a "
                f"one-length plan (`kareus plan --seq N`)"
            )
        self.target = target if isinstance(target, str) else {k: float(v) for k, v in target.items()}
        self.start_index = self.plan.point_index(self.target)
        if isinstance(candidates, int):
            indices = spread_candidates(self.plan, candidates, self.target)
        else:
            indices = self._checked_indices(candidates)
        frontier = self.plan.frontier
        self.power_limit = power_limit
        self._fastest_index = self.plan.point_index("max-throughput")
        self._unlimited_w, self.limits_w = self._limit_points(limit_candidates)
        """Candidate index -> (limit_w, time_s, energy_j) of each power-limit candidate. The job
        starts on a clock point, under the limit found at the controller's open (the TDP assumed)."""
        limited = [FrontierPoint(i, t, e) for i, (_, t, e) in self.limits_w.items()]
        self.candidates: tuple[FrontierPoint, ...] = tuple(
            sorted(
                [*(FrontierPoint.from_plan_point(i, frontier[i]) for i in indices), *limited],
                key=lambda p: (p.time_s, p.index),
            )
        )
        """The points compiled, sorted by predicted time (what a policy chooses from)."""
        self.group = group
        self.current_index = self.start_index
        self.iteration = 0
        """Iterations ended so far (one per :meth:`switch_to` / :meth:`step` call)."""
        self.switches: list[Switch] = []
        self._deployments: list[_Attached] = []
        self._started_s = time.monotonic()

    def _limit_points(self, rows: Sequence[int]) -> tuple[int | None, dict[int, tuple[int, float, float]]]:
        """The curve's first (unlimited: the TDP) limit, and candidate index -> (limit_w, time_s,
        energy_j) of each of ``rows`` of the plan's Kareus power-limit curve (None, {} without rows)."""
        if not rows:
            return None, {}
        curve = self.plan.data["methods"].get("kareus", {}).get("power_limits")
        if not curve:
            raise OptionsError(
                f"the plan {self.plan.source} has no Kareus power-limit curve (methods.kareus.power_limits): it "
                f"was made before kareus-fx priced one, or measured on a GPU; re-run `kareus plan` with the "
                f"simulated profiler, or switch clock points only (no limit_candidates)"
            )
        bad = [j for j in rows if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < len(curve)]
        if bad:
            raise PointSwitchError(
                f"limit_candidates must be rows of the plan's Kareus power-limit curve (0..{len(curve) - 1}: "
                f"{[int(row[0]) for row in curve]} W), got {list(rows)!r}"
            )
        if self.power_limit is None:
            raise OptionsError(
                "limit_candidates need a power_limit controller to set them: pass "
                "power_limit=PowerLimitController.open('real' | 'dry-run', gpu_index=LOCAL_RANK)"
            )
        size = len(self.plan.frontier)
        return int(curve[0][0]), {
            size + j: (int(curve[j][0]), float(curve[j][1]), float(curve[j][2])) for j in sorted(set(rows))
        }

    def _checked_indices(self, indices: Sequence[int]) -> tuple[int, ...]:
        size = len(self.plan.frontier)
        bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < size]
        if bad or not indices:
            raise PointSwitchError(
                f"candidate indices must be frontier indices of the plan {self.plan.source} (0..{size - 1}), "
                f"got {list(indices)!r}"
            )
        return tuple(sorted({*indices, self.start_index}))

    # ----- what the deployment and the user read --------------------------------------------------
    @property
    def candidate_indices(self) -> tuple[int, ...]:
        return tuple(p.index for p in self.candidates)

    @property
    def current(self) -> FrontierPoint:
        """The point the job runs now."""
        return self.point(self.current_index)

    def point(self, index: int) -> FrontierPoint:
        """The candidate at frontier index ``index``; :class:`PointSwitchError` for any other."""
        for point in self.candidates:
            if point.index == index:
                return point
        raise PointSwitchError(
            f"frontier point {index} of the plan {self.plan.source} is not a candidate of this "
            f"PointSwitcher (compiled: {list(self.candidate_indices)}); only candidates' variants were "
            f"compiled before training: pass it in PointSwitcher(candidates=[...]) and restart"
        )

    @property
    def compiled_points(self) -> tuple[int, ...]:
        """The frontier points whose variants the candidates run (what a deployment compiles)."""
        return tuple(sorted({self.variant_point(i) for i in self.candidate_indices}))

    def variant_point(self, index: int) -> int:
        """The frontier point whose variants candidate ``index`` runs: itself, or for a power-limit
        point the max-throughput point."""
        return self._fastest_index if self.point(index).index in self.limits_w else index

    def limit_w(self, index: int | None = None) -> int | None:
        """The power limit candidate ``index`` (default: the current point) runs under: its own,
        the unlimited one for a clock point; None without power-limit candidates."""
        index = self.current_index if index is None else index
        return self.limits_w[index][0] if index in self.limits_w else self._unlimited_w

    def clock_schedule(self, index: int | None = None) -> ClockSchedule:
        """The clock schedule of candidate ``index`` (default: the current point), e.g. for a
        StepContext: a power-limit point's is the maximum clock for every instruction."""
        point = self.point(self.current_index if index is None else index).index
        if point in self.limits_w:
            return clock_schedule(self.plan, self._fastest_index, gpu_spec(self.plan.gpu).clock_max_mhz)
        return clock_schedule(self.plan, point)

    def plan_for(self, path: Path | None) -> Plan:
        """The plan to deploy; option ``plan``, when given, must be the same plan."""
        if path is not None and load_plan(path).data != self.plan.data:
            raise OptionsError(
                f"option 'plan' {path} is not the PointSwitcher's plan {self.plan.source}; give the plan "
                f"to the PointSwitcher only"
            )
        return self.plan

    def attach(self, deployment: _Attached) -> None:
        """Called by each Deployment built with this switcher (for the iteration-boundary check)."""
        self._deployments.append(deployment)

    def prepare_collectives(
        self, groups: Iterable[dist.ProcessGroup | None] = (), *, timeout_s: float | None = None
    ) -> frozenset[int]:
        """:func:`~kareus_fx.deploy.deployment.prepare_collectives` for every candidate point."""
        sm_counts = frozenset().union(*(self.plan.comm_sm_counts(i) for i in self.compiled_points))
        prepare_comm_groups(sm_counts, groups, timeout_s)
        return sm_counts

    def observation(self, **signals: float | None) -> Observation:
        """An :class:`~kareus_fx.policies.base.Observation` of this iteration boundary with ``signals``
        (its optional fields, e.g. ``power_budget_w``)."""
        return Observation(
            iteration=self.iteration,
            elapsed_s=time.monotonic() - self._started_s,
            current_index=self.current_index,
            **signals,
        )

    # ----- switching ----------------------------------------------------------------------------
    def step(self, policy: Policy, observation: Observation) -> int:
        """End an iteration: the group's first rank asks ``policy``; every rank runs its answer next.

        Collective over ``group``: every rank of it calls this at the same iteration boundary.
        Returns the frontier index the next iteration runs."""
        proposal = None
        if self._leads():
            try:
                proposal = policy.choose(self.candidates, observation)
            except BaseException:
                self._broadcast(_FAILED)  # the other ranks raise instead of waiting for a decision
                raise
        return self.switch_to(proposal)

    def switch_to(self, index: int | None) -> int:
        """End an iteration and run the group first rank's ``index`` from the next one on.

        Collective over ``group`` (the other ranks' ``index`` is ignored, None allowed). A
        frontier index outside the candidates, or a call in the middle of an iteration, raises
        :class:`PointSwitchError` on every rank."""
        decided = self._agree(index)
        point = self.point(decided)
        self._check_boundary()
        self.iteration += 1
        if point.index != self.current_index:
            self.switches.append(Switch(self.iteration, self.current_index, point.index))
            limit_w = self.limit_w(point.index)
            if self.power_limit is not None and limit_w is not None and limit_w != self.limit_w():
                self.power_limit.set_limit_w(limit_w)
            self.current_index = point.index
            context = active_step_context()
            if context is not None:
                context.schedule = self.clock_schedule()
        return point.index

    def _leads(self) -> bool:
        return not _distributed() or dist.get_rank(self.group) == 0

    def _agree(self, index: int | None) -> int:
        """The group's first rank's ``index``, on every rank of the group (one broadcast)."""
        bad = self._leads() and (index is None or isinstance(index, bool) or not isinstance(index, int) or index < 0)
        decided = self._broadcast(_FAILED if bad or index is None else index)
        if bad:
            raise PointSwitchError(f"the point to switch to must be a frontier index (int >= 0), got {index!r}")
        if decided == _FAILED:
            raise PointSwitchError(
                "the first rank of this pipeline's group failed to choose the next point (its traceback says why)"
            )
        return decided

    def _broadcast(self, value: int) -> int:
        """The group's first rank's ``value`` on every rank of the group."""
        if not _distributed():
            return value
        tensor = torch.tensor([value if self._leads() else _FAILED], dtype=torch.int64)
        dist.broadcast(tensor, group=self.group, group_src=0)
        return int(tensor.item())

    def _check_boundary(self) -> None:
        context = active_step_context()
        if context is not None and context.current is not None:
            raise PointSwitchError(
                f"a point switch was asked while {context.current} runs; switch only between iterations "
                f"(after the last instruction's `with steps.step(...)` block)"
            )
        for deployment in self._deployments:
            if not deployment.cursor.at_iteration_boundary():
                raise PointSwitchError(
                    f"a point switch was asked in the middle of an iteration: stage {deployment.stage} has not "
                    f"run the forward and backward of all {deployment.cursor.microbatches} microbatches; "
                    f"switch only after an iteration's last backward"
                )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
