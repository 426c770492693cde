"""Typed errors raised on bad user input.

Every error names the problem and the fix; none of them is raised for internal bugs.
"""


class KareusError(Exception):
    """Base class of every error kareus-fx raises for bad input or environment."""


class OptionsError(KareusError, ValueError):
    """The ``options`` given to ``torch.compile(..., backend="kareus")`` are invalid."""


class UnknownGPUError(KareusError, ValueError):
    """A GPU name that has no spec in ``kareus_fx.cost_models.hardware``."""


class ParallelConfigError(KareusError, ValueError):
    """A parallel layout that cannot be built (world size, heads, pipeline, microbatches)."""


class UnsupportedGraphError(KareusError):
    """A captured graph that a pass cannot handle."""
