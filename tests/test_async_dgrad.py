"""Transformer Engine's asynchronous dgrad all-reduce beside the wgrad GEMM (``kareus_fx/frameworks/megatron_async_dgrad.py``).

The pairs are read from a real traced backward (tiny-llama TP2, the session's small plan): the
column-parallel linears' input-gradient all-reduces pair with their own weight-gradient matmuls,
the recomputed forward's row-parallel all-reduces stay alone. The price comes from the simulator:
an overlapped pair is faster than the two run one after the other, never faster than the longer
of the two alone.
"""

from __future__ import annotations

import pytest

from kareus_fx.capture.dump import load_dump
from kareus_fx.cost_models.simulator import Simulator
from kareus_fx.frameworks.megatron_async_dgrad import async_dgrad_pairs, async_dgrad_split, with_async_dgrad
from kareus_fx.plan.graph_workload import sequential_graphs
from kareus_fx.workload import CollectiveSpec, OpCost

GPU = "A100-SXM4-40GB"
TOKENS, HIDDEN, OUT_LOCAL = 32768, 2048, 1536  # Qwen3-1.7B TP8 mbs8 4K: gate_up_proj's local rows


def _node(name, op, kind, shape, module, flops=0.0, nbytes=0.0, collective=None, inputs=()):
    return {
        "name": name,
        "op": op,
        "kind": kind,
        "shape": list(shape),
        "module": module,
        "flops": flops,
        "bytes": nbytes,
        "bound": "compute" if flops > 1e9 else "memory",
        "kernel": None,
        "collective": collective,
        "inputs": list(inputs),
        "nanobatch": None,
    }


def _column_parallel_backward():
    """A gate_up_proj backward (wgrad, dgrad, its all-reduce) after a recomputed o_proj forward
    all-reduce (row-parallel: stays exposed), as aot_autograd orders them."""
    ar = {"kind": "all_reduce", "bytes": TOKENS * HIDDEN * 2.0, "group_size": 8, "group_name": "tp"}
    gemm = 2.0 * TOKENS * HIDDEN * OUT_LOCAL
    return {
        "name": "backward",
        "nodes": [
            _node("mm_o", "aten.mm.default", "compute", (TOKENS, HIDDEN), "l.o_proj", gemm / 6, 1e8),
            _node("ar_o", "_c10d_functional.all_reduce.default", "collective", (8, 4096, HIDDEN), "l.o_proj", 0, 0, ar),
            _node("mm_o_w", "aten.mm.default", "compute", (HIDDEN, 256), "l.o_proj", gemm / 6, 1e7),
            _node("mm_w", "aten.mm.default", "compute", (OUT_LOCAL, HIDDEN), "l.gate_up_proj", gemm, 2e8),
            _node("mm_d", "aten.mm.default", "compute", (TOKENS, HIDDEN), "l.gate_up_proj", gemm, 3e8),
            _node(
                "ar_d",
                "_c10d_functional.all_reduce.default",
                "collective",
                (8, 4096, HIDDEN),
                "l.gate_up_proj",
                0,
                0,
                ar,
            ),
            _node("add", "aten.add.Tensor", "compute", (8, 4096, HIDDEN), "l", TOKENS * HIDDEN, 4e8),
        ],
    }


def test_only_the_column_parallel_input_gradient_all_reduce_pairs_with_its_wgrad_gemm():
    graph = _column_parallel_backward()
    assert async_dgrad_pairs(graph) == [("ar_d", "mm_w")]
    assert async_dgrad_pairs({**graph, "name": "forward"}) == []
    split = async_dgrad_split(graph)
    assert split is not None
    assert [op.name for op in split.rest.ops] == ["mm_o", "mm_o_w", "mm_d", "add"]
    assert len(split.rest.collectives) == 1  # the row-parallel forward all-reduce, still alone
    (pair,) = split.beside
    assert pair.count == 1 and pair.launch_slots == (0,) and [op.name for op in pair.slots[0].ops] == ["mm_w"]


def test_overlap_is_faster_than_in_turn_and_no_faster_than_the_longer_alone():
    sim = Simulator(GPU)
    graph = _column_parallel_backward()
    split = async_dgrad_split(graph)
    assert split is not None
    (pair,) = split.beside
    nodes = {n["name"]: n for n in graph["nodes"]}
    ops = [OpCost(n["name"], n["op"], n["flops"], n["bytes"]) for n in graph["nodes"] if n["kind"] == "compute"]
    colls = [CollectiveSpec("all_reduce", TOKENS * HIDDEN * 2.0, 8)] * 2
    for clock in (1410, 1200):
        plain = sim.predict_sequence(ops, colls, clock_mhz=clock).measurement
        overlapped = sim.predict_sequence_async(split.rest.ops, split.rest.collectives, split.beside, clock).measurement
        gemm_alone = sim.predict_sequence([pair.slots[0].ops[0]], (), clock_mhz=clock).measurement.time_s
        ar_alone = sim.predict_sequence((), [pair.collective], clock_mhz=clock).measurement.time_s
        saved_s = plain.time_s - overlapped.time_s
        assert 0.0 < saved_s < min(gemm_alone, ar_alone)  # contention: less than the shorter hides
        assert saved_s > 0.3 * min(gemm_alone, ar_alone)
        # an exact profiler's measurement becomes the overlapped prediction itself
        fixed = with_async_dgrad({clock: plain}, _as_sequence(ops, colls), split, sim)[clock]
        assert fixed.time_s == pytest.approx(overlapped.time_s, rel=1e-12)
        assert fixed.energy_j == pytest.approx(overlapped.energy_j, rel=1e-12)
    assert nodes["ar_o"]["module"] == "l.o_proj"
    assert with_async_dgrad({1410: plain}, _as_sequence(ops, colls), None, sim) == {1410: plain}


