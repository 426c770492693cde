"""bench/collective_contention.py runs end to end on gloo (2 CPU ranks under torchrun): the CSV
has every case with consistent columns. CPU wall times check the script, not contention."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "collective_contention.py"


def test_two_gloo_ranks_write_every_case(tmp_path):
    out = tmp_path / "contention.csv"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    cmd += ["--out", str(out), "--sizes-mb", "0.25", "--tokens", "64", "--repeats", "2"]
    subprocess.run(cmd, check=True, cwd=tmp_path, timeout=240, capture_output=True)
    rows = list(csv.DictReader(out.open()))
    assert [(r["case"], int(r["width"])) for r in rows] == [("alone", 0), ("gemm", 768), ("gemm", 512), ("norm", 2048)]
    for r in rows:
        assert r["backend"] == "gloo" and int(r["world_size"]) == 2 and int(r["bytes"]) == 2**18
        assert float(r["collective_s"]) > 0 and float(r["collective_alone_s"]) > 0
        ratio = float(r["collective_s"]) / float(r["collective_alone_s"])
        assert abs(float(r["slowdown"]) - ratio) <= 1e-3 * ratio  # the file's rounding
    for r in rows[1:]:
        assert int(r["tokens"]) == 64 and float(r["kernels_s"]) > 0 and float(r["kernels_alone_s"]) > 0


def test_without_torchrun_it_says_how_to_run(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.csv")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "torchrun" in done.stderr
