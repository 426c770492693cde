"""Megatron-core's hidden dropout as memory traffic (``kareus_fx.frameworks.megatron_dropout``)."""

from __future__ import annotations

import pytest

from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.frameworks.megatron_dropout import dropout_ops
from kareus_fx.plan.graph_workload import PartitionedGraph, SequentialGraph, with_extra_ops
from kareus_fx.workload import OpCost

ELEMENTS = 8 * 4096 * 2048  # Qwen3-1.7B TP8, mbs 8 x 4K: the hidden states on every TP rank


def test_dropout_bytes_per_element_forward_backward_and_recompute() -> None:
    (forward,) = dropout_ops("forward", 13, ELEMENTS, "full")
    assert forward.bytes == 2 * 13 * ELEMENTS  # one bool mask per add, two adds per layer
    backward = dropout_ops("backward", 13, ELEMENTS, "full")
    rewrite, grads = backward[0], backward[1:]
    assert rewrite.name == "dropout_mask_rewrite" and rewrite.bytes == forward.bytes
    assert len(grads) == 26 and all(op.bytes == 5 * ELEMENTS and op.bound == "memory" for op in grads)
    assert len(dropout_ops("backward", 13, ELEMENTS, "none")) == 26  # nothing recomputed
    assert dropout_ops("forward", 0, ELEMENTS, "full") == ()


def test_the_graphs_gain_the_ops_and_keep_their_fingerprints() -> None:
    add = OpCost("add", "aten.add", 0.0, 6.0 * ELEMENTS, bound="memory")
    seq = {g: SequentialGraph(g, (add,), (), f"fp-{g}") for g in ("forward", "backward")}
    part = {g: PartitionedGraph(g, (), seq[g], f"fp-part-{g}") for g in ("forward", "backward")}
    extra = {g: dropout_ops(g, 2, ELEMENTS, "full") for g in ("forward", "backward")}
    new_seq, new_part = with_extra_ops(seq, part, extra)
    assert new_part is not None
    for g in ("forward", "backward"):
        added = dropout_ops(g, 2, ELEMENTS, "full")
        assert new_seq[g].ops == (add, *added) and new_seq[g].fingerprint == f"fp-{g}"
        assert new_part[g].outside.ops == (add, *added) and new_part[g].fingerprint == f"fp-part-{g}"
    assert with_extra_ops(seq, None, extra)[1] is None


def test_a_13_layer_stage_pays_milliseconds_at_hbm_bandwidth() -> None:
    simulator = SimulatedProfiler("A100-SXM4-40GB").simulator
    hbm = simulator.spec.hbm_bandwidth_bytes_per_s
    for graph in ("forward", "backward"):
        ops = dropout_ops(graph, 13, ELEMENTS, "full")
        m = simulator.predict_sequence(ops, (), clock_mhz=simulator.spec.clock_max_mhz).measurement
        moved = sum(op.bytes for op in ops)
        assert moved / hbm < m.time_s < moved / (0.7 * hbm) + len(ops) * 20e-6
    # the backward moves (1 + 5) / 1 times the forward's bytes
    assert sum(op.bytes for op in dropout_ops("backward", 13, ELEMENTS, "full")) == pytest.approx(
        6 * dropout_ops("forward", 13, ELEMENTS, "full")[0].bytes
    )
