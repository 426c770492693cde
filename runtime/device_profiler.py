"""The on-device profiler: runs a partition's kernels on the GPU and measures time and energy.

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
- **fused** (``fused=True`` with node records; :mod:`kareus_fx.runtime.fused_replay`): each slot
  is one Inductor-compiled graph of its recorded ops with their dataflow, as the deployment runs
  them, instead of one aten kernel per op on separate inputs; a slot that cannot be rebuilt or
  compiled is replayed op by op (warning).

The collective is replaced by an SM-limited reduce (``dst += src``, bf16) over the bytes one
rank moves in a ring algorithm (all-reduce ``2 (g-1)/g`` of the buffer, the others
``(g-1)/g``) on a side stream: a Triton kernel with ``comm_sms`` programs when Triton imports,
else ``torch.add`` on the side stream (the SM limit is then not enforced; a warning says so).
It takes SMs and HBM bandwidth like the collective, not its link time. It is issued before the
first kernel of slot ``launch_slot`` (the stream-schedule pass' convention), after every slot
when sequential; the main stream waits for it at the end.

Timing: CUDA events around each execution after warm-up. Energy: Zeus's ``ZeusMonitor`` over a
window of at least ``min_window_s`` (NVML's counter updates every ~100 ms) repeating the
partition, divided by the repeats. On a GPU each configuration's execution is captured once in a
CUDA graph and the graph is replayed (``cuda_graphs=True``, the default; profile-database kind
``cuda-graph``): issued op by op from Python the replay is launch-bound for partitions under a
few milliseconds (an H200 ran a 40-op backward partition in 0.63-0.85 ms from a graph and
3.7-4.0 ms issued op by op, ``bench/results/gpu_h200/``), so the measured time is the GPU's time
for the partition's kernels with no host gaps between them. A deployment whose host cannot keep
ahead of its GPU runs slower than that. A replay with an op that synchronises with the host
(found by a warm-up under CUDA's sync debug mode, before any capture) is measured op by op,
with a warning once per profiler. Static energy = the GPU's static power
(``cost_models.hardware``) x time; dynamic = total - static. Before each measurement the GPU
cools until its temperature is within ``cooldown_tolerance_c`` of its idle temperature (given, or read before the first
measurement) or ``cooldown_timeout_s`` passes. The clock goes through a
:class:`~kareus_fx.runtime.clock_controller.ClockController`; ``close()`` restores it.

A configuration that runs out of GPU memory, or whose collective fails or times out
(``torch.distributed.DistBackendError``), raises :class:`~kareus_fx.workload.MeasurementFailedError`
with the reason: the tuner records it as failed and goes on (its replay is dropped and the cache
emptied, so the next configuration starts clean).

Without CUDA, :meth:`DeviceProfiler.measure` raises :class:`DeviceProfilerError`; the replay
itself (:func:`replay_partition` with ``device="cpu"``) runs on CPU with wall-clock timing, for
tests.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from kareus_fx.capture.node_arguments import decode_arguments
from kareus_fx.cost_models.hardware import DEFAULT_GPU, gpu_spec
from kareus_fx.errors import KareusError
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.energy import open_zeus_monitor, zeus_errors
from kareus_fx.runtime.fused_replay import fused_slot_kernel
from kareus_fx.runtime.recorded_ops import NodeTable, random_tensor, resolve_overload
from kareus_fx.workload import (
    CollectiveSpec,
    GraphName,
    Measurement,
    MeasurementFailedError,
    OpCost,
    PartitionConfig,
    PartitionType,
)

if TYPE_CHECKING:  # zeus is imported when a GPU is measured, not at import time
    from zeus.monitor.energy import ZeusMonitor

logger = logging.getLogger(__name__)


_MATMULS = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default")
_ATTENTION = "kareus.attention.default"
_ATTENTION_BACKWARD = "kareus.attention_backward.default"
_FILL_NUMBER = 2.0
_PROXY_HEAD_DIM = 128
_BF16_BYTES = 2
_FP32_BYTES = 4


class DeviceProfilerError(KareusError, RuntimeError):
    """The on-device profiler cannot run here (no CUDA GPU, no energy counter)."""


class UncapturableReplayError(RuntimeError):
    """A replay synchronises with the host, so it cannot be captured in a CUDA graph."""


@dataclass(frozen=True)
class Kernel:
    """One runnable kernel standing for one recorded op."""

    name: str
    target: str
    source: Literal["replay", "proxy", "fused"]
    run: Callable[[], Any] = field(repr=False)


@dataclass(frozen=True)
class CollectiveKernel:
    """The SM-limited reduce standing for one collective; ``run(comm_sms)`` issues it."""

    spec: CollectiveSpec
    elements: int
    run: Callable[[int], Any] = field(repr=False)


def node_tables_from_dump(dump: Mapping[str, Any]) -> dict[GraphName, dict[str, Mapping[str, Any]]]:
    """Each dumped graph's node records by name: what :func:`build_kernel` replays from."""
    return {graph["name"]: {node["name"]: node for node in graph["nodes"]} for graph in dump["graphs"]}


