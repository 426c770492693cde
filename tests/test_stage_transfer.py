"""The pipeline's send/recv between stages (``kareus_fx/frameworks/pipeline_sends.py``).

The boundary tensor is read from a real traced dump; the link times follow from the hardware facts
(AWS p4d: 400 Gbps between nodes shared by 8 A100s; NVLink inside a node) computed here by hand;
the planner lengthens exactly the sending instructions, at the blocking power.
"""

from __future__ import annotations

import pytest

from kareus_fx.capture.dump import load_dump
from kareus_fx.compose.iteration import InstructionOption
from kareus_fx.compose.microbatch import MicrobatchPoint
from kareus_fx.cost_models.hardware import gpu_spec
from kareus_fx.errors import OptionsError
from kareus_fx.frameworks.pipeline_sends import boundary_bytes, link_wait_s, stage_transfer_s
from kareus_fx.plan.composition import with_link_wait

A100 = gpu_spec("A100-SXM4-40GB")
QWEN_TP8_BYTES = 8 * 4096 * 2048 * 2  # mbs x seq x hidden, bf16


def test_the_boundary_tensor_is_the_stage_output_of_the_traced_dump(small_real_plan):
    # tiny-llama, mbs 2, seq 1536, hidden 64, bf16: the hidden states stage 0 sends on.
    (dump,) = (small_real_plan[1] / "dumps").glob("stage0-sequential*/*.json")
    assert boundary_bytes(load_dump(dump)) == 2 * 1536 * 64 * 2


def test_a_stage_boundary_between_p4d_nodes_runs_at_the_gpus_share_of_400_gbps():
    assert A100.gpus_per_node == 8 and A100.node_network_bytes_per_s == 400e9 / 8
    per_gpu = 400e9 / 8 / 8  # 6.25 GB/s
    # TP8 x PP2: each stage fills a node; each rank sends the whole activation (Megatron-core, no
    # sequence parallelism: no scatter-gather across the TP ranks), all 8 at once over the node's link.
    assert link_wait_s(QWEN_TP8_BYTES, 8, 1, 0, A100) == pytest.approx(QWEN_TP8_BYTES / per_gpu)
    assert link_wait_s(QWEN_TP8_BYTES, 8, 1, 0, A100) == pytest.approx(21.5e-3, rel=0.01)
    # TP2 x PP2 fits in one node: the send runs over NVLink, about 40x faster.
    inside = link_wait_s(QWEN_TP8_BYTES, 2, 1, 0, A100)
    assert inside == pytest.approx(QWEN_TP8_BYTES / A100.nvlink_bandwidth_bytes_per_s)
    # TP2 x PP8: only the boundary between stage 3 (ranks 6-7) and 4 (ranks 8-9) crosses nodes.
    crossing = [link_wait_s(QWEN_TP8_BYTES, 2, 1, s, A100) > inside * 1.5 for s in range(7)]
    assert crossing == [False, False, False, True, False, False, False]


def test_expert_parallel_replicas_of_a_stage_fill_its_node_so_the_send_crosses_nodes():
    # TP1 x PP2 with EP8 over 8 data-parallel replicas: stage 0 is ranks 0-7 (node 0), stage 1 ranks
    # 8-15 (node 1), so each replica's send crosses the network; without EP both stages share a node.
    per_gpu = 400e9 / 8 / 8
    alone = stage_transfer_s([1e8, 0.0], 1, 1, A100)
    replicas = stage_transfer_s([1e8, 0.0], 1, 1, A100, stage_replicas=8)
    assert alone[(0, "forward")] == pytest.approx(1e8 / A100.nvlink_bandwidth_bytes_per_s)
    assert replicas[(0, "forward")] == replicas[(1, "backward")] == pytest.approx(1e8 / per_gpu)


def test_forwards_send_to_the_next_stage_and_backwards_to_the_previous():
    waits = stage_transfer_s([QWEN_TP8_BYTES] * 3, 8, 1, A100)
    link = link_wait_s(QWEN_TP8_BYTES, 8, 1, 0, A100)
    assert waits == {
        (0, "forward"): link,
        (1, "forward"): link,
        (2, "forward"): 0.0,
        (0, "backward"): 0.0,
        (1, "backward"): link,
        (2, "backward"): link,
    }


def test_a_gpu_without_a_node_fact_is_refused_across_nodes():
    from dataclasses import replace

    bare = replace(A100, gpus_per_node=None, node_network_bytes_per_s=None)
    with pytest.raises(OptionsError, match="no node network is known"):
        link_wait_s(QWEN_TP8_BYTES, 8, 1, 0, bare)


def test_a_send_lengthens_each_option_at_the_blocking_power():
    options = [
        InstructionOption(time_s=0.1, energy_j=30.0, knob=1410),
        MicrobatchPoint(0.09, 28.0, 20.0, 8.0, 1410, None),
    ]
    waited = with_link_wait(options, 0.003, 85.0)
    assert [o.time_s for o in waited] == pytest.approx([0.103, 0.093])
    assert [o.energy_j for o in waited] == pytest.approx([30.255, 28.255])
    assert waited[1].static_energy_j == pytest.approx(8.255) and waited[1].dynamic_energy_j == 20.0
    assert waited[0].knob == 1410 and with_link_wait(options, 0.0, 85.0) == options
