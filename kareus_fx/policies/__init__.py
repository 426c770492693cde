"""Run-time policies: which frontier point the next iteration runs."""
