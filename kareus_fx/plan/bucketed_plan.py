"""Plans over sequence-length buckets (``kareus plan --seq 2048,4096,8192``).

One plan per bucket, made by :func:`~kareus_fx.plan.planner.make_plan` with the request's
sequence length set to the bucket's, each in its own work directory (``seq<S>/``: its dumps and
profile database; no measurement of one bucket is one of another's), combined into
one plan file (:func:`~kareus_fx.plan.plan_format.bucketed_plan_data`). A deployment picks, per
call, the smallest bucket holding the call's sequence length (``deploy/bucket_dispatch.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

from kareus_fx.errors import OptionsError
from kareus_fx.plan.plan_format import bucketed_plan_data
from kareus_fx.plan.planner import PlanOutcome, make_plan
from kareus_fx.plan.request import PlanRequest, validate_plan_request

__all__ = ["make_bucketed_plan", "validate_buckets"]


def validate_buckets(req: PlanRequest, seqs: Sequence[int]) -> tuple[int, ...]:
    """The buckets in increasing order; every bucket's request valid (before any tracing)."""
    buckets = tuple(sorted(set(seqs)))
    if not buckets or len(buckets) != len(seqs):
        raise OptionsError(f"--seq: give distinct sequence lengths (buckets), got {list(seqs)}")
    for seq in buckets:
        validate_plan_request(dataclasses.replace(req, seq=seq))
    return buckets


def make_bucketed_plan(
    req: PlanRequest, seqs: Sequence[int], work_dir: str | Path, *, progress: bool = True
) -> PlanOutcome:
    """One plan holding a frontier per bucket of ``seqs``. The outcome's ``iteration`` and the
    plan's top-level fields are the largest bucket's; ``wall_s`` sums the buckets' phases. One
    model runs every bucket, so a ``"balanced"`` stage split is the largest bucket's, for all."""
    buckets = validate_buckets(req, seqs)
    started = time.perf_counter()
    outcomes = {
        buckets[-1]: make_plan(
            dataclasses.replace(req, seq=buckets[-1]), Path(work_dir) / f"seq{buckets[-1]}", progress=progress
        )
    }
    split = outcomes[buckets[-1]].data["workload"]["stage_layers"]
    req = dataclasses.replace(req, stage_layers=tuple(split) if split is not None else req.stage_layers)
    outcomes.update(
        {
            seq: make_plan(dataclasses.replace(req, seq=seq), Path(work_dir) / f"seq{seq}", progress=progress)
            for seq in buckets[:-1]
        }
    )
    outcomes = dict(sorted(outcomes.items()))
    wall_s: dict[str, float] = {}
    for outcome in outcomes.values():
        for phase, seconds in outcome.wall_s.items():
            wall_s[phase] = wall_s.get(phase, 0.0) + seconds
    wall_s["total_s"] = time.perf_counter() - started
    data = bucketed_plan_data({seq: outcome.data for seq, outcome in outcomes.items()})
    data["wall_s"] = wall_s
    return dataclasses.replace(outcomes[buckets[-1]], data=data, wall_s=wall_s)
