"""Peers fail fast: in a 2-rank gloo deployed run, killing one rank makes the other raise in time.

The plan is made by the real planner for tiny-llama, TP=2, 2 microbatches of [2, 256] tokens, one
layer, fp32; its options are replaced (as tests/test_codegen.py does) so that every partition is
scheduled on an SM-limited communicator, which ``prepare_collectives`` creates with the
deployment's process-group timeout. Each rank runs under a simulated clock controller with a
state file. Both ranks run one deployed step; rank 1 then stops (stuck, as a hung rank would be)
while rank 0 starts the next step and blocks in its first collective; the test kills rank 1 with
SIGKILL.

What can fail: rank 0 hangs (the test bounds it), raises later than the timeout, raises something
other than PeerFailureError, or one that does not name its rank, the instruction and the
collective; rank 0's clock stays locked (it must restore it itself, before raising); rank 1's
clock stays locked after its SIGKILL (its guardian restores it).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback

import pytest
import torch
from conftest import TINY_TP2_WORKLOAD, train_microbatches
from dist_harness import PRELOAD, _free_port
from test_codegen import _scheduled_plan

WORKLOAD = TINY_TP2_WORKLOAD
TIMEOUT_S = 20.0
DEFAULT_MHZ = 1410


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory, tiny_tp2_plan_data):
    """The session's plan of WORKLOAD (conftest's ``tiny_tp2_plan_data``: the same request) with
    variants scheduled (``_scheduled_plan`` edits a copy)."""
    work = tmp_path_factory.mktemp("peer-plan")
    _scheduled_plan(tiny_tp2_plan_data, work / "plan.json")
    return work / "plan.json"


def _rank(rank: int, port: int, plan_path: str, tmp: str, sys_path: list[str], events, go) -> None:
    """One rank (module docstring); reports (rank, event, value) on ``events``; never returns normally."""
    sys.path.extend(p for p in sys_path if p not in sys.path)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    stacks = open(os.path.join(tmp, f"rank{rank}_stacks.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        import torch.distributed as dist

        from kareus_fx.deploy.deployment import prepare_collectives
        from kareus_fx.deploy.peer_failure import PeerFailureError
        from kareus_fx.models import ParallelLayout, build_model
        from kareus_fx.runtime.clock_backends import read_simulated_clock_state
        from kareus_fx.runtime.clock_controller import ClockController

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = build_model(
            WORKLOAD["model"],
            ParallelLayout.from_default_group(tp=2, cp=1),
            num_layers=WORKLOAD["layers"],
            dtype=torch.float32,
        )
        model.init_weights(seed=0)
        batches = [model.example_batch(mbs=WORKLOAD["mbs"], seq=WORKLOAD["seq"], seed=mb) for mb in range(2)]
        state_path = os.path.join(tmp, f"clock{rank}.json")
        controller = ClockController.open(
            "simulated",
            default_clock_mhz=DEFAULT_MHZ,
            state_path=state_path,
            lock_dir=os.path.join(tmp, "locks"),
            handle_sigterm=False,
        )
        prepare_collectives(plan_path, "max-throughput", [dist.group.WORLD], timeout_s=TIMEOUT_S)
        compiled = torch.compile(
            model, backend="kareus", fullgraph=True, options={"plan": plan_path, "clock_controller": controller}
        )
        train_microbatches(model, compiled, batches)
        events.put((rank, "stepped", os.getpid()))
        if rank == 1:
            time.sleep(600)  # stuck; killed by the test
        go.wait(300)
        events.put((rank, "stepping", None))
        try:
            train_microbatches(model, compiled, batches)
        except PeerFailureError as err:
            failed_unix_s = time.time()
            state = read_simulated_clock_state(state_path)
            events.put((rank, "failed", (failed_unix_s, str(err), state.locked, state.pid)))
        else:
            events.put((rank, "no error", None))
    except BaseException:  # noqa: BLE001 - reported to the test
        events.put((rank, "crashed", traceback.format_exc()))
    finally:
        events.close()
        events.join_thread()  # the queue's feeder thread has sent every event
        os._exit(0)  # no destroy_process_group: the peer is dead


def _expect(events, wanted: str, timeout_s: float) -> tuple[int, object]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rank, event, value = events.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {wanted!r} event within {timeout_s:.0f} s") from None
        assert event != "crashed", f"rank {rank} crashed:\n{value}"
        assert event == wanted, f"rank {rank}: expected {wanted!r}, got {event!r} ({value!r})"
        return rank, value


def test_killing_one_rank_makes_the_other_raise_within_the_timeout_with_its_clock_restored(plan_path, tmp_path):
    from kareus_fx.runtime.clock_backends import read_simulated_clock_state

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    events, go = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank, args=(r, port, str(plan_path), str(tmp_path), list(sys.path), events, go), daemon=True
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        pids = dict(_expect(events, "stepped", 600) for _ in range(2))  # compile + one deployed step
        assert read_simulated_clock_state(tmp_path / "clock1.json").locked  # rank 1 holds a planned clock
        go.set()
        assert _expect(events, "stepping", 60)[0] == 0
        time.sleep(0.5)  # rank 0 is now blocked in its first collective, waiting for rank 1
        os.kill(pids[1], signal.SIGKILL)
        killed_unix_s = time.time()
        try:
            rank, (failed_unix_s, message, locked, state_pid) = _expect(events, "failed", TIMEOUT_S + 30)
        except AssertionError as err:
            os.kill(pids[0], signal.SIGUSR1)
            time.sleep(1)
            raise AssertionError(
                f"rank 0 did not fail; its threads:\n{(tmp_path / 'rank0_stacks.txt').read_text()}"
            ) from err
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert rank == 0
    print(f"rank 0 raised {failed_unix_s - killed_unix_s:.3f} s after rank 1's SIGKILL (timeout {TIMEOUT_S:.0f} s)")
    assert failed_unix_s - killed_unix_s < TIMEOUT_S, message
    assert message.startswith("rank 0: collective ") and "of partition" in message and "over ranks [0, 1]" in message
    assert "while running F0@S0" in message and f"{TIMEOUT_S:.0f} s process-group timeout" in message
    assert "restored its GPU clock" in message
    assert (locked, state_pid) == (False, pids[0])  # rank 0 restored its clock itself, before raising
    deadline = time.monotonic() + 5
    while read_simulated_clock_state(tmp_path / "clock1.json").locked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not read_simulated_clock_state(tmp_path / "clock1.json").locked  # rank 1's guardian restored it


def _hung_peer_worker(rank, world_size, timeout_s):
    """Rank 1 answers the collective on the SM-limited communicator only after rank 0's timeout."""
    import torch.distributed as dist

    from kareus_fx.deploy.peer_failure import is_collective_failure
    from kareus_fx.runtime.collectives import backends_for, prepare_comm_groups

    prepare_comm_groups([4], [dist.group.WORLD], timeout_s=timeout_s)
    group = backends_for(dist.group.WORLD).group_for(4)
    if rank == 1:
        time.sleep(2 * timeout_s)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
        outcome = None
    except RuntimeError as err:
        outcome = (is_collective_failure(err), str(err).splitlines()[0])
    return time.monotonic() - start, outcome


def test_a_hung_peer_fails_the_collective_within_the_deployments_timeout():
    """The timeout given to prepare_comm_groups is the SM-limited communicator's: rank 0's
    collective fails after it (not after gloo's 30 min default), as a recognised backend failure."""
    from dist_harness import run_distributed

    timeout_s = 3.0
    (waited_s, outcome), _ = run_distributed(_hung_peer_worker, 2, timeout_s, timeout_s=120)
    assert outcome is not None and outcome[0], outcome
    assert timeout_s * 0.9 <= waited_s < timeout_s + 5, waited_s
