"""What runs next to the GPU: streams, collectives, clocks, energy (installed as ``kareus_fx.runtime``).

- ``clock_backends``: where a clock goes (Zeus on a real GPU, dry run, simulated GPU).
- ``frequency``: :class:`ClockController`, asynchronous clock switching that always restores.
- ``pipeline_hook``: which (stage, instruction, microbatch) runs next, and the plan's clock for it.
- ``streams``: named compute/comm streams and keyed events (CUDA, or a null table on CPU).
- ``collectives``: one process group per planned communication SM count.
- ``energy``: per-iteration time and energy through Zeus, compared with the plan.

Modules are imported individually (nothing here imports torch, so the clock controller loads fast).
"""
