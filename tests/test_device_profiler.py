"""The on-device profiler: kernels rebuilt from partition types, launch order, measurement logic.

CPU tests run the replay with wall-clock timing and check the measurement bookkeeping with a
fake energy monitor; the GPU tests (skipped without CUDA) measure a real partition.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kareus_fx.capture.dump import load_dump, partition_types_from_dump
from kareus_fx.capture.tracing import TraceSpec, trace_full_size
from kareus_fx.errors import KareusError
from kareus_fx.runtime.clock_controller import ClockController
from kareus_fx.runtime.collective_stand_in import build_collective_kernel, collective_traffic_bytes
from kareus_fx.runtime.device_profiler import DeviceProfiler, DeviceProfilerError, wait_for_cooldown
from kareus_fx.runtime.fused_replay import FusedReplayError, fused_slot_kernel, slot_graph
from kareus_fx.runtime.kernel_rebuild import Kernel, build_kernel, build_kernels, node_tables_from_dump
from kareus_fx.runtime.partition_replay import PartitionReplay, replay_partition
from kareus_fx.workload import CollectiveSpec, OpCost, PartitionConfig, PartitionType, SlotSpec

MATMULS = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default")


@pytest.fixture(scope="module")
def tiny_dump(tmp_path_factory):
    out = tmp_path_factory.mktemp("dump")
    spec = TraceSpec(model="tiny-llama", tp=2, mbs=2, seq=64, layers=2)
    (path,) = trace_full_size(spec, options={"dump_dir": str(out)}).dump_paths
    dump = load_dump(path)
    return partition_types_from_dump(dump), node_tables_from_dump(dump)


def kernel_flops(kernel) -> int:
    with FlopCounterMode(display=False) as counter:
        kernel.run()
    return counter.get_total_flops()


def small_ptype(n_slots: int = 3) -> PartitionType:
    slots = tuple(
        SlotSpec(
            ops=(
                OpCost(f"mm_{i}", "aten.mm.default", 2.0 * 32**3, 2.0 * 3 * 32**2, "compute"),
                OpCost(f"mul_{i}", "aten.mul.Tensor", 1024.0, 12288.0, "memory"),
            )
        )
        for i in range(n_slots)
    )
    return PartitionType(
        type_id="hand",
        graph="forward",
        slots=slots,
        collective=CollectiveSpec("all_reduce", 8192.0, 4),
        count=1,
        launch_slots=tuple(range(n_slots)),
    )


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(32768, 1024, 3072), (32768, 3072, 1024), (4096, 4096, 4096), (64, 64, 64), (1024, 8192, 512)],
)
def test_matmul_proxy_reproduces_recorded_flops(m, n, k):
    flops = 2.0 * m * n * k
    bytes_ = 2.0 * (m * k + k * n + m * n)
    kernel = build_kernel(OpCost("mm", "aten.mm.default", flops, bytes_), "meta")
    assert kernel.source == "proxy"
    assert kernel_flops(kernel) == pytest.approx(flops, rel=0.01)


def test_attention_proxy_is_the_attention_op_with_close_flops():
    from kareus_fx.models.attention_op import attention_backward_flops, attention_flops

    q = k = v = torch.Size([2, 8, 512, 128])
    for target, flops, tensors in (
        ("kareus.attention.default", attention_flops(q, k, v), 4),
        ("kareus.attention_backward.default", attention_backward_flops(q, k, v), 7),
    ):
        op = OpCost("attn", target, flops, tensors * 2.0 * q.numel())
        kernel = build_kernel(op, "cpu")
        assert kernel.source == "proxy"
        out = kernel.run()
        (first,) = out[:1] if isinstance(out, tuple) else (out,)
        # seq and heads x head_dim are solved from FLOPs and bytes and rounded
        assert first.shape[-2] == pytest.approx(512, rel=0.01)
        assert first.shape[1] * first.shape[-1] == pytest.approx(2 * 8 * 128, rel=0.02)


def test_memory_proxy_moves_recorded_bytes():
    kernel = build_kernel(OpCost("neg", "aten.neg.default", 1.0e6, 8.0e6), "cpu")
    out = kernel.run()
    assert kernel.source == "proxy" and out.numel() * out.element_size() * 2 == pytest.approx(8.0e6)


def test_replay_runs_recorded_matmuls_and_attention(tiny_dump):
    types, tables = tiny_dump
    checked = 0
    for ptype in types.values():
        for slot in ptype.slots:
            for op in slot.ops:
                if op.target not in (*MATMULS, "kareus.attention.default", "kareus.attention_backward.default"):
                    continue
                kernel = build_kernel(op, "cpu", tables[ptype.graph])
                assert kernel.source == "replay", op
                if op.target in MATMULS:  # the recorded shapes give exactly the recorded FLOPs
                    assert kernel_flops(kernel) == op.flops, op
                checked += 1
    assert checked > 10


def test_unreplayable_op_falls_back_to_proxy_with_warning(tiny_dump, caplog):
    types, tables = tiny_dump
    op = next(op for t in types.values() for s in t.slots for op in s.ops if op.target == "aten.sum.dim_IntList")
    graph = next(t.graph for t in types.values() if any(op in s.ops for s in t.slots))
    assert build_kernel(op, "cpu", tables[graph]).source == "replay"  # its dims are in the dump's arguments
    # A dump without recorded arguments (older kareus-fx) cannot give sum's dims: the proxy runs.
    table = {**tables[graph], op.name: {**tables[graph][op.name], "arguments": None}}
    with caplog.at_level(logging.WARNING):
        kernel = build_kernel(op, "cpu", table)
    assert kernel.source == "proxy"
    assert "not replayable" in caplog.text and op.name in caplog.text
    mismatched = OpCost(op.name, "aten.mm.default", op.flops, op.bytes)
    assert build_kernel(mismatched, "cpu", tables[graph]).source == "proxy"


def test_replay_partition_times_traced_types_on_cpu(tiny_dump):
    types, tables = tiny_dump
    for ptype in types.values():
        log: list[str] = []
        config = PartitionConfig(clock_mhz=1410, comm_sms=8, launch_slot=ptype.launch_slots[0])
        times_s = replay_partition(ptype, config, table=tables[ptype.graph], warmup=1, repeats=2, launch_log=log)
        assert len(times_s) == 2 and all(t > 0 for t in times_s)
        n_ops = sum(len(slot.ops) for slot in ptype.slots)
        assert len(log) == 3 * (n_ops + 1)  # every kernel and the collective, in each of 3 runs
        replayed = PartitionReplay.build([s.ops for s in ptype.slots], [ptype.collective], "cpu", tables[ptype.graph])
        sources = [k.source for slot in replayed.slots for k in slot]
        assert sources.count("replay") >= 0.75 * len(sources)


def test_repeated_layers_share_kernels_and_buffers(tmp_path):
    """A 4-layer un-split forward replays with one kernel per distinct op signature: about one
    layer's kernels (and input buffers), not one per op; each op keeps its own name in the log."""
    from kareus_fx.plan.graph_workload import sequential_graphs

    spec = TraceSpec(model="tiny-llama", tp=2, mbs=2, seq=64, layers=4)
    (path,) = trace_full_size(spec, options={"dump_dir": str(tmp_path), "nanobatch": False}).dump_paths
    dump = load_dump(path)
    forward = sequential_graphs(dump)["forward"]
    table = node_tables_from_dump(dump)["forward"]
    kernels = build_kernels(forward.ops, "cpu", table)
    assert [k.name for k in kernels] == [op.name for op in forward.ops]
    distinct = {id(k.run) for k in kernels}
    assert len(distinct) < 0.5 * len(kernels), (len(distinct), len(kernels))
    # Ops of different shapes never share: a shared kernel's recorded output shape matches each op's.
    by_run: dict[int, set] = {}
    for kernel, op in zip(kernels, forward.ops):
        by_run.setdefault(id(kernel.run), set()).add((op.target, tuple(table[op.name]["shape"] or ())))
    assert all(len(signatures) == 1 for signatures in by_run.values())


