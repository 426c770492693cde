"""Planning (docs/design.md steps 4-6): from traced graphs to a versioned plan file.

- ``planner.py``: ``kareus plan`` end to end, running the steps of the modules below in order;
- ``request.py``: the request and its validation;
- ``stage_tracing.py``: tracing the pipeline's distinct stages;
- ``profilers.py``: the profiler behind the profile database, and the distinct partition types;
- ``profiler_capabilities.py``: what each profiler can price beyond the traced graphs;
- ``composition.py`` and ``solver_sizing.py``: the methods' iteration frontiers and the solve's resolution;
- ``plan_data.py``: the plan file's data;
- ``presets.py``: the paper's testbed workloads;
- ``graph_workload.py``: dumped graphs as partitioned and sequential workloads;
- ``methods.py``: Kareus and the four baselines as microbatch options;
- ``metrics.py``: the paper's frontier metrics;
- ``plan_format.py``: the plan file (schema, validation, targets);
- ``live_tuning.py``: the same planning on the live graph at compile time (option ``tune``).
"""
