"""Training frameworks: what the training framework adds to the step the traced model runs.

- ``base.py``: the :class:`~kareus_fx.frameworks.base.TrainingFramework` interface the planner asks;
- ``registry.py``: frameworks by name (``kareus plan --framework``);
- ``traced_order.py``: the default, the traced order as it runs;
- ``megatron_lm.py``: Megatron-LM with Transformer Engine (the paper's testbed), with its facts in
  ``megatron_settings.py``, ``megatron_async_dgrad.py``, ``megatron_dropout.py`` and ``megatron_main_grad.py``;
- ``torchtitan_fsdp.py``: torchtitan's FSDP2 + TP step;
- ``pipeline_sends.py`` and ``step_tail.py``: the pipeline's p2p sends and the optimizer step's tail.
"""
