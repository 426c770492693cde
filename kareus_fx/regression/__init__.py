"""The perf-regression runner (``kareus bench``) for CI.

- ``runner.py``: suites, cases, metrics, comparison against a committed baseline;
- ``reference.py``: a reference workload timed around each case, so wall metrics are in units
  of the machine's speed.
"""
