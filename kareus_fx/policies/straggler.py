"""Straggler response (Perseus's extrinsic energy bloat): slow down to the slowest replica.

Data-parallel replicas meet at every gradient synchronisation, so when one replica is slowed (a
slow or throttled GPU, a network hiccup) the others gain nothing by finishing first: they wait.
Perseus moves them to the frontier point whose iteration time matches the straggler's, which
saves energy at no cost in throughput, and back when the straggler recovers.

Two pieces:

- :class:`ReplicaTimes` (the signal): every rank times its own iteration up to the gradient
  synchronisation and calls :meth:`ReplicaTimes.exchange` at every iteration boundary; every
  ``every`` iterations one small all-reduce (one float per replica, MAX) gives each replica's
  time (a replica's time is its slowest rank's). Times are *normalised to the base point*: a
  replica running point p reports ``measured x time(base) / time(p)``, the time it would take at
  the base point as the plan predicts, so a replica that slowed down on purpose does not look
  like a straggler and the straggler's recovery shows.
- :class:`StragglerPolicy` (the choice): when the slowest replica is more than ``tolerance``
  slower than the fastest, a replica that is not the slowest runs the least-energy candidate
  whose predicted time is at most the straggler's (``time(base) x slowest / fastest``, plus
  ``slack``); the slowest replica, and every replica when none straggles, runs the base point.

Assumptions: all replicas run the same plan (identical pipelines, so the fastest replica's
normalised time is a healthy replica's); the plan's predicted time ratios between points hold on
the GPUs (the normalisation relies on them). With dry-run clocks nothing slows down, so a test
on CPU stands in for the GPU's clock (see ``tests/test_straggler_policy.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kareus_fx.errors import KareusError
from kareus_fx.policies.base import FrontierPoint, Observation

__all__ = ["ReplicaTimes", "StragglerPolicy", "StragglerSignalError"]


class StragglerSignalError(KareusError, ValueError):
    """A replica layout or an iteration time the straggler signal cannot use."""


def _base(candidates: Sequence[FrontierPoint], base_index: int | None) -> FrontierPoint:
    if base_index is None:
        return candidates[0]
    for point in candidates:
        if point.index == base_index:
            return point
    raise StragglerSignalError(
        f"the straggler policy's base point {base_index} is not a candidate "
        f"({[p.index for p in candidates]}); pass a compiled point or None (the fastest)"
    )


@dataclass
class StragglerPolicy:
    """Perseus's response to a straggler replica (module docstring).

    ``base_index``: the frontier point replicas run when none straggles (None: the fastest
    candidate); ``tolerance``: a slowest/fastest ratio up to ``1 + tolerance`` is noise, not a
    straggler; ``slack``: a replica may pick a point up to ``slack`` slower than the straggler.
    Without a time signal (an iteration ``ReplicaTimes`` skipped) it keeps the current point.
    """

    base_index: int | None = None
    tolerance: float = 0.03
    slack: float = 0.0

    def choose(self, candidates: Sequence[FrontierPoint], observation: Observation) -> int:
        base = _base(candidates, self.base_index)
        slowest, fastest = observation.slowest_replica_time_s, observation.fastest_replica_time_s
        own = observation.replica_time_s
        if slowest is None or fastest is None or own is None:
            return observation.current_index
        slowdown = slowest / fastest
        if slowdown <= 1 + self.tolerance or own * (1 + self.tolerance) >= slowest:
            return base.index  # nobody straggles, or this replica is the straggler
        straggler_time_s = base.time_s * slowdown * (1 + self.slack)
        within = [p for p in candidates if p.time_s <= straggler_time_s] or [base]
        return min(within, key=lambda p: (p.energy_j, p.time_s)).index


class ReplicaTimes:
    """Each replica's iteration time, normalised to the base point, by one small all-reduce.

    ``replicas``: how many data-parallel replicas; ``replica``: this rank's (0..replicas-1);
    ``group``: a group holding every rank of every replica (default: the whole job); ``every``:
    exchange every K calls (the others return no signal), reporting each replica's mean over
    those K iterations. Every rank of ``group`` calls :meth:`exchange` at every iteration boundary.
    """

    def __init__(self, replicas: int, replica: int, *, group: dist.ProcessGroup | None = None, every: int = 1) -> None:
        for name, value, low in (("replicas", replicas, 1), ("every", every, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise StragglerSignalError(f"{name} must be an int >= {low}, got {value!r}")
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < replicas:
            raise StragglerSignalError(f"replica must be in 0..{replicas - 1}, got {replica!r}")
        self.replicas, self.replica, self.group, self.every = replicas, replica, group, every
        self._pending: list[float] = []

    def exchange(
        self, time_s: float, point: FrontierPoint, candidates: Sequence[FrontierPoint], base_index: int | None = None
    ) -> dict[str, float]:
        """This iteration's ``time_s`` (run at ``point``), and every ``every``-th call the
        observation signals ``slowest_replica_time_s``, ``fastest_replica_time_s`` and
        ``replica_time_s`` (pass them to :meth:`PointSwitcher.observation`); otherwise ``{}``."""
        if not time_s > 0:
            raise StragglerSignalError(f"an iteration time must be a positive number of seconds, got {time_s!r}")
        base = _base(candidates, base_index)
        self._pending.append(time_s * base.time_s / point.time_s)
        if len(self._pending) < self.every:
            return {}
        times = torch.zeros(self.replicas, dtype=torch.float64)
        times[self.replica] = sum(self._pending) / len(self._pending)
        self._pending.clear()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=self.group)
        if bool((times <= 0).any()):
            missing = [r for r in range(self.replicas) if times[r] <= 0]
            raise StragglerSignalError(
                f"no iteration time from replica(s) {missing}: every rank must pass its own replica's "
                f"index (ReplicaTimes(replicas={self.replicas}, replica=...))"
            )
        return {
            "slowest_replica_time_s": float(times.max()),
            "fastest_replica_time_s": float(times.min()),
            "replica_time_s": float(times[self.replica]),
        }
