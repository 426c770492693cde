"""Record, in a rank of a distributed test, whether the backend split each graph it compiled.

splits = record_splits()   # before torch.compile(..., backend="kareus")
...
assert splits == [True]
"""

from __future__ import annotations

from typing import Any


def record_splits() -> list[bool]:
    """Make the compile step record each nanobatch split's outcome; returns the list it fills."""
    from kareus_fx.capture import compile_step
    from kareus_fx.passes.nanobatch import NanobatchResult, split_nanobatches

    splits: list[bool] = []

    def recording_split(gm: Any, example_inputs: list[Any], **kwargs: Any) -> NanobatchResult:
        result = split_nanobatches(gm, example_inputs, **kwargs)
        splits.append(result.split)
        return result

    compile_step.split_nanobatches = recording_split
    return splits
