"""Deploy a bucketed plan (``kareus plan --seq 2048,4096,8192``): pick the bucket per call.

A bucketed plan holds one plan per sequence length (``plan/bucketed_plan.py``). On a Dynamo graph whose
sequence length is symbolic (automatic dynamic, ``mark_dynamic``, ``dynamic=True``) every bucket
is deployed as a :class:`~kareus_fx.deploy.deployment.Deployment` of its own: the graph is
compiled once per bucket with its symbolic sizes evaluated at the bucket's length (the analysis,
the partition costs and the plan check by fingerprint see the graph as the planner traced it at
that length), and each call runs the smallest bucket that holds its length, at that bucket's
clocks and schedules. The buckets share one microbatch cursor, so a step whose microbatches fall
in different buckets still counts them in order.

A one-length plan deployed on a graph whose sequence length is symbolic is deployed the same way,
as one bucket of its ``workload.seq``.

A graph with a concrete sequence length (Dynamo's first compile, before it has seen a second
length) is deployed on the bucket of exactly that length. A call that no bucket holds (longer
than the largest, or a concrete length that is not a bucket) runs the un-split graph without the
plan, with one :class:`~kareus_fx.deploy.plan_checks.PlanDeviationWarning` per length that names
the length and the fix.

With the option ``run_log`` every bucket reports its calls to the plan's one run log, naming the
bucket, and a call that no bucket holds tells it that it runs without the plan
(``deploy/run_log.py``).

The sequence length is dim 1 of the first batch-carrying input of two or more dims that the
nanobatch split found (``input_ids`` / ``hidden_states`` laid out ``[batch, seq, ...]``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import sympy
import torch
import torch.fx

from kareus_fx.config import KareusOptions
from kareus_fx.deploy.deployment import Deployment, clock_binding
from kareus_fx.deploy.plan_checks import PlanDeviationWarning, PlanMismatchError
from kareus_fx.deploy.run_log import RunLog
from kareus_fx.plan.plan_format import Plan

__all__ = ["BucketedDeployment", "SequenceInput", "deployment_from_options", "sequence_input"]

CompileOne = Callable[[Deployment | None], Callable[..., Any]]
"""Compile the Dynamo graph with a bucket's deployment (None: un-split, without the plan)."""


def deployment_from_options(opts: KareusOptions) -> Deployment | BucketedDeployment | None:
    """:meth:`Deployment.from_options`, as a :class:`BucketedDeployment` for a bucketed plan."""
    deployment = Deployment.from_options(opts)
    if deployment is None or not deployment.plan.buckets:
        return deployment
    return BucketedDeployment.from_plan(deployment.plan, opts, deployment.run_log)


@dataclass(frozen=True)
class SequenceInput:
    """Where a call's sequence length is read: ``args[index].shape[1]``; ``symbol`` is the graph's
    shape symbol for it (None: the graph was compiled for the one length ``length``)."""

    index: int
    symbol: sympy.Symbol | None
    length: int | None


def sequence_input(gm: torch.fx.GraphModule, batch_inputs: tuple[str, ...]) -> SequenceInput | None:
    """The sequence dim of ``gm`` (see the module docstring); None when no batch input has one."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if node.name not in batch_inputs or not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        size = value.shape[1]
        if isinstance(size, torch.SymInt) and size.node.maybe_as_int() is None:
            expr = size.node.expr
            return SequenceInput(index, expr, None) if expr.is_Symbol else None
        return SequenceInput(index, None, int(size))
    return None


@dataclass
class BucketedDeployment:
    """One :class:`Deployment` per bucket of ``plan`` (keyed by sequence length)."""

    plan: Plan
    buckets: dict[int, Deployment]
    run_log: RunLog | None = None
    """The plan's run log, told of the calls that run without the plan; None: no run log."""

    @classmethod
    def from_plan(cls, plan: Plan, opts: KareusOptions, run_log: RunLog | None = None) -> BucketedDeployment:
        """Every bucket of ``plan`` deployed at ``opts.target``, each reporting to ``run_log``."""
        buckets: dict[int, Deployment] = {}
        for seq in plan.buckets:
            bucket = plan.bucket(seq)
            point = bucket.point_index(opts.target)
            clock = clock_binding(bucket, point, opts.clock_controller)
            buckets[seq] = Deployment(
                plan=bucket,
                point_index=point,
                stage=opts.stage,
                clock=clock,
                dump_dir=opts.dump_dir,
                run_log=run_log,
                bucket=seq,
            )
        cursor = buckets[plan.buckets[0]].cursor
        for deployment in buckets.values():
            deployment.cursor = cursor  # one count of microbatches over all buckets
        return cls(plan=plan, buckets=buckets, run_log=run_log)

    @classmethod
    def of_one_length(cls, deployment: Deployment) -> BucketedDeployment:
        """A one-length plan's deployment as the one bucket of its ``workload.seq``."""
        return cls(
            plan=deployment.plan, buckets={deployment.plan.workload["seq"]: deployment}, run_log=deployment.run_log
        )

    def bucket_for(self, length: int) -> int | None:
        """The smallest bucket holding a call of ``length`` tokens (None: longer than all)."""
        return next((seq for seq in sorted(self.buckets) if length <= seq), None)

    def compile(self, sequence: SequenceInput | None, compile_one: CompileOne) -> Callable[..., Any]:
        """The Dynamo-level callable: per call, the graph of the smallest bucket that holds it."""
        if sequence is None:
            _raise_no_sequence(self.plan)
        compiled: dict[int, Callable[..., Any]] = {}
        if sequence.symbol is None:
            if sequence.length in self.buckets:
                compiled[sequence.length] = compile_one(self.buckets[sequence.length])
        else:
            for seq, deployment in self.buckets.items():
                deployment.sizes = {sequence.symbol: seq}
                compiled[seq] = compile_one(deployment)
        unsplit = compile_one(None)  # now: a compile outside Dynamo's would specialise the shapes
        warned: set[int] = set()
        plan, index, buckets, run_log = self.plan, sequence.index, tuple(sorted(self.buckets)), self.run_log
        fixed = sequence.symbol is None

        def run(*args: Any) -> Any:
            length = int(args[index].shape[1])
            seq = self.bucket_for(length) if not fixed else length
            if seq in compiled:
                return compiled[seq](*args)
            if length not in warned:
                warned.add(length)
                warnings.warn(_outside_message(plan, buckets, length, fixed), PlanDeviationWarning, stacklevel=2)
            if run_log is not None:
                run_log.unplanned()
            return unsplit(*args)

        return run


def _outside_message(plan: Plan, seqs: tuple[int, ...], length: int, fixed: bool) -> str:
    buckets = ",".join(map(str, seqs))
    if fixed and length <= seqs[-1]:
        fix = (
            "mark the sequence dim dynamic (torch._dynamo.mark_dynamic(x, 1), or compile with "
            "dynamic=True) so one graph serves every bucket, or add the length to --seq"
        )
    else:
        fix = f"re-plan with `kareus plan --seq {buckets},{length}` to cover it"
    return (
        f"a call of sequence length {length} is in no bucket of the plan {plan.source} "
        f"(buckets {buckets}); it runs un-split without the plan. Fix: {fix}"
    )


def _raise_no_sequence(plan: Plan) -> NoReturn:
    raise PlanMismatchError(
        f"the plan {plan.source} is bucketed by sequence length, but this graph has no batch input "
        f"laid out [batch, seq, ...] to read the length from (or the nanobatch split fell back); "
        f"deploy a one-length plan (`kareus plan --seq N`) on it"
    )
