"""Data parallelism over kareus-compiled blocks: FSDP2 (``fully_shard``) and DDP keep eager parity.

Fast sibling of the slow ``test_torchtitan.py::test_fsdp2_over_kareus_blocks_with_tp_matches_eager``
(4 ranks, torchtitan's llama3 with TP/SP): 2 gloo ranks = 2 data-parallel replicas of the small
``DTensorTransformer`` (2 blocks), each block compiled on its own by
:func:`kareus_fx.integrations.torchtitan.compile_blocks` after ``fully_shard`` of each block and of
the model (torchtitan's order: FSDP2's hooks stay outside the block graphs). Each replica trains on
its own rows of one global batch; a ``NanobatchFallbackWarning`` fails the test. The block graph
holds no collective here (FSDP2's all-gathers and reduce-scatters, DDP's all-reduces, run in hooks
outside it), so the nanobatch pass rightly leaves it whole: the split under FSDP2 needs TP inside
the block, which takes 4 ranks (the slow torchtitan test checks it). Reference: the same weights unsharded, eager, on the global batch: each replica's
loss equals eager's on its rows, and every parameter's gradient (gathered from FSDP2's shards)
equals eager's gradient of the global mean loss (the mean of the replicas' losses, rows equal).
fp32; tolerances: loss rtol 1e-5, gradients rtol 1e-4, atol 1e-6 (nanobatched sums and the
reduce-scatter add in another order). ``sabotage`` breaks the job on purpose, to show the checks
can fail: ``"swap"`` feeds each replica the other's rows, ``"no-reduce"`` shards each replica over
its own 1-rank mesh (no gradient reduction between replicas).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_harness import DistributedTestError, run_distributed

REPLICAS, ROWS, SEQ, VOCAB = 2, 4, 16, 256


def _dp_parity(rank: int, world_size: int, wrap: str, sabotage: str | None = None) -> list[bool]:
    """Train one step on ``wrap`` ("fsdp2" or "ddp") replicas; assert parity; return, per block
    graph the kareus backend compiled, whether it communicates (the nanobatch pass's test)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    import kareus_fx.capture.compile_step as compile_step
    from kareus_fx.integrations.torchtitan import compile_blocks
    from kareus_fx.models.dtensor_model import DTensorTransformer
    from kareus_fx.passes.nanobatch import NanobatchFallbackWarning

    torch.manual_seed(0)
    reference = DTensorTransformer(vocab=VOCAB)
    model = DTensorTransformer(vocab=VOCAB)
    model.load_state_dict(reference.state_dict())
    if wrap == "fsdp2":
        if sabotage == "no-reduce":
            groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
            mesh = DeviceMesh.from_group(groups[rank], "cpu")
        else:
            mesh = init_device_mesh("cpu", (world_size,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_force_sum_reduction_for_comms(True)  # gloo has no AVG/PREMUL_SUM: SUM, then divide
        for block in model.layers:
            block.set_force_sum_reduction_for_comms(True)
    else:
        model = DistributedDataParallel(model)
    compile_blocks(model.module if wrap == "ddp" else model, {"inductor": False})

    communicating: list[bool] = []
    communicates = compile_step.graph_communicates

    def recording(gm, example_inputs):
        communicating.append(communicates(gm, example_inputs))
        return communicating[-1]

    compile_step.graph_communicates = recording
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (REPLICAS * ROWS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (REPLICAS * ROWS, SEQ), generator=g)
    replica = (1 - rank) if sabotage == "swap" else rank
    mine = slice(replica * ROWS, (replica + 1) * ROWS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NanobatchFallbackWarning)
        loss = model(tokens[mine], labels[mine])
        loss.backward()
    own = slice(rank * ROWS, (rank + 1) * ROWS)
    with torch.no_grad():
        torch.testing.assert_close(loss, reference(tokens[own], labels[own]), rtol=1e-5, atol=0)
    reference(tokens, labels).backward()  # the global batch's mean loss
    wanted = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, wanted[name.removeprefix("module.")].grad, rtol=1e-4, atol=1e-6, msg=name)
    return communicating


@pytest.mark.parametrize("wrap", ["fsdp2", pytest.param("ddp", marks=pytest.mark.slow)])  # ddp: 20 s more
def test_data_parallel_replicas_over_kareus_blocks_match_eager(wrap):
    """2 replicas: loss and gradients equal eager on the global batch; kareus compiled one graph
    for both blocks, holding no collective (the data-parallel hooks run outside it)."""
    for communicating in run_distributed(_dp_parity, REPLICAS, wrap, timeout_s=300):
        assert communicating == [False]


@pytest.mark.slow  # two more runs: the fast test above, broken on purpose, must fail
@pytest.mark.parametrize(
    ("sabotage", "failure"),
    [("swap", r"AssertionError: Scalars are not close"), ("no-reduce", r"AssertionError: embed\.weight")],
    ids=["swap", "no-reduce"],
)
def test_fsdp2_parity_check_fails_when_the_job_is_broken(sabotage, failure):
    """Swapped batches fail the loss check; an unreduced gradient fails the gradient check."""
    with pytest.raises(DistributedTestError, match=failure):
        run_distributed(_dp_parity, REPLICAS, "fsdp2", sabotage, timeout_s=300)