def replay_key(ops: Iterable[OpCost]) -> str:
    """Key of the node table that replays ``ops`` (``DeviceProfiler(tables_by_ops=...)``): a hash
    of their node names and targets, so graphs whose node names collide (pipeline stages, the
    nanobatched and the un-split trace) each keep their own table."""
    text = "\n".join(f"{op.name} {op.target}" for op in ops)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def collective_traffic_bytes(spec: CollectiveSpec) -> float:
    """Bytes one rank sends in a ring algorithm: all-reduce ``2(g-1)/g`` x buffer, else ``(g-1)/g``."""
    share = (spec.group_size - 1) / spec.group_size
    return spec.bytes * share * (2.0 if spec.kind == "all_reduce" else 1.0)


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


@functools.lru_cache(maxsize=1)
def _triton_reduce() -> Callable[[torch.Tensor, torch.Tensor, int], None] | None:
    """A reduce ``dst += src`` over ``grid`` Triton programs (one per SM), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # A Triton kernel: its parameters are pointers and constexprs, typed by Triton, not Python (and
    # Triton is not installed where mypy runs: no triton in CPU CI).
    @triton.jit  # type: ignore[untyped-decorator]
    def _reduce(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        start = tl.program_id(0) * BLOCK
        step = tl.num_programs(0) * BLOCK
        for offset in range(start, n, step):
            offsets = offset + tl.arange(0, BLOCK)
            mask = offsets < n
            total = tl.load(dst_ptr + offsets, mask=mask) + tl.load(src_ptr + offsets, mask=mask)
            tl.store(dst_ptr + offsets, total, mask=mask)

    def launch(dst: torch.Tensor, src: torch.Tensor, grid: int) -> None:
        _reduce[(grid,)](dst, src, dst.numel(), BLOCK=2048)

    return launch


def build_collective_kernel(spec: CollectiveSpec, device: torch.device | str) -> CollectiveKernel:
    """The SM-limited reduce standing for ``spec`` (module docstring)."""
    device = torch.device(device)
    elements = max(1, round(collective_traffic_bytes(spec) / _BF16_BYTES))
    dst = torch.zeros(elements, dtype=torch.bfloat16, device=device)
    src = random_tensor((elements,), torch.bfloat16, device)
    triton_reduce = _triton_reduce() if device.type == "cuda" else None
    if triton_reduce is not None:
        return CollectiveKernel(spec, elements, lambda comm_sms: triton_reduce(dst, src, comm_sms))
    if device.type == "cuda":
        logger.warning("Triton does not import: the collective proxy is torch.add; its SM limit is not enforced")
    return CollectiveKernel(spec, elements, lambda comm_sms: dst.add_(src))


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


def _fused_or_per_op(ops: Sequence[OpCost], table: NodeTable, device: torch.device) -> list[Kernel]:
    """The slot as one fused kernel (compiled here, by its first run), or one kernel per op where
    the slot's graph cannot be rebuilt or compiled (a warning names why)."""
    if not ops:
        return []
    try:
        run, _, _ = fused_slot_kernel(ops, table, device)
        run()
    except Exception as err:  # noqa: BLE001 -- any rebuild or Inductor failure: measure op by op
        logger.warning(
            "slot of %d ops (from %s) not fused (%s): replaying it op by op",
            len(ops),
            ops[0].name if ops else "-",
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        return build_kernels(ops, device, table)
    return [Kernel(f"fused[{ops[0].name}..{ops[-1].name}]", "inductor", "fused", run)]


def timed_runs(run: Callable[[], None], device: torch.device, *, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run`` after ``warmup``: CUDA events on a GPU,
    ``perf_counter`` on CPU (where kernels run synchronously)."""
    for _ in range(warmup):
        run()
    if device.type != "cuda":
        times_s = []
        for _ in range(repeats):
            start_s = time.perf_counter()
            run()
            times_s.append(time.perf_counter() - start_s)
        return times_s
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1000.0 for start, end in events]


@dataclass
class PartitionReplay:
    """A partition's kernels, ready to issue: slots of kernels, then the collectives' proxies."""

    slots: list[list[Kernel]]
    collectives: list[CollectiveKernel]
    device: torch.device
    launch_log: list[str] | None = None
    """When a list, each issued kernel's label is appended (``slot{i}:{name}``, ``collective{j}``)."""
    _side_stream: torch.cuda.Stream | None = None
    _graph: torch.cuda.CUDAGraph | None = None
    _graph_config: tuple[int | None, int] | None = None

    @classmethod
    def build(
        cls,
        slots: Sequence[Sequence[OpCost]],
        collectives: Sequence[CollectiveSpec],
        device: torch.device | str,
        table: NodeTable | None = None,
        *,
        fused: bool = False,
    ) -> PartitionReplay:
        """``fused``: each slot one Inductor-compiled graph of its recorded ops
        (:mod:`kareus_fx.runtime.fused_replay`; needs ``table``), a slot that cannot be fused
        replayed op by op with a warning; else one kernel per op."""
        device = torch.device(device)
        if fused and table is not None:
            built = [_fused_or_per_op(slot, table, device) for slot in slots]
        else:
            kernels = iter(build_kernels([op for slot in slots for op in slot], device, table))
            built = [[next(kernels) for _ in slot] for slot in slots]
        return cls(
            slots=built,
            collectives=[build_collective_kernel(spec, device) for spec in collectives],
            device=device,
            _side_stream=torch.cuda.Stream(device) if device.type == "cuda" else None,
        )

    def issue(self, launch_slot: int | None, comm_sms: int) -> None:
        """Enqueue one execution: the collectives before slot ``launch_slot`` (None: after all)."""
        launch = len(self.slots) if launch_slot is None else launch_slot
        if not 0 <= launch <= len(self.slots):
            raise ValueError(f"launch_slot {launch_slot} outside the partition's {len(self.slots)} slots")
        done = None
        for index in range(len(self.slots) + 1):
            if index == launch:
                done = self._issue_collectives(comm_sms)
            for kernel in self.slots[index] if index < len(self.slots) else ():
                self._log(f"slot{index}:{kernel.name}")
                kernel.run()
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def _issue_collectives(self, comm_sms: int) -> torch.cuda.Event | None:
        if self._side_stream is None:
            for index, collective in enumerate(self.collectives):
                self._log(f"collective{index}")
                collective.run(comm_sms)
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self._side_stream.wait_event(ready)
        with torch.cuda.stream(self._side_stream):
            for index, collective in enumerate(self.collectives):
                self._log(f"collective{index}")
                collective.run(comm_sms)
        done = torch.cuda.Event()
        done.record(self._side_stream)
        return done

    def captured(self, launch_slot: int | None, comm_sms: int) -> Callable[[], None]:
        """One execution as a call that replays a CUDA graph of it (GPU only), captured on the first
        call for this configuration; a capture of another configuration is released first (each
        holds a private memory pool of one execution's tensors).

        Raises :class:`UncapturableReplayError` before any capture where an op synchronises with
        the host (a value read back, a data-dependent shape): the last warm-up runs under
        ``torch.cuda.set_sync_debug_mode("error")``. A capture that fails is not retried: it
        leaves the CUDA generator's capture state set, so random tensors fail afterwards."""
        if self.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs a CUDA replay, this one is on {self.device}")
        if self._graph is None or self._graph_config != (launch_slot, comm_sms):
            self.release_graph()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up off the capture stream (lazy inits, Triton's compile)
                for _ in range(2):
                    self.issue(launch_slot, comm_sms)
                previous_mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    self.issue(launch_slot, comm_sms)
                except RuntimeError as err:
                    raise UncapturableReplayError(str(err).splitlines()[0]) from err
                finally:
                    torch.cuda.set_sync_debug_mode(previous_mode)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.issue(launch_slot, comm_sms)
            self._graph, self._graph_config = graph, (launch_slot, comm_sms)
        return self._graph.replay

    def release_graph(self) -> None:
        """Free the captured CUDA graph and its memory pool (no-op without one)."""
        self._graph, self._graph_config = None, None

    def synchronize(self) -> None:
        """Wait for every issued kernel (kernels run synchronously on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _log(self, label: str) -> None:
        if self.launch_log is not None:
            self.launch_log.append(label)

    def time_s(self, launch_slot: int | None, comm_sms: int, *, warmup: int, repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` executions after ``warmup``: CUDA events on a GPU,
        ``perf_counter`` on CPU (where kernels run synchronously)."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        return timed_runs(lambda: self.issue(launch_slot, comm_sms), self.device, warmup=warmup, repeats=repeats)


def replay_partition(
    ptype: PartitionType,
    config: PartitionConfig,
    *,
    device: torch.device | str = "cpu",
    table: NodeTable | None = None,
    warmup: int = 1,
    repeats: int = 3,
    launch_log: list[str] | None = None,
) -> list[float]:
    """Seconds of ``repeats`` executions of ``ptype`` under ``config`` (no energy, no clock change).

    ``table``: the node records of ``ptype.graph`` (from :func:`node_tables_from_dump`) to
    replay the recorded ops; None uses kernel proxies. ``launch_log`` receives the launch order.
    """
    replay = PartitionReplay.build([slot.ops for slot in ptype.slots], [ptype.collective], device, table)
    replay.launch_log = launch_log
    return replay.time_s(config.launch_slot, config.comm_sms, warmup=warmup, repeats=repeats)


def wait_for_cooldown(
    read_temperature_c: Callable[[], float],
    idle_temperature_c: float,
    *,
    tolerance_c: float,
    timeout_s: float,
    poll_s: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> bool:
    """Wait until the temperature is within ``tolerance_c`` of idle; False if ``timeout_s`` passed first."""
    deadline_s = monotonic() + timeout_s
    while read_temperature_c() > idle_temperature_c + tolerance_c:
        if monotonic() >= deadline_s:
            logger.warning("GPU did not cool to %.0f C within %.0f s; measuring anyway", idle_temperature_c, timeout_s)
            return False
        sleep(poll_s)
    return True


class DeviceProfiler:
    """Measures partitions on this process's CUDA GPU (``--profiler cuda``).

    ``frequency``: the controller that sets each configuration's clock (a dry-run one records
    requests and changes nothing); None leaves the clock as it is (then the measurement is at
    the card's current clock, whatever ``clock_mhz`` says; a warning says so once).
    ``node_tables``: the dump's node records per graph (:func:`node_tables_from_dump`) to replay
    recorded ops; None uses kernel proxies. ``tables_by_ops``: node tables by the
    :func:`replay_key` of the ops they replay (a partition type's ops in slot order, or a
    sequence's ops), consulted before ``node_tables[graph]``: for ops of several dumps.
    ``cuda_graphs``: replay each configuration from a CUDA graph (the default; see the module
    docstring), else op by op from Python (database kind ``cuda``, launch-bound below a few
    milliseconds). ``fused_slots``: replay each slot as one Inductor-compiled graph of its
    recorded ops (:mod:`kareus_fx.runtime.fused_replay`; database kind suffix ``-fused``), and an
    un-split sequence as one graph; not yet measured on a GPU, so off by default.
    ``idle_temperature_c``: the cooldown target (default:
    the temperature read before the first measurement). ``zeus_monitor`` / ``read_temperature_c``: injected
    for tests; by default a ``ZeusMonitor`` on ``gpu_index`` and Zeus's NVML temperature.
    """

    def __init__(
        self,
        gpu_name: str = DEFAULT_GPU,
        *,
        gpu_index: int = 0,
        frequency: ClockController | None = None,
        node_tables: Mapping[str, NodeTable] | None = None,
        tables_by_ops: Mapping[str, NodeTable] | None = None,
        min_window_s: float = 5.0,
        cuda_graphs: bool = True,
        fused_slots: bool = False,
        warmup: int = 3,
        repeats: int = 10,
        cooldown_tolerance_c: float = 3.0,
        cooldown_timeout_s: float = 120.0,
        idle_temperature_c: float | None = None,
        zeus_monitor: ZeusMonitor | None = None,
        read_temperature_c: Callable[[], float] | None = None,
    ) -> None:
        spec = gpu_spec(gpu_name)
        self.gpu_name = spec.name
        self.static_power_w = spec.static_power_w
        self.gpu_index = gpu_index
        self.frequency = frequency
        self.node_tables = node_tables or {}
        self.tables_by_ops = tables_by_ops or {}
        self.min_window_s = float(min_window_s)
        self.cuda_graphs = cuda_graphs
        self.fused_slots = fused_slots
        self.kind = "cuda" + ("-graph" if cuda_graphs else "") + ("-fused" if fused_slots else "")
        """Profile-database key of this profiler: measurements of the two replays never mix."""
        self.warmup = warmup
        self.repeats = repeats
        self.cooldown_tolerance_c = cooldown_tolerance_c
        self.cooldown_timeout_s = cooldown_timeout_s
        self._zeus = zeus_monitor
        self._read_temperature_c = read_temperature_c
        self._idle_temperature_c = idle_temperature_c
        self._replays: dict[tuple[Any, ...], PartitionReplay] = {}
        self._warned_clock = False
        self._warned_capture = False
        self._captured: PartitionReplay | None = None
        """The one replay holding a CUDA graph (each graph holds a memory pool)."""
        self.last_window_s: float | None = None
        """The energy window of the latest measurement, in seconds."""

    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        """Time and energy of one partition of ``ptype`` run with ``config`` on this GPU."""
        key = (ptype.graph, ptype.type_id)

        def run() -> Measurement:
            if key not in self._replays:
                self._check_cuda()
                slots = [slot.ops for slot in ptype.slots]
                table = self._table([op for ops in slots for op in ops], ptype.graph)
                self._replays[key] = PartitionReplay.build(
                    slots, [ptype.collective], self._device(), table, fused=self.fused_slots
                )
            return self._measure(self._replays[key], config.clock_mhz, config.launch_slot, config.comm_sms)

        return self._as_configuration_failure(key, f"{ptype.type_id} at {config}", run)

    def measure_sequence(
        self,
        ops: Sequence[OpCost],
        collectives: Sequence[CollectiveSpec],
        clock_mhz: int,
        *,
        graph: GraphName | None = None,
        comm_sms: int = 16,
    ) -> Measurement:
        """``ops`` one after another, then each collective alone with ``comm_sms`` SMs (the
        simulator's default, 16), at ``clock_mhz``; the node table is ``tables_by_ops``' for these
        ops, else ``node_tables[graph]``."""
        key = ("sequence", replay_key(ops), tuple(collectives))

        def run() -> Measurement:
            if key not in self._replays:
                self._check_cuda()
                slots = [list(ops)] if self.fused_slots else [[op] for op in ops]
                self._replays[key] = PartitionReplay.build(
                    slots, list(collectives), self._device(), self._table(ops, graph), fused=self.fused_slots
                )
            return self._measure(self._replays[key], clock_mhz, None, comm_sms)

        return self._as_configuration_failure(key, f"{len(ops)} ops in sequence at {clock_mhz} MHz", run)

    def _as_configuration_failure(self, key: tuple[Any, ...], what: str, run: Callable[[], Measurement]) -> Measurement:
        """``run()``, with out-of-memory and collective failures raised as a failed configuration."""
        try:
            return run()
        except torch.cuda.OutOfMemoryError as err:
            reason = f"out of memory replaying {what}: {str(err).splitlines()[0]}"
        except torch.distributed.DistBackendError as err:
            reason = f"collective failed or timed out replaying {what}: {str(err).splitlines()[0]}"
        dropped = self._replays.pop(key, None)
        if dropped is not None and dropped is self._captured:
            self._release_capture()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise MeasurementFailedError(reason)

    def _table(self, ops: Sequence[OpCost], graph: GraphName | None) -> NodeTable | None:
        table = self.tables_by_ops.get(replay_key(ops)) if self.tables_by_ops else None
        if table is None and graph is not None:
            table = self.node_tables.get(graph)
        return table

    def close(self) -> None:
        """Release the captured CUDA graph and restore the clock (through the frequency controller)."""
        self._release_capture()
        if self.frequency is not None:
            self.frequency.restore()

    def __enter__(self) -> DeviceProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_cuda(self) -> None:
        if not torch.cuda.is_available():
            raise DeviceProfilerError(
                "--profiler cuda needs a CUDA GPU (torch.cuda.is_available() is False): run on a "
                "GPU machine, or use the simulated profiler (--profiler simulated, the default)"
            )

    def _device(self) -> torch.device:
        return torch.device("cuda", self.gpu_index)

    def _measure(self, replay: PartitionReplay, clock_mhz: int, launch_slot: int | None, comm_sms: int) -> Measurement:
        self._check_cuda()
        zeus, read_temperature_c = self._energy_sources()
        if self._idle_temperature_c is None:
            self._idle_temperature_c = float(read_temperature_c())
        wait_for_cooldown(
            read_temperature_c,
            self._idle_temperature_c,
            tolerance_c=self.cooldown_tolerance_c,
            timeout_s=self.cooldown_timeout_s,
        )
        self._set_clock(clock_mhz)
        run = self._runner(replay, launch_slot, comm_sms)
        time_s = statistics.median(timed_runs(run, replay.device, warmup=self.warmup, repeats=self.repeats))
        window = f"kareus_profile_{id(replay)}"
        with zeus_errors("read the energy counter at the measurement window's start"):
            zeus.begin_window(window)
        runs = self._fill_window(run, replay, time_s)
        with zeus_errors("read the energy counter at the measurement window's end"):
            result = zeus.end_window(window)  # synchronises CUDA before reading the counter
        self.last_window_s = float(result.time)
        energy_j = float(sum(result.gpu_energy.values())) / runs
        static_j = self.static_power_w * time_s
        return Measurement(
            time_s=time_s, energy_j=energy_j, dynamic_energy_j=energy_j - static_j, static_energy_j=static_j
        )

    def _runner(self, replay: PartitionReplay, launch_slot: int | None, comm_sms: int) -> Callable[[], None]:
        """One execution of ``replay`` as a call: its CUDA graph where ``cuda_graphs`` and the
        replay is on a GPU (the previous replay's graph released first), else the eager issue;
        a replay that synchronises with the host is measured op by op, with a warning once."""

        def issue() -> None:
            replay.issue(launch_slot, comm_sms)

        if not self.cuda_graphs or replay.device.type != "cuda":
            return issue
        if self._captured is not replay:
            self._release_capture()
        self._captured = replay
        try:
            return replay.captured(launch_slot, comm_sms)
        except UncapturableReplayError as err:
            if not self._warned_capture:
                warnings.warn(
                    f"a partition's replay could not be captured in a CUDA graph ({str(err).splitlines()[0]}): "
                    "measuring it op by op from Python, so a partition under a few milliseconds is timed "
                    "at the CPU's launch rate",
                    stacklevel=3,
                )
                self._warned_capture = True
            return issue

    def _release_capture(self) -> None:
        if self._captured is not None:
            self._captured.release_graph()
            self._captured = None

    def _fill_window(self, run: Callable[[], None], replay: PartitionReplay, time_s: float) -> int:
        """Repeat ``run`` until at least ``min_window_s`` has passed; return the repeats."""
        start_s = time.perf_counter()
        runs, elapsed_s = 0, 0.0
        while elapsed_s < self.min_window_s:
            batch = max(1, math.ceil((self.min_window_s - elapsed_s) / time_s))
            for _ in range(batch):
                run()
            replay.synchronize()
            runs += batch
            elapsed_s = time.perf_counter() - start_s
        return runs

    def _set_clock(self, clock_mhz: int) -> None:
        if self.frequency is None:
            if not self._warned_clock:
                logger.warning("no frequency controller: measuring at the GPU's current clock, not the configured one")
                self._warned_clock = True
            return
        self.frequency.request(clock_mhz, instruction="device_profiler")
        self.frequency.flush(timeout_s=30.0)

    def _energy_sources(self) -> tuple[ZeusMonitor, Callable[[], float]]:
        if self._zeus is None:
            self._zeus = open_zeus_monitor([self.gpu_index])
        if self._read_temperature_c is None:
            from zeus.device.gpu import get_gpus

            with zeus_errors("open the GPU's temperature sensor"):
                gpus, index = get_gpus(), self.gpu_index

            def read_temperature_c() -> float:
                with zeus_errors("read the GPU's temperature"):
                    return float(gpus.get_gpu_temperature(index))

            self._read_temperature_c = read_temperature_c
        if not getattr(self._zeus, "gpu_indices", [self.gpu_index]):
            raise DeviceProfilerError("ZeusMonitor sees no GPU: the on-device profiler needs NVML's energy counter")
        return self._zeus, self._read_temperature_c
