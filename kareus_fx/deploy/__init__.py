"""Deployment (docs/design.md step 7): a plan written into the aten graphs and run.

- ``deployment.py``: a plan deployed on one Dynamo graph (the steps, in its docstring);
- ``plan_checks.py``: the checks that refuse a plan made for another job;
- ``microbatch_cursor.py``: which microbatch a compiled graph's call runs;
- ``variants.py``: the stream-scheduled variants per graph and the dispatcher that picks one per call;
- ``compile_time_tuning.py``: plan a reference model at compile time (option ``tune_request``);
- ``run_log.py``, ``run_record.py``, ``plan_drift.py``: one record per iteration run, and the drift warning;
- ``hook_ops.py``: the clock, launch and SM-limit hook ops the scheduled graphs call.
"""
