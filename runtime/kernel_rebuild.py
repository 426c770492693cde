"""Kernels rebuilt from a partition's op records: what the on-device profiler runs for each op.

A :class:`~kareus_fx.workload.PartitionType` keeps per-op costs, not the FX subgraph, so the
kernels are rebuilt per op (:func:`build_kernel`):

- **replay** (when the dump's node records are given, :func:`node_tables_from_dump`): the
  recorded aten overload is called on random tensors of the recorded input shapes and dtypes.
  Only ops whose schema needs nothing but tensors are replayable: a required number argument
  (``pow``'s exponent, attention's scale) is filled with 2.0 (the dump does not keep it; the
  op's work does not depend on it), a ``dtype`` keyword gets the recorded output dtype. An op
  that needs other arguments (reduction dims, views), fails, or whose output's element count or
  dtype differs from the record falls back to the proxy with a warning. Inputs are contiguous
  (a strided input of the real graph is not reproduced).
- **proxy** (a "kernel proxy" rebuilt from the cost record): ``mm``/``bmm``/``addmm`` become one
  bf16 ``mm`` with ``m = n`` chosen so that its FLOPs equal the recorded FLOPs (within
  ``0.5 / k``) and its bytes the recorded bytes where a square output allows it; kareus
  attention forward/backward become the real op on one batch with sequence length and heads x
  head_dim solved from FLOPs and bytes; every other op becomes an fp32 copy moving the
  recorded bytes (memory-bound ops cost their bytes).

Ops with the same :func:`kernel_signature` share one kernel and its input buffers
(:func:`build_kernels`), so a microbatch's replay holds about one layer's inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kareus_fx.capture.node_arguments import decode_arguments
from kareus_fx.runtime.recorded_ops import NodeTable, random_tensor, resolve_overload
from kareus_fx.workload import GraphName, OpCost

logger = logging.getLogger(__name__)


_MATMULS = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default")
_ATTENTION = "kareus.attention.default"
_ATTENTION_BACKWARD = "kareus.attention_backward.default"
_FILL_NUMBER = 2.0
_PROXY_HEAD_DIM = 128
_BF16_BYTES = 2
_FP32_BYTES = 4


@dataclass(frozen=True)
class Kernel:
    """One runnable kernel standing for one recorded op."""

    name: str
    target: str
    source: Literal["replay", "proxy", "fused"]
    run: Callable[[], Any] = field(repr=False)


def node_tables_from_dump(dump: Mapping[str, Any]) -> dict[GraphName, dict[str, Mapping[str, Any]]]:
    """Each dumped graph's node records by name: what :func:`build_kernel` replays from."""
    return {graph["name"]: {node["name"]: node for node in graph["nodes"]} for graph in dump["graphs"]}


def replay_key(ops: Iterable[OpCost]) -> str:
    """Key of the node table that replays ``ops`` (``DeviceProfiler(tables_by_ops=...)``): a hash
    of their node names and targets, so graphs whose node names collide (pipeline stages, the
    nanobatched and the un-split trace) each keep their own table."""
    text = "\n".join(f"{op.name} {op.target}" for op in ops)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def matmul_proxy_shape(flops: float, bytes_: float) -> tuple[int, int, int]:
    """``(m, n, k)`` of a bf16 mm with ``m = n`` doing ``flops`` and, where possible, moving ``bytes_``.

    With ``m = n``: flops = 2 m^2 k and bytes / 2 = 2 m k + m^2, i.e. ``flops / m + m^2 = bytes / 2``.
    Its smallest value is at ``m = (flops / 2)^(1/3)`` (a cube); if the recorded bytes are below
    that the cube is used (fewest bytes for these FLOPs), else the larger root (a wide output, a
    short k, as in LLM projections). ``k`` is rounded last, so the FLOPs error is at most 0.5 / k.
    """
    if flops <= 0:
        raise ValueError(f"a matmul proxy needs positive FLOPs, got {flops}")
    elements = bytes_ / _BF16_BYTES
    cube = (flops / 2.0) ** (1.0 / 3.0)
    m = cube
    if flops / cube + cube**2 < elements:
        low, high = cube, math.sqrt(elements)
        for _ in range(100):  # bisection: flops/m + m^2 is increasing above the cube
            mid = (low + high) / 2.0
            low, high = (mid, high) if flops / mid + mid**2 < elements else (low, mid)
        m = low
    side = max(1, round(m))
    k = max(1, round(flops / (2.0 * side * side)))
    return side, side, k


