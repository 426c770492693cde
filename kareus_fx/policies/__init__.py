"""Run-time policies: which frontier point the next iteration runs (issue 31)."""