@pytest.mark.parametrize("launch_slot", [0, 1, 2, None])
def test_launch_order_respects_launch_slot(launch_slot):
    ptype = small_ptype()
    log: list[str] = []
    replay_partition(ptype, PartitionConfig(1410, 8, launch_slot), warmup=0, repeats=1, launch_log=log)
    kernels = [f"slot{i}:{op.name}" for i, slot in enumerate(ptype.slots) for op in slot.ops]
    position = 2 * (3 if launch_slot is None else launch_slot)
    assert log == kernels[:position] + ["collective0"] + kernels[position:]


def test_launch_slot_outside_partition_is_an_error():
    replay = PartitionReplay.build([s.ops for s in small_ptype(2).slots], [], "cpu")
    with pytest.raises(ValueError, match="launch_slot 3 outside"):
        replay.issue(3, 8)


def test_collective_proxy_moves_ring_traffic():
    all_reduce = CollectiveSpec("all_reduce", 8.0e6, 8)
    assert collective_traffic_bytes(all_reduce) == pytest.approx(2 * 7 / 8 * 8.0e6)
    assert collective_traffic_bytes(CollectiveSpec("all_gather", 8.0e6, 4)) == pytest.approx(3 / 4 * 8.0e6)
    kernel = build_collective_kernel(all_reduce, "cpu")
    assert kernel.elements * 2 == pytest.approx(collective_traffic_bytes(all_reduce))
    kernel.run(8)


