"""Per-partition-type tuning: the Kareus multi-objective Bayesian optimisation (paper section 4.3).

Entry points:

- :func:`tune_partition` — MBO of one partition type with a :class:`~kareus_fx.workload.Profiler`;
- :func:`tune_partition_types` — several types in parallel processes with progress bars;
- :func:`exhaustive_search`, :func:`random_search` — the ground truth and the baseline;
- :class:`TuningResult` — measured points with provenance, the frontier, statistics; JSON via
  ``to_dict`` / ``from_dict``.
"""

from kareus_fx.tuner.mbo import (
    DEFAULT_BUDGETS,
    Budget,
    MBOSettings,
    MeasuredPoint,
    TuningResult,
    TuningStats,
    converged,
    exhaustive_search,
    frontier_hv_ratio,
    random_search,
    size_class,
    tune_partition,
)
from kareus_fx.tuner.space import SearchSpace, build_search_space
from kareus_fx.tuner.tune_pool import CachedProfilerFactory, tune_partition_types, type_seed

__all__ = [
    "DEFAULT_BUDGETS",
    "Budget",
    "CachedProfilerFactory",
    "MBOSettings",
    "MeasuredPoint",
    "SearchSpace",
    "TuningResult",
    "TuningStats",
    "build_search_space",
    "converged",
    "exhaustive_search",
    "frontier_hv_ratio",
    "random_search",
    "size_class",
    "tune_partition",
    "tune_partition_types",
    "type_seed",
]
