"""Deployment (docs/design.md step 7): a plan written into the aten graphs and run.

- ``deployment.py``: plan checks, per-microbatch stream-scheduled variants, SM-limited
  communicators prepared at startup, the clock schedule;
- ``hook_ops.py``: the clock, launch and SM-limit hook ops the scheduled graphs call.
"""
