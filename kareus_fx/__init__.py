"""kareus-fx: an energy-aware ``torch.compile`` backend implementing the Kareus method.

``torch.compile(model, backend="kareus")`` works without importing this package first: the
backend is registered through the ``torch_dynamo_backends`` entry point.
"""

__version__ = "0.1.0"