def _as_sequence(ops, colls):
    from kareus_fx.plan.graph_workload import SequentialGraph

    return SequentialGraph("backward", tuple(ops), tuple(colls), "")


def test_a_traced_tp2_backward_pairs_every_layers_qkv_and_gate_up_all_reduce(small_real_plan):
    # tiny-llama TP2, stage 0 of PP2: the qkv_proj and gate_up_proj input gradients pair with
    # their wgrads; a recomputed forward's row-parallel all-reduce would stay alone.
    (path,) = (small_real_plan[1] / "dumps").glob("stage0-sequential*/*.json")
    dump = load_dump(path)
    backward = next(g for g in dump["graphs"] if g["name"] == "backward")
    nodes = {n["name"]: n for n in backward["nodes"]}
    pairs = async_dgrad_pairs(backward)
    modules = sorted(nodes[ar]["module"].rsplit(".", 1)[-1] for ar, _ in pairs)
    layers = len({nodes[ar]["module"].split(".")[1] for ar, _ in pairs})
    assert layers >= 1 and modules == sorted(["gate_up_proj", "qkv_proj"] * layers)
    for ar, mm in pairs:
        assert nodes[ar]["module"] == nodes[mm]["module"]
        assert nodes[mm]["shape"][-1] == nodes[ar]["shape"][-1]  # the weight's input width
    alone = [n for n in backward["nodes"] if n["kind"] == "collective" and n["name"] not in dict(pairs)]
    assert all(n["module"].endswith(("o_proj", "down_proj")) for n in alone)  # recomputed forward's, if any
    seq = sequential_graphs(dump)["backward"]
    split = async_dgrad_split(backward)
    assert split is not None
    assert len(split.rest.collectives) + sum(p.count for p in split.beside) == len(seq.collectives)
    assert len(split.rest.ops) + sum(p.count for p in split.beside) == len(seq.ops)


def test_a_user_workload_s_megatron_backward_keeps_the_traced_order(small_real_plan):
    # A workload of the user's (no Megatron settings) is deployed un-split in the traced order:
    # its plan prices the dgrad all-reduces one after the other, as the deployed step runs them.
    import json

    plan_path, work = small_real_plan
    plan = json.loads(plan_path.read_text())
    sim = Simulator(plan["gpu"])
    (path,) = (work / "dumps").glob("stage0-sequential*/*.json")
    dump = load_dump(path)
    seq = sequential_graphs(dump)["backward"]
    options = [o for o in plan["microbatch_options"]["0/backward"] if o["sequential"]]
    assert options
    for option in options:
        plain = sim.predict_sequence(seq.ops, seq.collectives, clock_mhz=option["clock_mhz"])
        assert option["time_s"] == pytest.approx(plain.measurement.time_s, rel=1e-9)


def test_the_testbed_s_engine_prices_the_dgrad_all_reduces_beside_their_wgrad_gemms(small_real_plan):
    # The testbed presets' Megatron settings (Transformer Engine, no sequence parallelism) price
    # the overlap the planner's Megatron-LM option then runs; the same graphs under the HF
    # defaults keep the traced order.
    import dataclasses

    from kareus_fx.frameworks.megatron_settings import HF_DEFAULTS
    from kareus_fx.frameworks.registry import framework_for
    from kareus_fx.plan.request import plan_request_from_preset
    from kareus_fx.plan.stage_tracing import repriced

    testbed = plan_request_from_preset("qwen3-1.7b-tp8-mbs8-seq4k")
    assert testbed.megatron.te_async_dgrad
    user = dataclasses.replace(testbed, megatron=HF_DEFAULTS)
    sim = Simulator(testbed.gpu)
    (path,) = (small_real_plan[1] / "dumps").glob("stage0-sequential*/*.json")
    dump = load_dump(path)
    backward = next(g for g in dump["graphs"] if g["name"] == "backward")
    split = async_dgrad_split(backward)
    seq = sequential_graphs(dump)["backward"]
    assert split is not None
    clock = sim.spec.clock_max_mhz
    measured = {clock: sim.predict_sequence(seq.ops, seq.collectives, clock_mhz=clock).measurement}
    overlapped = sim.predict_sequence_async(split.rest.ops, split.rest.collectives, split.beside, clock)

    def priced_as(req):
        reprice = framework_for(req).backward_repricing(req, {"sequential": path}, load_dump).get("sequential")
        return repriced(measured, seq, reprice, req.gpu)[clock].time_s

    assert priced_as(user) == measured[clock].time_s
    priced = priced_as(testbed)
    assert priced == pytest.approx(overlapped.measurement.time_s, rel=1e-9)
    assert priced < measured[clock].time_s
