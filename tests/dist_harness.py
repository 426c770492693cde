"""Run a function in N gloo processes on CPU, for tests.

    from dist_harness import run_distributed

    def check(rank, world_size, scale):     # module-level, so spawned processes can import it
        ...                                  # torch.distributed is initialised (gloo) here

    results = run_distributed(check, 2, 3.0)  # [rank 0's return value, rank 1's]

Each rank is a process forked from a ``forkserver`` (a clean interpreter with torch imported; no
state is inherited from the test process; ``fn`` and ``args`` travel pickled), with
``init_process_group("gloo")`` on a free localhost port before ``fn`` and
``destroy_process_group()`` after it. An exception on any rank stops the others and is re-raised
in the parent as :class:`DistributedTestError` carrying that rank's traceback; a run that exceeds
``timeout_s`` is killed and raises :class:`TimeoutError`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# Imported once by the forkserver, which forks every rank of every run: after the first run of
# a session a rank starts in well under a second instead of importing torch afresh. Beyond torch:
# what a rank compiling with ``backend="kareus"`` imports (Inductor, the backend with its SciPy,
# scikit-learn and Zeus, compile-time tuning) and the Hugging Face models the tests build
# (transformers' lazy imports: about 10 CPU seconds per rank under load). Only imports: each rank
# still compiles, tunes and deploys everything itself. A module that is not installed is skipped.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "kareus_fx.capture.backend",
    "kareus_fx.plan.live_tuning",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
]


class DistributedTestError(RuntimeError):
    """A rank of :func:`run_distributed` raised; the message holds its traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stays_empty(results, wait_s: float = 2.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not results.empty():
            return False
        time.sleep(0.05)
    return True


def _failure_report(rank: int, tb: str, world_size: int, results, wait_s: float = 2.0) -> str:
    """Every rank's traceback that arrives within ``wait_s``: the first to arrive is not always
    the cause (a peer's collective may fail first on the broken connection)."""
    failures = [(rank, tb)]
    deadline = time.monotonic() + wait_s
    while len(failures) < world_size and time.monotonic() < deadline:
        try:
            other, ok, value = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if not ok:
            failures.append((other, value))
    return "\n".join(f"rank {r} of {world_size} failed:\n{t}" for r, t in failures)


def _worker(rank: int, world_size: int, port: int, call: bytes, sys_path: list[str], results) -> None:
    import torch.distributed as dist

    # The forkserver has the sys.path of the process that started it; fn's module may need ours.
    sys.path.extend(p for p in sys_path if p not in sys.path)

    if os.path.exists("/sys/class/net/lo"):  # gloo on loopback: no hostname lookup
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
        try:
            fn, args = pickle.loads(call)
            value = fn(rank, world_size, *args)
            dist.barrier()  # no rank tears down while a peer still uses the group
        finally:
            dist.destroy_process_group()
        # Pickle here: the queue pickles in a feeder thread that would drop an unpicklable
        # value with nothing but a message on stderr.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn``, ``args`` and the return values must be picklable (``fn`` defined at module level
    of an importable module). ``timeout_s`` catches a hang, not a slow run: the default leaves room
    for compiling ranks that share 2 cores with another test worker (``pytest -n``); a test of a
    deadline passes its own.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    call = pickle.dumps((fn, args))
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, call, list(sys.path), results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.1)
            except queue.Empty:
                # A rank that ended without a report crashed (segfault, os._exit, killed);
                # a report sent just before a clean exit may still be in transit, so wait a bit.
                ended = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
                if ended and _stays_empty(results):
                    p = procs[ended[0]]
                    raise DistributedTestError(
                        f"{p.name} exited with code {p.exitcode} without reporting a result"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise TimeoutError(
                        f"run_distributed({fn.__name__}): ranks {missing} still running after {timeout_s:.0f} s"
                    ) from None
                continue
            if not ok:
                raise DistributedTestError(_failure_report(rank, value, world_size, results))
            values[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world_size)]
