"""Planning (docs/design.md steps 4-6): from traced graphs to a versioned plan file.

- ``planner.py``: ``kareus plan`` end to end (trace, tune, baselines, compose, plan data);
- ``presets.py``: the paper's testbed workloads;
- ``graph_workload.py``: dumped graphs as partitioned and sequential workloads;
- ``methods.py``: Kareus and the four baselines as microbatch options;
- ``metrics.py``: the paper's frontier metrics;
- ``plan_format.py``: the plan file (schema, validation, targets);
- ``live_tuning.py``: the same planning on the live graph at compile time (option ``tune``).
"""
