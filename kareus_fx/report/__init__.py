"""What people read (docs/design.md step 6 and the inspector): tables, plots, HTML and diffs.

- ``plan_report.py``: the metrics table, frontier plot, ``frontier.csv`` and ``report.html``;
- ``plan_summary.py``, ``timeline_plot.py``: ``kareus inspect`` on a plan, with per-type timelines;
- ``dump_summary.py``, ``inspector.py``: ``kareus inspect`` on graph dumps and plans;
- ``plan_diff.py``: ``kareus inspect --diff`` of two plans or two dumps.
"""