def test_cooldown_waits_for_idle_temperature_and_times_out():
    readings = iter([70.0, 60.0, 52.0, 49.0])
    slept: list[float] = []
    assert wait_for_cooldown(
        lambda: next(readings), 48.0, tolerance_c=3.0, timeout_s=100.0, poll_s=1.0, sleep=slept.append
    )
    assert slept == [1.0, 1.0, 1.0]  # 70, 60, 52 above 48 + 3; 49 within
    now = [0.0]

    def advance(seconds: float) -> None:
        now[0] += seconds

    assert not wait_for_cooldown(
        lambda: 80.0, 40.0, tolerance_c=3.0, timeout_s=5.0, poll_s=1.0, sleep=advance, monotonic=lambda: now[0]
    )
    assert now[0] == pytest.approx(5.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_measure_without_cuda_raises_clear_error():
    profiler = DeviceProfiler("A100-SXM4-40GB")
    with pytest.raises(DeviceProfilerError, match="--profiler cuda needs a CUDA GPU") as err:
        profiler.measure(small_ptype(), PartitionConfig(1410, 8, 0))
    assert isinstance(err.value, KareusError) and "simulated" in str(err.value)
    with pytest.raises(DeviceProfilerError, match="needs a CUDA GPU"):
        profiler.measure_sequence(small_ptype().slots[0].ops, [], 1410)


@dataclass
class FakeWindow:
    time: float
    gpu_energy: dict[int, float]


class FakeZeus:
    """Energy = a constant power x the window's wall time."""

    gpu_indices: ClassVar[list[int]] = [0]

    def __init__(self, power_w: float) -> None:
        self.power_w = power_w
        self.windows: list[str] = []
        self._start_s = 0.0

    def begin_window(self, key: str) -> None:
        import time

        self.windows.append(key)
        self._start_s = time.perf_counter()

    def end_window(self, key: str) -> FakeWindow:
        import time

        elapsed_s = time.perf_counter() - self._start_s
        self.last_energy_j = self.power_w * elapsed_s
        return FakeWindow(time=elapsed_s, gpu_energy={0: self.last_energy_j})


def test_measurement_window_energy_split_and_clock(monkeypatch):
    """The measurement logic with a CPU replay and a fake energy counter (no GPU here)."""
    monkeypatch.setattr(DeviceProfiler, "_check_cuda", lambda self: None)
    temperatures = iter([45.0, 45.0])
    controller = ClockController.open("dry-run", handle_sigterm=False)
    zeus = FakeZeus(power_w=200.0)
    profiler = DeviceProfiler(
        "A100-SXM4-40GB",
        frequency=controller,
        min_window_s=0.2,
        warmup=1,
        repeats=3,
        zeus_monitor=zeus,
        read_temperature_c=lambda: next(temperatures),
    )
    replay = PartitionReplay.build([s.ops for s in small_ptype().slots], [small_ptype().collective], "cpu")
    window_runs: list[int] = []
    fill_window = DeviceProfiler._fill_window
    monkeypatch.setattr(
        DeviceProfiler,
        "_fill_window",
        lambda self, *args: window_runs.append(fill_window(self, *args)) or window_runs[-1],
    )
    with profiler:
        measurement = profiler._measure(replay, 1200, 1, 8)
        assert controller.applied_clock_mhz == 1200
    assert controller.applied_clock_mhz is None  # restored on close
    assert [r.clock_mhz for r in controller.requests] == [1200]
    assert len(zeus.windows) == 1 and profiler.last_window_s >= 0.2
    assert measurement.time_s > 0
    assert measurement.static_energy_j == pytest.approx(profiler.static_power_w * measurement.time_s)
    assert measurement.energy_j == pytest.approx(measurement.static_energy_j + measurement.dynamic_energy_j)
    # per-run energy = the window's energy / the runs in it (exact; a run's time in the window and
    # the timed repeats' median differ on a loaded CPU, so they are not compared)
    assert window_runs[0] >= 1
    assert measurement.energy_j == pytest.approx(zeus.last_energy_j / window_runs[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_measures_traced_partition(tiny_dump, cuda_gpu_name):
    types, tables = tiny_dump
    ptype = next(iter(types.values()))
    # no frequency controller: measured at the card's current clock (never change a lent card's clocks)
    with DeviceProfiler(cuda_gpu_name, node_tables=tables, min_window_s=1.0, warmup=2, repeats=5) as profiler:
        measurement = profiler.measure(ptype, PartitionConfig(1410, 8, ptype.launch_slots[0]))
        sequential = profiler.measure(ptype, PartitionConfig(1410, 8, None))
    assert measurement.time_s > 0 and sequential.time_s > 0
    assert measurement.energy_j > 0
    assert profiler.last_window_s >= 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_replay_times_with_cuda_events():
    ptype = small_ptype()
    log: list[str] = []
    times_s = replay_partition(ptype, PartitionConfig(1410, 8, 1), device="cuda", warmup=2, repeats=5, launch_log=log)
    assert all(t > 0 for t in times_s)
    assert log.index("collective0") == 2


def test_the_database_kind_names_the_replay(monkeypatch):
    """CUDA-graph replays (the default) and op-by-op replays are keyed apart in the profile
    database: on a GPU they measure different things below a few milliseconds."""
    assert DeviceProfiler("A100-SXM4-40GB").kind == "cuda-graph"
    assert DeviceProfiler("A100-SXM4-40GB", cuda_graphs=False).kind == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_measures_from_one_cuda_graph_per_configuration(cuda_gpu_name):
    ptype = small_ptype()
    with DeviceProfiler(cuda_gpu_name, min_window_s=1.0, warmup=2, repeats=5) as profiler:
        overlapped = profiler.measure(ptype, PartitionConfig(1410, 8, 1))
        (replay,) = profiler._replays.values()
        assert profiler._captured is replay and replay._graph_config == (1, 8)
        graph = replay._graph
        profiler.measure(ptype, PartitionConfig(1410, 8, 1))
        assert replay._graph is graph  # captured once per configuration
        sequential = profiler.measure(ptype, PartitionConfig(1410, 16, None))
        assert replay._graph_config == (None, 16)
    assert replay._graph is None  # closing released the graph and its memory pool
    assert overlapped.time_s > 0 and sequential.time_s > 0 and overlapped.energy_j > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_replay_that_cannot_be_captured_is_measured_op_by_op_with_a_warning(cuda_gpu_name):
    ptype = small_ptype()
    replay = PartitionReplay.build([s.ops for s in ptype.slots], [ptype.collective], "cuda")
    values = torch.ones(16, device="cuda")
    # reading a value back to the host is not allowed while a stream is captured
    replay.slots[1].append(Kernel("readback", "test.item", "proxy", lambda: values.sum().item()))
    with DeviceProfiler(cuda_gpu_name, min_window_s=1.0, warmup=2, repeats=5) as profiler:
        with pytest.warns(UserWarning, match="could not be captured in a CUDA graph"):
            measurement = profiler._measure(replay, 1410, 1, 8)
    assert measurement.time_s > 0 and measurement.energy_j > 0
    assert replay._graph is None
    # found before capturing: a failed capture would leave the CUDA generator capturing
    assert torch.randn(4, device="cuda").isfinite().all()


def test_each_slot_rebuilds_as_one_graph_of_its_recorded_ops(tiny_dump):
    """The fused replay's graphs: every slot op is a node of its slot's graph, in dump order, with
    the dataflow between them; what the slot reads from elsewhere is a graph input; every value
    read outside the slot is an output (so Inductor keeps the slot's work)."""
    types, tables = tiny_dump
    built = 0
    for ptype in types.values():
        table = tables[ptype.graph]
        for slot in ptype.slots:
            gm, inputs = slot_graph(slot.ops, table)
            calls = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
            assert {op.name for op in slot.ops} <= set(calls)
            input_names = {name for name, _, _ in inputs}
            assert not input_names & set(calls)
            for op in slot.ops:  # an input made inside the graph is wired, not re-read
                for source in table[op.name]["inputs"]:
                    assert (source in calls) != (source in input_names), (op.name, source)
            (outputs,) = next(n for n in gm.graph.nodes if n.op == "output").args
            returned = {n.name for n in outputs}
            for name in calls:
                read_outside = any(name in r["inputs"] and other not in calls for other, r in table.items())
                assert (name in returned) >= read_outside, name
            built += 1
    assert built >= 8


def test_fused_slot_computes_what_its_recorded_ops_compute(tiny_dump):
    """One slot compiled by Inductor against the same graph run op by op: equal within bf16
    rounding (max difference <= 2 % of the largest value; Inductor keeps fp32 between fused ops
    where eager rounds each op to bf16)."""
    types, tables = tiny_dump
    ptype, slot = min(((t, s) for t in types.values() for s in t.slots if s.ops), key=lambda pair: len(pair[1].ops))
    run, gm, tensors = fused_slot_kernel(slot.ops, tables[ptype.graph], torch.device("cpu"))
    fused = run()
    eager = gm(*tensors)
    assert len(fused) == len(eager) >= 1
    for got, want in zip(fused, eager):
        assert got.shape == want.shape and got.dtype == want.dtype
        scale = float(want.float().abs().max()) or 1.0
        assert float((got.float() - want.float()).abs().max()) <= 0.02 * scale


def test_slot_without_recorded_arguments_is_replayed_op_by_op(tiny_dump, caplog):
    types, tables = tiny_dump
    ptype = next(iter(types.values()))
    table = {name: dict(record) for name, record in tables[ptype.graph].items()}
    first = ptype.slots[0].ops[0].name
    table[first]["arguments"] = None  # an older dump, or an argument the dump cannot encode
    with pytest.raises(FusedReplayError, match=f"{first}.*no recorded arguments"):
        slot_graph(ptype.slots[0].ops, table)
    with caplog.at_level(logging.WARNING):
        replay = PartitionReplay.build([ptype.slots[0].ops], [ptype.collective], "cpu", table, fused=True)
    assert "not fused" in caplog.text
    assert [k.source for k in replay.slots[0]] != ["fused"] and len(replay.slots[0]) == len(ptype.slots[0].ops)
    assert DeviceProfiler("A100-SXM4-40GB", fused_slots=True).kind == "cuda-graph-fused"