def attention_proxy_shape(flops: float, bytes_: float, backward: bool) -> tuple[int, int, int]:
    """``(heads, seq, head_dim)`` of causal self-attention with ``flops`` and ``bytes_`` (bf16).

    Forward: 4 tensors of ``heads x seq x head_dim`` (q, k, v, out) and
    ``2 heads seq head_dim (seq + 1)`` FLOPs; the backward reads 4 and writes 3 and costs 2.5x.
    ``head_dim`` is 128 when ``heads x head_dim`` allows, else ``heads`` is 1.
    """
    tensors, scale = (7, 2.5) if backward else (4, 1.0)
    hsd = bytes_ / (tensors * _BF16_BYTES)
    if hsd <= 0 or flops <= 0:
        raise ValueError(f"an attention proxy needs positive FLOPs and bytes, got {flops}, {bytes_}")
    seq = max(1, round(flops / scale / (2.0 * hsd) - 1.0))
    width = max(1, round(hsd / seq))
    if width >= _PROXY_HEAD_DIM:
        return max(1, round(width / _PROXY_HEAD_DIM)), seq, _PROXY_HEAD_DIM
    return 1, seq, width


def _replay_kernel(op: OpCost, record: Mapping[str, Any], table: NodeTable, device: torch.device) -> Kernel:
    """The recorded op on random inputs of the recorded shapes; ValueError if it cannot be replayed."""
    if record.get("op") != op.target:
        raise ValueError(f"node {op.name} is {record.get('op')} in the dump, not {op.target}")
    inputs = {name: table[name] for name in record["inputs"]}
    if any(inp.get("shape") is None for inp in inputs.values()):
        raise ValueError("an input has no recorded tensor shape")
    tensors = {name: random_tensor(inp["shape"], getattr(torch, inp["dtype"]), device) for name, inp in inputs.items()}
    overload = resolve_overload(op.target)
    if record.get("arguments") is not None:
        args, kwargs = decode_arguments(record["arguments"], tensors.__getitem__, device)
    else:
        args, kwargs = _schema_arguments(overload, record, list(tensors.values()))
    out = overload(*args, **kwargs)
    first = next(iter(out)) if isinstance(out, (tuple, list)) else out
    expected = math.prod(record["shape"] or [])
    if first.numel() != expected or str(first.dtype).removeprefix("torch.") != record["dtype"]:
        raise ValueError(
            f"replayed output is {list(first.shape)} {first.dtype}, recorded {record['shape']} {record['dtype']}"
        )
    return Kernel(op.name, op.target, "replay", lambda: overload(*args, **kwargs))


def _schema_arguments(
    overload: Any, record: Mapping[str, Any], tensors: list[torch.Tensor]
) -> tuple[list[Any], dict[str, Any]]:
    """Arguments of a record without recorded ``arguments`` (older dumps): the tensors in schema
    order, the recorded dtype, defaults, and a fill number for required scalars."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    remaining = list(tensors)
    for argument in overload._schema.arguments:
        kind = str(argument.type)
        if kind == "Tensor":
            if not remaining:
                raise ValueError(f"argument {argument.name} needs a tensor the record lacks")
            args.append(remaining.pop(0))
        elif kind == "List[Tensor]":
            args.append(remaining)
            remaining = []
        elif argument.name == "dtype" and argument.kwarg_only:
            kwargs["dtype"] = getattr(torch, record["dtype"])
        elif argument.has_default_value():
            continue
        elif kind in ("float", "Scalar", "number"):
            args.append(_FILL_NUMBER)
        else:
            raise ValueError(f"argument {argument.name}: {kind} is not in the dump")
    if remaining:
        raise ValueError(f"{len(remaining)} recorded inputs have no tensor argument")
    return args, kwargs


def _proxy_kernel(op: OpCost, device: torch.device) -> Kernel:
    """The cost record's kernel proxy (module docstring)."""
    if op.target in _MATMULS and op.flops > 0:
        m, n, k = matmul_proxy_shape(op.flops, op.bytes)
        a = random_tensor((m, k), torch.bfloat16, device)
        b = random_tensor((k, n), torch.bfloat16, device)
        return Kernel(op.name, op.target, "proxy", lambda: torch.mm(a, b))
    if op.target in (_ATTENTION, _ATTENTION_BACKWARD) and op.flops > 0 and op.bytes > 0:
        from kareus_fx.models.attention_op import attention, attention_backward

        backward = op.target == _ATTENTION_BACKWARD
        heads, seq, head_dim = attention_proxy_shape(op.flops, op.bytes, backward)
        query, key, value, grad = (random_tensor((1, heads, seq, head_dim), torch.bfloat16, device) for _ in range(4))
        scale = head_dim**-0.5
        if backward:
            return Kernel(op.name, op.target, "proxy", lambda: attention_backward(grad, query, key, value, scale))
        return Kernel(op.name, op.target, "proxy", lambda: attention(query, key, value, scale))
    elements = max(1, round(op.bytes / (2 * _FP32_BYTES)))
    src = random_tensor((elements,), torch.float32, device)
    dst = torch.empty_like(src)
    return Kernel(op.name, op.target, "proxy", lambda: dst.copy_(src))


