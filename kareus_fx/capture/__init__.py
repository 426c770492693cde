"""Capture (docs/design.md steps 1-3, 7): from a Dynamo graph to analysed, partitioned aten graphs.

- ``backend.py``: the ``kareus`` torch.compile backend (the ``torch_dynamo_backends`` entry point);
- ``compile_step.py``: the one compile step every path shares (nanobatch split, aot_autograd,
  the passes on each aten graph, dump, deployment);
- ``dump.py``: the JSON graph dump, written here and read by the planner and the inspector;
- ``tracing.py``: full-size traces of the reference models on the meta device under the fake
  process group (what ``kareus plan`` plans).
"""
