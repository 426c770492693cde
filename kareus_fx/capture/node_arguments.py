"""A node's call arguments as JSON, so a dump holds enough to run the op again (the device
profiler's replay).

Encoding of one argument value:

- another node: ``{"node": NAME}`` (the replay puts a tensor of that node's recorded shape there);
- ``bool``, ``int``, ``float``, ``str``, ``None``: themselves (non-finite floats as
  ``{"float": "inf" | "-inf" | "nan"}``, which JSON cannot hold);
- ``torch.dtype``: ``{"dtype": NAME}``; ``torch.device``: ``{"device": TYPE}``;
  ``torch.layout`` and ``torch.memory_format``: ``{"layout" | "memory_format": NAME}``;
- lists and tuples: lists of encoded values.

A node with any other argument (a symbolic size, a slice object) has no encoding: its record's
``args`` is null and a replay falls back to what the op's schema allows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx

from kareus_fx.errors import UnsupportedGraphError

__all__ = [
    "NodeArgumentError",
    "UnencodableArgument",
    "decode_arguments",
    "encode_arguments",
    "int_arg",
    "node_arg",
    "tensor_value",
]

_ENUMS: dict[str, type] = {"layout": torch.layout, "memory_format": torch.memory_format}


class UnencodableArgument(ValueError):
    """An argument the JSON encoding has no form for."""


def _encode(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": str(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": value.type}
    for key, kind in _ENUMS.items():
        if isinstance(value, kind):
            return {key: str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    raise UnencodableArgument(f"{type(value).__name__} argument {value!r}")


def encode_arguments(node: torch.fx.Node) -> dict[str, Any] | None:
    """``{"args": [...], "kwargs": {...}}`` of a ``call_function`` node; None when any argument
    has no encoding (module docstring) or the node calls nothing."""
    if node.op != "call_function":
        return None
    try:
        return {"args": [_encode(a) for a in node.args], "kwargs": {k: _encode(v) for k, v in node.kwargs.items()}}
    except UnencodableArgument:
        return None


def _decode(value: Any, tensor_for: Callable[[str], Any], device: torch.device) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensor_for, device) for v in value]
    if not isinstance(value, Mapping):
        return value
    if set(value) == {"node"}:
        return tensor_for(value["node"])
    if set(value) == {"float"}:
        return float(value["float"])
    if set(value) == {"dtype"}:
        return _attribute(torch, value["dtype"], torch.dtype)
    if set(value) == {"device"}:
        return device  # the replay runs where the profiler does, not where the graph was traced
    for key, kind in _ENUMS.items():
        if set(value) == {key}:
            return _attribute(torch, value[key], kind)
    raise ValueError(f"unknown encoded argument {value!r}")


def _attribute(module: Any, name: str, kind: type) -> Any:
    found = getattr(module, str(name), None)
    if not isinstance(found, kind):
        raise ValueError(f"torch has no {kind.__name__} {name!r}")
    return found


def decode_arguments(
    encoded: Mapping[str, Any], tensor_for: Callable[[str], Any], device: torch.device
) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments from :func:`encode_arguments`'s form; ``tensor_for(name)``
    gives the value that stands in for node ``name``. ValueError on a malformed encoding."""
    args = encoded.get("args")
    kwargs = encoded.get("kwargs")
    if not isinstance(args, list) or not isinstance(kwargs, Mapping):
        raise ValueError("encoded arguments need an 'args' list and a 'kwargs' object")
    return (
        [_decode(a, tensor_for, device) for a in args],
        {str(k): _decode(v, tensor_for, device) for k, v in kwargs.items()},
    )


# --------------------------------------------------------------------------------------------
# Narrowing: fx types every argument as the union of all it can be; a pass that reads an
# aten op's arguments knows the op's schema, and these check that the graph agrees.


class NodeArgumentError(UnsupportedGraphError):
    """A node's argument or value is not of the kind the op's schema gives it (a graph that a
    pass does not understand)."""


def node_arg(node: torch.fx.Node, pos: int) -> torch.fx.Node:
    """Positional argument ``pos`` of ``node`` (negative counts from the end) as a graph node,
    e.g. the tensor input of an aten op. NodeArgumentError when it is missing or a constant."""
    value = node.args[pos] if -len(node.args) <= pos < len(node.args) else None
    if not isinstance(value, torch.fx.Node):
        raise NodeArgumentError(
            f"{node.name} ({node.target}): argument {pos} is {value!r}, where the op takes a tensor"
        )
    return value


def int_arg(node: torch.fx.Node, pos: int) -> int:
    """Positional argument ``pos`` of ``node`` (negative counts from the end) as a Python int,
    e.g. a collective's group size. NodeArgumentError when it is anything else."""
    value = node.args[pos] if -len(node.args) <= pos < len(node.args) else None
    if not isinstance(value, int):
        raise NodeArgumentError(f"{node.name} ({node.target}): argument {pos} is {value!r}, where the op takes an int")
    return value


def tensor_value(node: torch.fx.Node) -> torch.Tensor:
    """The (fake) tensor ``node`` produces, from ``node.meta["val"]`` (aten graphs from
    AOTAutograd carry it). NodeArgumentError when the node has none."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise NodeArgumentError(
            f"{node.name} ({node.target}): no tensor metadata (meta['val'] is {type(value).__name__})"
        )
    return value
