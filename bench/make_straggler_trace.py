"""Write the synthetic straggler trace ``bench/traces/straggler_synthetic.csv``.

Synthetic, not measured: straggler episodes arrive as a Poisson process (one every
``--mean-gap-h`` hours on average), last an exponential time (mean ``--mean-duration-h``), slow one
data-parallel replica (uniform over ``--replicas``) by a factor uniform in [1.05, 1.30] (a slow
or thermally throttled GPU, a congested link), and never overlap. Each row is one hour:
``hour,slow_replica,slowdown`` (replica -1 and slowdown 1.0: nobody is slow).

    python bench/make_straggler_trace.py --hours 720 --seed 0
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "traces" / "straggler_synthetic.csv"
SLOWDOWN_RANGE = (1.05, 1.30)


def straggler_rows(hours: int, replicas: int, mean_gap_h: float, mean_duration_h: float, seed: int) -> list[tuple]:
    """``(hour, slow_replica, slowdown)`` for each hour (see the module docstring)."""
    rng = np.random.default_rng(seed)
    rows: list[tuple] = []
    hour = 0
    while hour < hours:
        gap = int(rng.exponential(mean_gap_h))
        rows.extend((h, -1, 1.0) for h in range(hour, min(hours, hour + gap)))
        hour += gap
        duration = max(1, round(rng.exponential(mean_duration_h)))
        replica = int(rng.integers(replicas))
        slowdown = round(float(rng.uniform(*SLOWDOWN_RANGE)), 3)
        rows.extend((h, replica, slowdown) for h in range(hour, min(hours, hour + duration)))
        hour += duration
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=int, default=720)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--mean-gap-h", type=float, default=36.0)
    parser.add_argument("--mean-duration-h", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows = straggler_rows(args.hours, args.replicas, args.mean_gap_h, args.mean_duration_h, args.seed)
    with args.out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["hour", "slow_replica", "slowdown"])
        writer.writerows(rows)
    print(f"wrote {args.out}: {len(rows)} hours, {sum(r[1] >= 0 for r in rows)} with a straggler")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
