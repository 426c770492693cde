"""Frontier composition: partition frontiers -> microbatch frontier -> iteration frontier.

- :func:`compose_microbatch` (``microbatch.py``): one clock per microbatch, one configuration per
  partition type, the sequential microbatch always a candidate (Kareus paper 4.4-4.5).
- :func:`compose_iteration` (``iteration.py`` over the 1F1B DAG of ``pipeline_schedule.py``): the Perseus
  way, with lowtime's Phillips-Dessouky solver and the GPU's communication-blocking power for
  idle time.
- ``perseus_csv.py``: Perseus profile CSVs and frequency plans in and out.
"""

from kareus_fx.compose.iteration import (
    ConvexPiecewiseLinearModel,
    InstructionOption,
    IterationFrontier,
    IterationPoint,
    choose_unit_time_s,
    compose_iteration,
    count_solver_steps,
)
from kareus_fx.compose.microbatch import (
    MicrobatchFrontier,
    MicrobatchPoint,
    compose_microbatch,
    pareto_front,
)
from kareus_fx.compose.perseus_csv import (
    plan_frequencies,
    read_perseus_plan,
    read_perseus_profile,
    write_perseus_plan,
    write_perseus_profile,
)
from kareus_fx.compose.pipeline_schedule import (
    CompositionError,
    PipelineNode,
    build_1f1b_dag,
    one_f_one_b_order,
)

__all__ = [
    "CompositionError",
    "ConvexPiecewiseLinearModel",
    "InstructionOption",
    "IterationFrontier",
    "IterationPoint",
    "MicrobatchFrontier",
    "MicrobatchPoint",
    "PipelineNode",
    "build_1f1b_dag",
    "choose_unit_time_s",
    "compose_iteration",
    "compose_microbatch",
    "count_solver_steps",
    "one_f_one_b_order",
    "pareto_front",
    "plan_frequencies",
    "read_perseus_plan",
    "read_perseus_profile",
    "write_perseus_plan",
    "write_perseus_profile",
]
