"""``kareus plan --nproc N``: start N processes on this machine as torchrun would, and wait for them.

Each process runs the same ``kareus plan`` command line (without ``--nproc``) with torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT`` a free port). Rank 0's output is this command's; the others' standard output is
dropped (they write no plan), their errors are shown. When a process fails, the others get
``grace_s`` to report their own error (a peer that lost it raises a typed error at once), then
are terminated; the exit status is the first failure's. For several machines use torchrun.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from kareus_fx.errors import OptionsError

__all__ = ["launch", "without_nproc"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--nproc N`` (or ``--nproc=N``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def launch(nproc: int, argv: Sequence[str], grace_s: float = 10.0) -> int:
    """Run ``python -m kareus_fx.cli *argv`` in ``nproc`` processes (module docstring); the exit status."""
    if nproc < 1:
        raise OptionsError(f"--nproc must be a positive integer, got {nproc}")
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        if os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "kareus_fx.cli", *argv],
                env=env,
                stdout=None if rank == 0 else subprocess.DEVNULL,
            )
        )
    failure: int | None = None
    deadline_s = float("inf")
    try:
        while any(p.poll() is None for p in procs):
            for p in procs:
                if failure is None and p.returncode not in (None, 0):
                    failure, deadline_s = p.returncode, time.monotonic() + grace_s
            if time.monotonic() > deadline_s:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if failure is None:
        failure = next((p.returncode for p in procs if p.returncode), 0)
    return failure