def build_kernel(op: OpCost, device: torch.device | str, table: NodeTable | None = None) -> Kernel:
    """Replay ``op`` from its node record in ``table`` when possible, else its kernel proxy."""
    device = torch.device(device)
    record = _record(op, table)
    if record is not None and table is not None:
        try:
            return _replay_kernel(op, record, table, device)
        except (ValueError, RuntimeError, TypeError, IndexError, AttributeError) as err:
            logger.warning("op %s (%s) not replayable (%s): using its kernel proxy", op.name, op.target, err)
    return _proxy_kernel(op, device)


def _record(op: OpCost, table: NodeTable | None) -> Mapping[str, Any] | None:
    return None if table is None else table.get(op.name)


def kernel_signature(op: OpCost, table: NodeTable | None) -> tuple[Any, ...]:
    """What a kernel of ``op`` depends on: its target, recorded input and output shapes and
    dtypes and recorded arguments (replay), or its target and cost (proxy). Ops with equal
    signatures run equal kernels."""
    record = _record(op, table)
    if record is None or table is None or any(name not in table for name in record.get("inputs", ())):
        return (op.target, op.flops, op.bytes)
    inputs = tuple((tuple(table[n].get("shape") or ()), table[n].get("dtype")) for n in record["inputs"])
    position = {name: i for i, name in enumerate(record["inputs"])}
    arguments = json.dumps(_by_position(record.get("arguments"), position), sort_keys=True)
    return (op.target, inputs, arguments, tuple(record.get("shape") or ()), record.get("dtype"), op.flops, op.bytes)


def _by_position(encoded: Any, position: Mapping[str, int]) -> Any:
    """Encoded arguments with each node reference replaced by its input position, so the same op
    of two layers has one signature."""
    if isinstance(encoded, list):
        return [_by_position(v, position) for v in encoded]
    if isinstance(encoded, Mapping):
        if set(encoded) == {"node"}:
            return {"input": position.get(encoded["node"])}
        return {k: _by_position(v, position) for k, v in encoded.items()}
    return encoded


def build_kernels(ops: Sequence[OpCost], device: torch.device | str, table: NodeTable | None = None) -> list[Kernel]:
    """:func:`build_kernel` of each op, sharing one kernel (and its input buffers) between ops with
    the same :func:`kernel_signature`: a full microbatch repeats each layer's ops, so its replay
    holds about one layer's inputs, not every op's. Assumption: a shared kernel's inputs may stay in
    L2 between two uses where the real graph's distinct tensors would not; repeats of one op are a
    layer apart, with far more than L2's capacity moved in between."""
    shared: dict[tuple[Any, ...], Kernel] = {}
    kernels = []
    for op in ops:
        signature = kernel_signature(op, table)
        kernel = shared.get(signature)
        if kernel is None:
            kernel = shared[signature] = build_kernel(op, device, table)
        kernels.append(kernel if kernel.name == op.name else dataclasses.replace(kernel, name=op.name))
    return kernels
