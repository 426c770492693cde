"""Megatron-LM's per-iteration work after the last microbatch (``kareus_fx.frameworks.step_tail``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kareus_fx.compose.iteration import IterationFrontier, IterationPoint
from kareus_fx.cost_models.simulated_profiler import SimulatedProfiler
from kareus_fx.errors import OptionsError
from kareus_fx.frameworks.step_tail import STEP_PASSES_BYTES_PER_PARAM, rank_parameters, step_tail, with_step_tail
from kareus_fx.models.configs import get_config

QWEN = get_config("qwen3-1.7b")
EMBEDDING = QWEN.vocab_size * QWEN.hidden_size


@pytest.fixture(scope="module")
def simulator():
    return SimulatedProfiler("A100-SXM4-40GB").simulator


def test_parameters_match_the_published_counts() -> None:
    # Qwen3-1.7B's model card: 1.7B parameters, 1.4B without the (tied) embedding.
    (whole,) = rank_parameters(QWEN, [28], tp=1, ranks=1)
    assert whole == pytest.approx(1.72e9, rel=0.01)
    assert whole - EMBEDDING == pytest.approx(1.41e9, rel=0.01)
    # A pipeline: the last rank holds its own copy of the tied embedding (Megatron-LM's output layer),
    # and tensor parallelism shards everything but the norms.
    first, last = rank_parameters(QWEN, [16, 12], tp=4, ranks=2)
    assert first + last == pytest.approx((whole + EMBEDDING) / 4, rel=1e-3)
    assert first - last == pytest.approx(4 * (whole - EMBEDDING) / 28 / 4, rel=0.01)
    # Interleaved: global stage s on rank s mod ranks.
    assert rank_parameters(QWEN, [8, 6, 8, 6], tp=4, ranks=2) == pytest.approx((first, last))
    with pytest.raises(OptionsError, match="spread evenly"):
        rank_parameters(QWEN, [10, 9, 9], tp=4, ranks=2)


def test_one_gpu_pays_only_the_optimizer_at_hbm_bandwidth(simulator) -> None:
    tail = step_tail(simulator, QWEN, [28], tp=1, cp=1, dp=1, pp=1)
    assert tail.parts_s["grad_sync"] == tail.parts_s["embedding_grad_sync"] == tail.parts_s["grad_norm_reduce"] == 0.0
    (params,) = tail.parameters_per_gpu
    moved = params * sum(STEP_PASSES_BYTES_PER_PARAM.values())
    hbm = simulator.spec.hbm_bandwidth_bytes_per_s
    # memory-bound: at most the spec's bandwidth, at least 80 % of it
    assert moved / hbm < tail.time_s < moved / (0.8 * hbm)
    assert tail.time_s == pytest.approx(tail.parts_s["optimizer"])
    assert tail.energy_j > tail.time_s * simulator.spec.blocking_power_w


def test_embedding_sync_crosses_nodes_at_the_gpus_network_share(simulator) -> None:
    spec = simulator.spec
    across = step_tail(simulator, QWEN, [16, 12], tp=8, cp=1, dp=1, pp=2)  # 16 GPUs: stages on two nodes
    inside = step_tail(simulator, QWEN, [16, 12], tp=4, cp=1, dp=1, pp=2)  # 8 GPUs: one node
    fp32_grad = EMBEDDING / 8 * 4
    share = spec.node_network_bytes_per_s / spec.gpus_per_node  # 400 Gbps over 8 A100s: 6.25 GB/s
    assert across.parts_s["embedding_grad_sync"] == pytest.approx(
        simulator.params.comm_latency_s + fp32_grad / share, rel=1e-9
    )
    assert across.parts_s["embedding_grad_sync"] > 10 * inside.parts_s["embedding_grad_sync"] > 0.0
    # the context-parallel pair all-reduces every gradient (inside the node), the TP-only job none
    cp2 = step_tail(simulator, QWEN, [16, 12], tp=4, cp=2, dp=1, pp=2)
    assert across.parts_s["grad_sync"] == 0.0 < cp2.parts_s["grad_sync"]
    assert cp2.time_s == pytest.approx(sum(cp2.parts_s.values()), rel=1e-9)
    # each rank idles the part of the tail it does not work at the blocking power, never less
    assert cp2.energy_j >= 2 * cp2.time_s * spec.blocking_power_w


def test_with_step_tail_lengthens_every_plan_alike(simulator) -> None:
    tail = step_tail(simulator, QWEN, [16, 12], tp=8, cp=1, dp=1, pp=2)
    points = tuple(
        IterationPoint(t, e, t, e, choices=np.zeros(4, dtype=np.uint32)) for t, e in ((1.0, 50.0), (1.2, 40.0))
    )
    front = IterationFrontier(
        num_stages=2,
        num_microbatches=1,
        blocking_power_w=85.0,
        unit_time_s=1e-3,
        cost_model="exponential",
        nodes=(),
        options={},
        points=points,
        trace=points[::-1],
    )
    longer = with_step_tail(front, tail)
    for before, after in zip((*front.points, *front.trace), (*longer.points, *longer.trace)):
        assert after.time_s - before.time_s == pytest.approx(tail.time_s)
        assert after.energy_j - before.energy_j == pytest.approx(tail.energy_j)
        assert (after.solver_time_s, after.solver_energy_j) == (before.solver_time_s, before.solver_energy_j)
    assert math.isclose(longer.points[0].time_s, 1.0 + tail.time_s)


def test_a_simulated_plan_records_the_tail_in_every_frontier(small_real_plan, simulator) -> None:
    from kareus_fx.plan.plan_format import load_plan

    plan = load_plan(small_real_plan[0])
    w = plan.workload
    tail = step_tail(
        simulator, get_config(w["model"]), w["stage_layers"], tp=w["tp"], cp=w["cp"], dp=w.get("dp", 1), pp=w["pp"]
    )
    record = plan.data["step_tail"]
    assert record["time_s"] == pytest.approx(tail.time_s, rel=1e-12)
    assert record["energy_j"] == pytest.approx(tail.energy_j * w["tp"] * w["cp"], rel=1e-12)
    assert record["parts_s"]["optimizer"] > 0.0
    for method in plan.data["methods"].values():
        assert min(t for t, _ in method["frontier"]) > record["time_s"]


def test_the_distributed_optimizer_shards_the_step_over_the_context_group(simulator) -> None:
    plain = step_tail(simulator, QWEN, [15, 13], tp=4, cp=2, dp=1, pp=2)
    sharded = step_tail(simulator, QWEN, [15, 13], tp=4, cp=2, dp=1, pp=2, distributed_optimizer=True)
    # a reduce-scatter moves half an all-reduce's bus bytes: the sync at most ~half (plus latency)
    assert 0.4 * plain.parts_s["grad_sync"] < sharded.parts_s["grad_sync"] < 0.6 * plain.parts_s["grad_sync"]
    # each rank steps half its parameters (the zeroing stays whole) but all-gathers the bf16 weights
    assert sharded.parts_s["optimizer"] < plain.parts_s["optimizer"]
    assert sharded.time_s < plain.time_s and sharded.energy_j < plain.energy_j
    assert sharded.parts_s["embedding_grad_sync"] == plain.parts_s["embedding_grad_sync"] > 0.0
    # a TP-only job has no context group: nothing to shard, the same tail
    tp8 = [step_tail(simulator, QWEN, [15, 13], tp=8, cp=1, dp=1, pp=2, distributed_optimizer=d) for d in (0, 1)]
    assert tp8[0] == tp8[1]


def test_untied_embeddings_have_no_embedding_sync_but_the_same_parameters(simulator) -> None:
    # the paper's Llama-3.2-3B ran share_embeddings_and_output_weights: false (frameworks/megatron_settings.py)
    llama = get_config("llama3.2-3b")
    tied = step_tail(simulator, llama, [15, 13], tp=4, cp=2, dp=1, pp=2)
    untied = step_tail(simulator, dataclasses.replace(llama, tie_embeddings=False), [15, 13], tp=4, cp=2, dp=1, pp=2)
    assert tied.parts_s["embedding_grad_sync"] > 0.05 and untied.parts_s["embedding_grad_sync"] == 0.0
    # in a pipeline the last stage holds its own output layer either way
    assert untied.parameters_per_gpu == tied.parameters_per_gpu
    assert untied.time_s == pytest.approx(tied.time_s - tied.parts_s["embedding_grad_sync"], rel=1e-9)
