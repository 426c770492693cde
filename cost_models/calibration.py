"""Fit the simulator's free parameters to the calibration data; write ``data/calibrated_params.json``.

Run ``python -m kareus_fx.cost_models.calibration`` (about a minute on one idle CPU core; with
``--end-to-end`` about half an hour on 2 cores). It reads only the
copies under ``data/calibration/`` (see ``SOURCES.md`` there); nothing here reads validation data.

Steps, each recorded with its data file and fit error in the output's provenance:

1. Memory-bound kernels (NanoFlow, A100-80GB): per-SM HBM bandwidth, saturation and knee of the
   bandwidth-vs-SMs curve, from the steady-state (longest) kernels.
2. Collectives (NanoFlow, NCCL on 8xA100): the knee of the bus-bandwidth-vs-SMs curve from the
   reduce-scatter runs with 8/16/32 CTAs and the all-gather / reduce-scatter per-SM rate ratio.
   The all-to-all's kind factor is the all-gather's (pure data movement); its lanes are step 7's.
   2b. A collective's contention beside a compute-bound kernel (NanoFlow's network kernel beside a
   GEMM, ``network_interference.csv``): ``comm_contention_compute``.
3. Partition timing (Kareus attention overlap, 2xA100 TP=2, clocks unlocked = max clock unless
   the power cap binds): GEMM efficiency, kernel launch gap, the all-reduce's per-SM rate, cap,
   latency and its HBM-contention coefficient beside memory-bound kernels, plus two terms of that measurement script, not of
   the GPU: the 512-thread CTA rate factor and the host work at the end of each iteration during
   which the collective may still run (windows that end at the last op hide the collective under
   it). The collective's HBM bytes per bus byte and HBM share weight are priors: they trade off
   against each other and against the contention coefficient in this data.
4. Power and clock (Kareus partition energies + Perseus GPT-3 A100 power and time vs clock):
   busy, SM-active and per-FLOP power coefficients, the voltage curve (floor and knee) and the
   per-SM rate's clock exponent. Per-byte energies are priors (every Kareus row moves the same
   bytes, so they are not identifiable there).
5. A40 (Perseus GPT-3 A40 profile): the A100 parameters carried over by spec ratios, then the
   power scale, voltage curve and throttle swing (``SimParams.throttle_swing_mhz``) fitted to its
   power and time ratios, its 300 W cap binding above about 1,455 MHz. The A100 takes the A40's
   swing (its own data never throttle across a clock sweep).

The Perseus profiles are GPT-3 175B stages per GPU (TP=8, microbatch 1, sequence 2048) with the
HuggingFace-style unfused attention of the Merak-based runs that produced them
(:func:`~kareus_fx.cost_models.analytic_workloads.transformer_stage_ops`).

6. End to end (``end_to_end_fit.py``, ``--end-to-end``): the contention coefficients the micro data
   leave unidentified, fitted to the paper's Llama 3.2 3B rows by planning each row; steps 3-5 are
   then fitted again with them held. Without ``--end-to-end`` the last fit's values are held (read
   from the packaged parameters' provenance), so a plain run reproduces the file in about a minute;
   ``--micro-only`` leaves the micro fits' own values.
7. All-to-all (DeepEP's dispatch and combine on H800, ``all_to_all_fit.py``): the NVLink and network
   lane efficiencies and the all-to-all's latency, on the final parameters of steps 1-6 (the
   NVLink lane's per-SM rate is step 3's), given to the A100 and the A40 alike.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares, minimize, nnls

from kareus_fx.cost_models.all_to_all_fit import FIELDS as ALL_TO_ALL_FIELDS
from kareus_fx.cost_models.all_to_all_fit import fit_all_to_all
from kareus_fx.cost_models.analytic_workloads import GPT3_175B, kareus_attention_tp2, transformer_stage_ops
from kareus_fx.cost_models.end_to_end_fit import calibration_rows_loss, fit_end_to_end, with_values
from kareus_fx.cost_models.hardware import GPUSpec, gpu_spec
from kareus_fx.cost_models.kernel_model import smooth_min
from kareus_fx.cost_models.sim_params import PARAMS_RESOURCE, SimParams, derive_params
from kareus_fx.cost_models.simulator import Prediction, Simulator
from kareus_fx.workload import OpCost, PartitionConfig

DATA = "data/calibration"
A100 = "A100-SXM4-40GB"
A100_80 = "A100-SXM4-80GB"
KAREUS_FILE = "kareus_attention_overlap_a100/unlocked_clock.csv"
NANOFLOW_MEM_FILE = "nanoflow_a100/memory_bound_kernel_vs_blocks.csv"
NANOFLOW_COLL = "nanoflow_a100/collectives/{kind}_{blocks}_blocks.csv"
PERSEUS_A100_FILE = "perseus_a100_sxm/gpt3-175b_stage_profile.csv"
PERSEUS_A40_FILE = "perseus_a40/gpt3-175b_stage_profile.csv"

# Facts with sources (data/calibration/SOURCES.md).
A100_BLOCKING_POWER_W = 83.64
A40_BLOCKING_POWER_W = 70.38
# The Perseus A100 board averaged 473-480 W at 1410 MHz, which a 400 W cap forbids: its cap was
# higher (A100 SXM4 80GB boards ship with 400 W and 500 W limits). Inferred, used only for that board.
PERSEUS_A100_TDP_W = 500.0
PERSEUS_STAGES = (0, 7)  # stages 1-6 are identical to stage 0 in the profiles

A40_SPEC = GPUSpec(
    name="A40",
    sm_count=84,
    clock_min_mhz=210,
    clock_max_mhz=1740,
    clock_step_mhz=15,
    tuning_clock_min_mhz=900,
    peak_clock_mhz=1740,
    hbm_bandwidth_bytes_per_s=695.8e9,
    bf16_peak_flops_per_s=149.7e12,
    tdp_w=300.0,
    static_power_w=A40_BLOCKING_POWER_W,
    blocking_power_w=A40_BLOCKING_POWER_W,
    nvlink_bandwidth_bytes_per_s=56.25e9,
    sources={
        "sm_count": "gpu.spicedreamphone.com/en/gpu/nvidia/a40-pcie (84 SMs, GA102)",
        "clock_max_mhz": "same page: boost clock 1740 MHz; Perseus A40 profile spans 855-1740 MHz",
        "clock_step_mhz": "15 MHz grid of the Perseus A40 stage profile",
        "clock_min_mhz": "unverified: assumed 210 MHz like other Ampere boards",
        "hbm_bandwidth_bytes_per_s": "same page: 695.8 GB/s GDDR6 (384-bit, 14.5 Gbps)",
        "bf16_peak_flops_per_s": "hmc-tech.com/gpu/nvidia-a100-vs-nvidia-a40: BF16 149.67 TFLOPS tensor (dense)",
        "tdp_w": "same pages: 300 W; NVIDIA A40 product brief (relationship-nepal.org/900-2g133-0000-000.html)",
        "static_power_w": "Perseus artifact blocking power 70.38 W (ml-energy/zeus@38cb3f90 evaluation notebook); "
        "no P0 ready-state figure found (idle out of P0 is about 30 W, NVIDIA/open-gpu-kernel-modules#874)",
        "nvlink_bandwidth_bytes_per_s": "NVLink bridge 112.5 GB/s bidirectional (A40 product brief), per direction",
        "tuning_clock_min_mhz": "assumed like A100 (Kareus appendix B floor)",
    },
)


# ----- data loading -------------------------------------------------------------------------------


def _read_lines(rel: str) -> list[str]:
    return resources.files("kareus_fx.cost_models").joinpath(f"{DATA}/{rel}").read_text().splitlines()


def _read_csv(rel: str) -> list[dict[str, str]]:
    return list(csv.DictReader(_read_lines(rel)))


@dataclass(frozen=True)
class OverlapRow:
    """One row of the Kareus overlap data: window, SMs, CTA size; mean time and per-GPU energy."""

    start: int
    end: int
    sms: int
    block: int
    time_s: float
    energy_j: float


def parse_overlap(lines: Iterable[str], gpus: int = 2) -> list[OverlapRow]:
    """Rows of a Kareus ``energy_results.csv``: repeats averaged, energy divided over the GPUs."""
    rows = []
    for r in csv.DictReader(lines):
        times = [float(r[f"{i}:time (s)"]) for i in range(3) if r.get(f"{i}:time (s)")]
        energies = [float(r[f"{i}:total energy (J)"]) for i in range(3) if r.get(f"{i}:total energy (J)")]
        rows.append(
            OverlapRow(
                int(r["overlap_start"]),
                int(r["overlap_end"]),
                int(r["comm_sm_number"]),
                int(r["comm_block_size"]),
                float(np.mean(times)),
                float(np.mean(energies)) / gpus,
            )
        )
    return rows


def parse_stage_profile(lines: Iterable[str]) -> dict[tuple[int, str, int], tuple[float, float]]:
    """Perseus stage profile: (stage, instruction, MHz) -> (time, energy) as stored."""
    return {
        (int(r["stage"]), r["instruction"], int(r["frequency"])): (float(r["time"]), float(r["energy"]))
        for r in csv.DictReader(lines)
    }


def load_overlap() -> list[OverlapRow]:
    """The calibration copy of the Kareus unlocked-clock overlap data."""
    return parse_overlap(_read_lines(KAREUS_FILE))


def load_stage_profile(rel: str) -> dict[tuple[int, str, int], tuple[float, float]]:
    return parse_stage_profile(_read_lines(rel))


# ----- the harness of the Kareus overlap measurements --------------------------------------------
@dataclass(frozen=True)
class OverlapHarness:
    """How the Kareus measurement script differs from the runtime the simulator models."""

    block512_rate_factor: float
    """Per-SM rate of 512-thread CTAs relative to 1024-thread ones."""
    tail_s: float
    """Host work at the end of each iteration; the collective may still run meanwhile."""


def predict_overlap_row(
    sim: Simulator, row: OverlapRow, harness: OverlapHarness, clock_mhz: float, ptype=None, timeline: bool = False
) -> Prediction:
    """The simulator's prediction of one Kareus overlap measurement.

    Window (-1, -1) is sequential: the script runs the all-reduce first, waits, then the seven ops.
    Window (s, e) launches the all-reduce before op s and makes op e+1 wait for it (none when e is
    the last op).
    """
    ptype = ptype if ptype is not None else _KAREUS_PTYPE
    n_slots = len(ptype.slots)
    scale = harness.block512_rate_factor if row.block == 512 else 1.0
    join: int | None
    if row.start < 0:
        launch, join = 0, 0
    else:
        launch, join = row.start, (row.end + 1 if row.end + 1 < n_slots else None)
    return sim.predict(
        ptype,
        PartitionConfig(int(clock_mhz), row.sms, launch),
        join_slot=join,
        comm_rate_scale=scale,
        tail_s=harness.tail_s,
        timeline=timeline,
    )


_KAREUS_PTYPE = kareus_attention_tp2()


# ----- step 1: memory-bound kernels ----------------------------------------------------------------
def fit_memory_curve(prior: SimParams) -> tuple[dict[str, float], dict[str, Any]]:
    spec = gpu_spec(A100_80)
    rows = list(_read_csv(NANOFLOW_MEM_FILE))
    longest = max(int(r["seqlen"]) for r in rows)
    data: dict[int, list[float]] = {}
    for r in rows:
        if int(r["seqlen"]) == longest:
            data.setdefault(int(r["blocks"]), []).append(float(r["BW"]))
    blocks = np.array(sorted(data), dtype=float)
    bw = np.array([np.mean(data[int(b)]) for b in blocks])

    def model(z: np.ndarray) -> np.ndarray:
        per_sm, eff, knee = z
        return np.array([smooth_min(per_sm * b, eff * spec.hbm_bandwidth_bytes_per_s, knee) for b in blocks])

    z0 = np.array([prior.mem_bw_per_sm_bytes_per_s, prior.mem_bw_efficiency, prior.mem_knee])
    sol = least_squares(
        lambda z: np.log(model(z)) - np.log(bw), z0, x_scale=z0, bounds=([1e9, 0.3, 0.5], [200e9, 1.0, 20.0])
    )
    err = model(sol.x) / bw - 1
    values = {
        "mem_bw_per_sm_bytes_per_s": float(sol.x[0]),
        "mem_bw_efficiency": float(sol.x[1]),
        "mem_knee": float(sol.x[2]),
    }
    prov = {
        "file": NANOFLOW_MEM_FILE,
        "rows": f"seqlen={longest} (steady state), blocks 4-108",
        "points": len(blocks),
        "mape": _mape(err),
        "max_abs_rel_error": float(np.max(np.abs(err))),
    }
    return values, prov


# ----- step 2: collective curve shape --------------------------------------------------------------
def fit_collective_shape(prior: SimParams) -> tuple[dict[str, float], dict[str, Any]]:
    """Per file: latency + bus bytes / bandwidth over all sizes; then the knee of bandwidth vs CTAs."""
    group = 8
    per_file = {}
    for kind, blocks in (("reduce_scatter", 8), ("reduce_scatter", 16), ("reduce_scatter", 32), ("all_gather", 8)):
        rows = _read_csv(NANOFLOW_COLL.format(kind=kind, blocks=blocks))
        size = np.array([float(r["size"]) for r in rows])
        t = np.array([float(r["avg_time"]) for r in rows]) * 1e-6
        bus = size * (group - 1) / group
        a = np.vstack([np.ones_like(bus), bus]).T
        (lat, inv_bw), *_ = np.linalg.lstsq(a, t, rcond=None)
        per_file[(kind, blocks)] = (max(lat, 0.0), 1.0 / inv_bw)
    ctas = np.array([8.0, 16.0, 32.0])
    bws = np.array([per_file[("reduce_scatter", int(b))][1] for b in ctas])

    def model(z: np.ndarray) -> np.ndarray:
        per_sm, cap, knee = z
        return np.array([smooth_min(per_sm * b, cap, knee) for b in ctas])

    z0 = np.array([bws[0] / 8, bws[-1] * 1.2, prior.comm_knee])
    sol = least_squares(
        lambda z: np.log(model(z)) - np.log(bws), z0, x_scale=z0, bounds=([1e8, 1e9, 0.5], [1e11, 1e12, 20.0])
    )
    err = model(sol.x) / bws - 1
    rs8, ag8 = per_file[("reduce_scatter", 8)][1], per_file[("all_gather", 8)][1]
    # An all-reduce is a reduce-scatter then an all-gather of the same bus bytes: its per-SM rate is
    # the harmonic mean of theirs. Kind factors are relative to the all-reduce's rate.
    ar8 = 2.0 / (1.0 / rs8 + 1.0 / ag8)
    values = {
        "comm_knee": float(sol.x[2]),
        "nccl_bus_bw_per_cta_bytes_per_s": float(sol.x[0]),
        "nccl_bus_bw_cap_bytes_per_s": float(sol.x[1]),
        "comm_factor_reduce_scatter": float(rs8 / ar8),
        "comm_factor_all_gather": float(ag8 / ar8),
        "comm_factor_all_to_all": float(ag8 / ar8),
    }
    prov = {
        "files": [NANOFLOW_COLL.format(kind=k, blocks=b) for k, b in per_file],
        "method": "per file: time = latency + bus bytes / bandwidth over 8-32 MiB; knee: smooth min of "
        "per-CTA rate x CTAs and a cap through the 8/16/32-CTA reduce-scatter bandwidths",
        "bus_bandwidth_GBps": {f"{k}_{b}": round(v[1] / 1e9, 1) for (k, b), v in per_file.items()},
        "knee_fit_max_abs_rel_error": float(np.max(np.abs(err))),
        "nccl_reduce_scatter_curve": {"per_cta_bytes_per_s": float(sol.x[0]), "cap_bytes_per_s": float(sol.x[1])},
        "all_to_all": "per-SM rate assumed like all-gather's (pure data movement); lane caps and latency: step 7",
    }
    return values, prov


# ----- step 2b: a collective's contention beside a compute-bound kernel ----------------------------
NANOFLOW_NET_FILE = "nanoflow_a100/network_interference.csv"
NANOFLOW_GEMM_MKN = (2048, 8192, 3584)
"""Assumed shape of NanoFlow's GEMM (its interference runs do not record it): a dense batch of 2048
tokens through a LLaMA-2-70B TP8 MLP projection (hidden 8192, 28672 / 8 columns), BF16."""


def fit_compute_contention(params: SimParams, coll_prov: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """``comm_contention_compute`` from NanoFlow's network kernel beside a GEMM.

    In each row the network kernel gets a share R of the SMs and the GEMM the rest; P is the network
    kernel's speed relative to running alone on the whole GPU. Alone on R of the SMs it would reach
    ``curve(R) / curve(all)`` (NanoFlow's NCCL bandwidth-vs-CTAs curve from step 2), so the slowdown
    the GEMM causes is ``S = curve(R) / curve(all) / P``; the simulator's is ``1 + kappa * u`` with
    ``u`` the GEMM's HBM utilisation on the other SMs. Least squares on ``S - 1`` over the rows.
    """
    spec = gpu_spec(A100_80)
    sim = Simulator(spec, params)
    curve = coll_prov["nccl_reduce_scatter_curve"]

    def nccl_bw(ctas: float) -> float:
        return smooth_min(curve["per_cta_bytes_per_s"] * ctas, curve["cap_bytes_per_s"], params.comm_knee)

    m, k, n = NANOFLOW_GEMM_MKN
    flops, nbytes = 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n)
    shares, slowdowns, utils = [], [], []
    for r in _read_csv(NANOFLOW_NET_FILE):
        share, perf = float(r["R"]), float(r["P"])
        ctas = max(1, round(share * spec.sm_count))
        alone = nccl_bw(ctas) / nccl_bw(spec.sm_count)
        gemm = sim.kernels.kernel(flops, nbytes, spec.sm_count - ctas, spec.clock_max_mhz)
        shares.append(share)
        slowdowns.append(alone / perf)
        utils.append(gemm.hbm_bytes_per_s / sim.kernels.hbm_saturation_bytes_per_s)
    u, excess = np.array(utils), np.array(slowdowns) - 1.0
    kappa = float(max(0.0, np.dot(u, excess) / np.dot(u, u)))
    err = (1.0 + kappa * u) / np.array(slowdowns) - 1.0
    prov = {
        "file": NANOFLOW_NET_FILE,
        "gemm_mkn_assumed": list(NANOFLOW_GEMM_MKN),
        "method": "slowdown S = NCCL curve(R) / curve(all) / P; least squares of S - 1 = kappa * GEMM HBM utilisation",
        "rows": [
            {"R": sh, "slowdown": round(sl, 3), "gemm_hbm_util": round(ut, 3), "simulated": round(1 + kappa * ut, 3)}
            for sh, sl, ut in zip(shares, slowdowns, utils)
        ],
        "max_abs_rel_error": float(np.max(np.abs(err))),
    }
    return {"comm_contention_compute": kappa}, prov


# ----- step 3: partition timing --------------------------------------------------------------------
_TIME_FIT = (
    "gemm_efficiency",
    "kernel_overhead_s",
    "comm_bus_bw_per_sm_bytes_per_s",
    "comm_bus_bw_cap_bytes_per_s",
    "comm_latency_s",
    "comm_contention",
)
_TIME_BOUNDS = {
    "gemm_efficiency": (0.2, 1.0),
    "kernel_overhead_s": (0.0, 200e-6),
    "comm_bus_bw_per_sm_bytes_per_s": (0.5e9, 50e9),
    "comm_bus_bw_cap_bytes_per_s": (10e9, 600e9),
    "comm_latency_s": (0.0, 1e-3),
    "comm_contention": (0.0, 20.0),
}
_HARNESS_BOUNDS = {"block512_rate_factor": (0.2, 1.5), "tail_s": (0.0, 3e-3)}


def _overlap_energy_mape(
    params: SimParams, harness: OverlapHarness, rows: Sequence[OverlapRow], spec: GPUSpec
) -> float:
    """Mean absolute relative error of the Kareus overlap rows' energy at the unlocked clock."""
    predictions = _overlap_predictions(params, harness, rows, spec)
    return _mape(np.array([q.measurement.energy_j / r.energy_j - 1 for q, r in zip(predictions, rows)]))


def _overlap_predictions(
    params: SimParams, harness: OverlapHarness, rows: Sequence[OverlapRow], spec: GPUSpec
) -> list[Prediction]:
    """Predictions at the unlocked clock: the max clock, throttled by the simulator if over the cap."""
    sim = Simulator(spec, params)
    return [predict_overlap_row(sim, r, harness, spec.clock_max_mhz) for r in rows]


def _with_fitted(params: SimParams, fitted: Mapping[str, float]) -> SimParams:
    """``params`` with the fitted float fields in ``fitted`` replaced."""
    values: dict[str, Any] = dict(fitted)  # mypy would check a **dict's float values against every field, ints too
    return replace(params, **values)


def fit_partition_timing(
    params: SimParams,
    rows: Sequence[OverlapRow],
    harness0: OverlapHarness,
    spec: GPUSpec,
    power_capped: bool = False,
    held: Collection[str] = (),
) -> tuple[SimParams, OverlapHarness, dict[str, Any]]:
    """Timing parameters and harness terms on log time. Without ``power_capped`` no power cap applies
    (the power coefficients are not fitted yet); with it, phases throttle at the spec's TDP. Fields
    in ``held`` keep ``params``' values (the end-to-end step fits them)."""
    time_fit = [n for n in _TIME_FIT if n not in held]
    names = time_fit + list(_HARNESS_BOUNDS)
    x0 = np.array([getattr(params, n) for n in time_fit] + [getattr(harness0, n) for n in _HARNESS_BOUNDS])
    scale = np.where(x0 > 0, x0, 1e-6)
    lo = np.array([({**_TIME_BOUNDS, **_HARNESS_BOUNDS})[n][0] for n in names]) / scale
    hi = np.array([({**_TIME_BOUNDS, **_HARNESS_BOUNDS})[n][1] for n in names]) / scale
    measured = np.array([r.time_s for r in rows])
    free_spec = spec if power_capped else replace(spec, tdp_w=1e9)

    def unpack(z: np.ndarray) -> tuple[SimParams, OverlapHarness]:
        x = z * scale
        p = _with_fitted(params, dict(zip(time_fit, map(float, x[: len(time_fit)]))))
        h = OverlapHarness(*map(float, x[len(time_fit) :]))
        return p, h

    def residuals(z: np.ndarray) -> np.ndarray:
        p, h = unpack(z)
        pred = np.array([q.measurement.time_s for q in _overlap_predictions(p, h, rows, free_spec)])
        return np.log(pred) - np.log(measured)

    z0 = np.clip(np.ones_like(x0), lo + 1e-9, hi - 1e-9)
    sol = least_squares(residuals, z0, bounds=(lo, hi), diff_step=1e-3, x_scale=1.0)
    fitted, harness = unpack(sol.x)
    err = np.exp(residuals(sol.x)) - 1
    prov = {
        "file": KAREUS_FILE,
        "points": len(rows),
        "fitted": names,
        "clock": "unlocked = max clock unless the power cap binds",
        "power_capped": power_capped,
        "time_mape": _mape(err),
        "time_max_abs_rel_error": float(np.max(np.abs(err))),
        "workload": "analytic_workloads.kareus_attention_tp2 (7 slots, 32 MiB all-reduce, TP=2)",
    }
    return fitted, harness, prov


# ----- steps 4-6: frequency and power ---------------------------------------------------------------
@dataclass(frozen=True)
class StageSeries:
    """One pipeline stage's forward or backward kernels on one GPU."""

    stage: int
    instruction: str
    ops: tuple[OpCost, ...]


def gpt3_stage_series(stages: Sequence[int] = PERSEUS_STAGES) -> list[StageSeries]:
    """Per-GPU compute of GPT-3 175B pipeline stages (TP=8, microbatch 1, sequence 2048)."""
    out = []
    for stage in stages:
        for instruction in ("forward", "backward"):
            ops, _ = transformer_stage_ops(GPT3_175B, stage, backward=instruction == "backward")
            out.append(StageSeries(stage, instruction, tuple(ops)))
    return out


def stage_predictions(sim: Simulator, series: Sequence[StageSeries], clocks: Sequence[int]) -> dict:
    """(stage, instruction, MHz) -> Prediction of each series at each clock."""
    return {(s.stage, s.instruction, f): sim.predict_sequence(s.ops, (), f) for s in series for f in clocks}


def ratio_errors(pred: dict, measured: dict, fmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Relative errors of time and power, each relative to its value at the max clock."""
    t_err, p_err = [], []
    for (stage, ins, f), q in pred.items():
        t_meas, e_meas = measured[(stage, ins, f)]
        t0_meas, e0_meas = measured[(stage, ins, fmax)]
        q0 = pred[(stage, ins, fmax)]
        m, m0 = q.measurement, q0.measurement
        t_ratio = m.time_s / m0.time_s
        p_ratio = (m.energy_j / m.time_s) / (m0.energy_j / m0.time_s)
        t_err.append(t_ratio / (t_meas / t0_meas) - 1)
        p_err.append(p_ratio / ((e_meas / t_meas) / (e0_meas / t0_meas)) - 1)
    return np.array(t_err), np.array(p_err)


_POWER_COEFFS = ("busy_power_w", "sm_active_power_w", "comm_sm_active_power_w", "flop_energy_j")
# Per-byte energies are priors (SimParams defaults), not fits: every Kareus row moves the same
# bytes, so they would act as a free constant there. GDDR6 costs about twice HBM2 per bit.
GDDR6_ENERGY_FACTOR = 2.0
_POWER_SHAPE = ("voltage_floor", "voltage_knee_frac", "per_sm_clock_exponent")


def fit_power_and_clock(
    params: SimParams,
    rows: Sequence[OverlapRow],
    harness: OverlapHarness,
    spec: GPUSpec,
    perseus: dict,
    perseus_spec: GPUSpec,
    log: Callable[[str], None] = print,
) -> tuple[SimParams, dict[str, Any]]:
    """Power coefficients, voltage curve and the per-SM clock exponent.

    For a given (voltage floor, knee, clock exponent) the three fitted power coefficients are a
    non-negative linear least-squares fit of the Kareus energies and the Perseus A100 power
    (relative errors, each data set weighted equally). Nelder-Mead searches the three shape values
    on the sum of mean squared relative errors of Kareus energy, Perseus power and Perseus time
    relative to 1410 MHz. Neither data set is power-capped (at most 350 W average on a 400 W board;
    at most 480 W on the Perseus board), which the final check confirms.
    """
    series = gpt3_stage_series()
    clocks = sorted({f for (_, _, f) in perseus})
    keys = [(s.stage, s.instruction, f) for s in series for f in clocks]
    e_meas = np.array([r.energy_j for r in rows])
    p_meas = np.array([perseus[k][1] / perseus[k][0] for k in keys])
    hbm, link = params.hbm_energy_j_per_byte, params.link_energy_j_per_byte
    free, free_perseus = replace(spec, tdp_w=1e9), replace(perseus_spec, tdp_w=1e9)
    wa, wb = 1.0 / math.sqrt(len(e_meas)), 1.0 / math.sqrt(len(p_meas))

    def solve(z: np.ndarray) -> tuple[SimParams, float, dict[str, float]]:
        vf, knee, gamma = map(float, z)
        p = replace(params, voltage_floor=vf, voltage_knee_frac=knee, per_sm_clock_exponent=gamma)
        overlap = _overlap_predictions(p, harness, rows, free)
        stage = stage_predictions(Simulator(free_perseus, p), series, clocks)
        ta = np.array([q.terms.time_s for q in overlap])
        xa = np.array([q.terms.fitted_features() for q in overlap])
        fixed_a = spec.static_power_w * ta + np.array(
            [hbm * q.terms.hbm_bytes + link * q.terms.link_bytes for q in overlap]
        )
        tb = np.array([stage[k].terms.time_s for k in keys])
        xb = np.array([stage[k].terms.fitted_features() for k in keys]) / tb[:, None]
        fixed_b = (
            perseus_spec.static_power_w
            + np.array([hbm * stage[k].terms.hbm_bytes + link * stage[k].terms.link_bytes for k in keys]) / tb
        )
        a = np.vstack([xa / e_meas[:, None] * wa, xb / p_meas[:, None] * wb])
        b = np.concatenate([(e_meas - fixed_a) / e_meas * wa, (p_meas - fixed_b) / p_meas * wb])
        scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
        c = nnls(a / scale, b)[0] / scale
        ea = (fixed_a + xa @ c) / e_meas - 1
        eb = (fixed_b + xb @ c) / p_meas - 1
        et, _ = ratio_errors(stage, perseus, perseus_spec.clock_max_mhz)
        score = float(np.mean(ea**2) + np.mean(eb**2) + np.mean(et**2))
        fitted = _with_fitted(p, dict(zip(_POWER_COEFFS, map(float, c))))
        return (
            fitted,
            score,
            {"overlap_energy_mape": _mape(ea), "perseus_power_mape": _mape(eb), "perseus_time_ratio_mape": _mape(et)},
        )

    lo, hi = np.array([0.5, 0.4, 0.0]), np.array([1.0, 0.98, 1.0])
    memo: dict[tuple, float] = {}

    def objective(z: np.ndarray) -> float:
        z = np.clip(z, lo, hi)
        key = tuple(np.round(z, 5))
        if key not in memo:
            memo[key] = solve(z)[1]
        return memo[key]

    z0 = np.array([params.voltage_floor, params.voltage_knee_frac, params.per_sm_clock_exponent])
    simplex = np.array([z0, z0 + [0.1, 0, 0], z0 + [0, 0.1, 0], z0 + [0, 0, 0.3]])
    result = minimize(
        objective,
        z0,
        method="Nelder-Mead",
        options={"xatol": 1e-3, "fatol": 1e-7, "maxfev": 120, "initial_simplex": simplex},
    )
    fitted, score, errors = solve(np.clip(result.x, lo, hi))
    log(f"    Nelder-Mead: {result.nfev} evaluations, score {score:.5f}")
    # With the fitted coefficients and the real caps, nothing may throttle (the fit assumed so).
    capped_overlap = sum(q.throttled for q in _overlap_predictions(fitted, harness, rows, spec))
    stage = stage_predictions(Simulator(perseus_spec, fitted), series, clocks)
    capped_perseus = sum(q.throttled for q in stage.values())
    _, p_err = ratio_errors(stage, perseus, perseus_spec.clock_max_mhz)
    prov = {
        "files": [KAREUS_FILE, PERSEUS_A100_FILE],
        "method": "Nelder-Mead over " + ", ".join(_POWER_SHAPE) + "; for each, non-negative least squares "
        "of " + ", ".join(_POWER_COEFFS) + " on relative energy / power errors",
        **errors,
        "perseus_power_ratio_mape": _mape(p_err),
        "throttled_predictions": {"overlap": int(capped_overlap), "perseus": int(capped_perseus)},
        "perseus_board_tdp_w": perseus_spec.tdp_w,
        "per_byte_energies": f"priors: HBM {hbm:.3g} J/byte, link {link:.3g} J/byte (not identifiable: every "
        "Kareus row moves the same bytes)",
        "busy_power_check": f"static + busy = {spec.static_power_w + fitted.busy_power_w:.1f} W vs the Perseus "
        f"artifact's blocking power {A100_BLOCKING_POWER_W} W (not fitted)",
    }
    return fitted, prov


A40_SWING_START_MHZ = 60.0
A40_SWING_MAX_MHZ = 450.0
"""Bounds of the A40 swing fit: from 4 clock steps (a controller that moves one step at a time) up
to about a third of the A40's clock range."""
A40_SWING_DIFF_STEP = 0.25
"""Relative finite-difference step of the swing: the swing is quantised to clock steps, so a
smaller step sees a flat residual."""


def fit_a40(a100: SimParams) -> tuple[SimParams, dict[str, Any]]:
    """A40 from the A100 parameters by spec ratios; power scale and voltage curve fitted."""
    measured = load_stage_profile(PERSEUS_A40_FILE)
    base = derive_params(a100, gpu_spec(A100), A40_SPEC)
    base = replace(base, hbm_energy_j_per_byte=GDDR6_ENERGY_FACTOR * base.hbm_energy_j_per_byte)
    series = gpt3_stage_series()
    clocks = sorted({f for (_, _, f) in measured})
    keys = [(s.stage, s.instruction, f) for s in series for f in clocks]
    p_meas = np.array([measured[k][1] / measured[k][0] for k in keys])

    def build(z: np.ndarray) -> SimParams:
        scale, vf, knee, swing = map(float, z)
        return replace(
            base,
            voltage_floor=vf,
            voltage_knee_frac=knee,
            throttle_swing_mhz=swing,
            **{n: getattr(base, n) * scale for n in _POWER_COEFFS},
        )

    def residuals(z: np.ndarray) -> np.ndarray:
        sim = Simulator(A40_SPEC, build(z))
        pred = stage_predictions(sim, series, clocks)
        p = np.array([pred[k].measurement.energy_j / pred[k].measurement.time_s for k in keys])
        t_err, _ = ratio_errors(pred, measured, A40_SPEC.clock_max_mhz)
        return np.concatenate([np.log(p / p_meas), t_err])

    sol = least_squares(
        residuals,
        np.array([1.0, 0.8, 0.6, A40_SWING_START_MHZ]),
        bounds=([0.1, 0.5, 0.3, 0.0], [5.0, 1.0, 0.98, A40_SWING_MAX_MHZ]),
        diff_step=[1e-2, 1e-2, 1e-2, A40_SWING_DIFF_STEP],
    )
    fitted = build(sol.x)
    pred = stage_predictions(Simulator(A40_SPEC, fitted), series, clocks)
    t_err, p_err = ratio_errors(pred, measured, A40_SPEC.clock_max_mhz)
    p = np.array([pred[k].measurement.energy_j / pred[k].measurement.time_s for k in keys])
    prov = {
        "file": PERSEUS_A40_FILE,
        "derived_from": A100,
        "method": "derive_params spec ratios; then power "
        "scale, voltage floor and knee, and the throttle swing, by least squares on power and time "
        "relative to 1740 MHz (the swing is identified by the rows above about 1,455 MHz, where the 300 W cap binds)",
        "power_scale": float(sol.x[0]),
        "throttle_swing_mhz": float(sol.x[3]),
        "power_mape": _mape(p / p_meas - 1),
        "power_ratio_mape": _mape(p_err),
        "time_ratio_mape": _mape(t_err),
        "tdp_w": A40_SPEC.tdp_w,
    }
    return fitted, prov


# ----- checks that are not fitted ---------------------------------------------------------------------
def interference_check(params: SimParams) -> dict[str, Any]:
    """NanoFlow's interference curves beside the simulator's SM-share curves (reported, not fitted):
    a memory-bound kernel on a share R of the SMs, relative to all SMs."""
    sim = Simulator(gpu_spec(A100_80), params)
    rows = _read_csv("nanoflow_a100/memory_bound_interference.csv")
    out = []
    for r in rows:
        share = float(r["R"])
        sms = max(1, round(share * sim.spec.sm_count))
        rel = sim.kernels.memory_bandwidth(sms, sim.spec.clock_max_mhz) / sim.kernels.memory_bandwidth(
            sim.spec.sm_count, sim.spec.clock_max_mhz
        )
        out.append({"R": share, "nanoflow_P": float(r["P"]), "simulated": round(rel, 3)})
    return {"file": "nanoflow_a100/memory_bound_interference.csv", "memory_bound": out}


# ----- driver ------------------------------------------------------------------------------------------
def _mape(err: np.ndarray) -> float:
    return float(np.mean(np.abs(err)))


@dataclass(frozen=True)
class _Steps3To5:
    """What steps 3-5 fit on top of steps 1-2b's parameters."""

    params: SimParams
    harness: OverlapHarness
    time_prov: dict[str, Any]
    power_prov: dict[str, Any]
    a40: SimParams
    a40_prov: dict[str, Any]
    swing_check: dict[str, Any]


def _fit_steps_3_to_5(params: SimParams, held: Collection[str], log: Callable[[str], None]) -> _Steps3To5:
    """Partition timing, power and clock, and the A40 on top of ``params``; ``held`` fields keep
    their values (the end-to-end coefficients)."""
    spec = gpu_spec(A100)
    log("3/7 partition timing (Kareus attention overlap)")
    rows = load_overlap()
    harness0 = OverlapHarness(0.55, 500e-6)
    params, harness, time_prov = fit_partition_timing(params, rows, harness0, spec, held=held)
    log(f"    time MAPE {time_prov['time_mape']:.4f}")
    log("4/7 power, voltage curve and per-SM clock sensitivity (Kareus energies, Perseus GPT-3 A100)")
    perseus = load_stage_profile(PERSEUS_A100_FILE)
    perseus_spec = replace(gpu_spec(A100_80), tdp_w=PERSEUS_A100_TDP_W)
    params, power_prov = fit_power_and_clock(params, rows, harness, spec, perseus, perseus_spec, log)
    log(
        f"    overlap energy MAPE {power_prov['overlap_energy_mape']:.4f}, Perseus power MAPE "
        f"{power_prov['perseus_power_mape']:.4f}, time-ratio MAPE {power_prov['perseus_time_ratio_mape']:.4f}"
    )
    if power_prov["throttled_predictions"]["overlap"]:
        log("    the 400 W cap binds on some Kareus rows: partition timing again, capped")
        params, harness, time_prov = fit_partition_timing(params, rows, harness, spec, power_capped=True, held=held)
        log(f"    time MAPE {time_prov['time_mape']:.4f}")
    log("5/7 A40 (Perseus GPT-3 A40)")
    a40, a40_prov = fit_a40(params)
    log(f"    power MAPE {a40_prov['power_mape']:.4f}, time-ratio MAPE {a40_prov['time_ratio_mape']:.4f}")
    log(f"    throttle swing {a40.throttle_swing_mhz:.0f} MHz, carried to the A100")
    # The A100 data never hold a clock at the cap across a clock sweep (the Kareus rows run at one
    # unlocked clock; the Perseus board's 500 W limit never binds), so the swing, a property of the
    # power-management loop that Ampere boards share (15 MHz steps), comes from the A40 fit.
    steady_mape = _overlap_energy_mape(params, harness, rows, spec)
    params = replace(params, throttle_swing_mhz=a40.throttle_swing_mhz)
    swing_check = {
        "overlap_energy_mape_steady": steady_mape,
        "overlap_energy_mape_with_swing": _overlap_energy_mape(params, harness, rows, spec),
        "note": "steps 3-4 fit with the prior swing 0: the Kareus overlap energy error at the unlocked "
        "clock (the 400 W cap), steady and with the A40's swing",
    }
    log(
        f"    Kareus overlap energy MAPE {swing_check['overlap_energy_mape_steady']:.4f} steady, "
        f"{swing_check['overlap_energy_mape_with_swing']:.4f} with the swing"
    )
    return _Steps3To5(params, harness, time_prov, power_prov, a40, a40_prov, swing_check)


def previous_end_to_end() -> dict[str, Any]:
    """The provenance of the packaged parameters' last step 6, its ``values`` the fitted
    coefficients (empty before any)."""
    try:
        text = resources.files("kareus_fx.cost_models").joinpath(PARAMS_RESOURCE).read_text()
    except FileNotFoundError:
        return {}
    return dict(json.loads(text)["gpus"].get(A100, {}).get("provenance", {}).get("end_to_end", {}))


def calibrate(
    log: Callable[[str], None] = print,
    *,
    end_to_end: Mapping[str, float] | None = None,
    refit_end_to_end: bool = False,
    end_to_end_cache: Path | None = None,
) -> dict[str, Any]:
    """Steps 1-5 on the micro data, with the end-to-end coefficients held at ``end_to_end`` (None:
    the packaged parameters' last step 6; empty: the micro fits' own values). With
    ``refit_end_to_end`` step 6 fits them again on the calibration rows (about half an hour on 2
    cores), then steps 3-5 are fitted again with them held and the rows planned once more."""
    t_start = time.time()
    prior = SimParams()
    log("1/7 memory-bound kernel curve (NanoFlow)")
    mem, mem_prov = fit_memory_curve(prior)
    params = _with_fitted(prior, mem)
    log("2/7 collective curve shape (NanoFlow)")
    coll, coll_prov = fit_collective_shape(prior)
    params = _with_fitted(params, coll)
    log("2b/7 collective contention beside a compute-bound kernel (NanoFlow)")
    contention, contention_prov = fit_compute_contention(params, coll_prov)
    params = _with_fitted(params, contention)
    log(f"    comm_contention_compute {contention['comm_contention_compute']:.3f}")
    micro = params
    previous = previous_end_to_end()
    held = dict(previous.get("values", {})) if end_to_end is None else dict(end_to_end)
    if held:
        log(f"    held at the end-to-end fit: {held}")
    steps = _fit_steps_3_to_5(with_values(micro, held), held, log)
    end_to_end_prov: dict[str, Any] = {}
    if refit_end_to_end:
        log("6/7 end to end on the calibration rows (Llama 3.2 3B, Tables 3 and 4)")
        held, end_to_end_prov = fit_end_to_end(steps.params, cache_path=end_to_end_cache, log=log)
        log(f"    fitted {held}; steps 3-5 again with them held")
        steps = _fit_steps_3_to_5(with_values(micro, held), held, log)
        final = calibration_rows_loss(steps.params, end_to_end_cache)
        end_to_end_prov["final_row_loss"] = final
        log(f"    rows' loss after steps 3-5: {sum(final.values()):.3f}")
    elif held and end_to_end is None:
        end_to_end_prov = previous
    log("7/7 all-to-all lanes (DeepEP on H800)")
    a2a, a2a_prov = fit_all_to_all(steps.params)
    log(f"    {a2a}, max abs error {a2a_prov['max_abs_rel_error']:.3f}")
    params, harness = _with_fitted(steps.params, a2a), steps.harness
    a40 = _with_fitted(steps.a40, a2a)
    fitted = (
        set(mem)
        | set(coll)
        | set(contention)
        | set(_TIME_FIT)
        | set(_POWER_COEFFS)
        | set(_POWER_SHAPE)
        | set(ALL_TO_ALL_FIELDS)
    )
    if held:
        end_to_end_prov = {**end_to_end_prov, "values": held}
    a100_prov = {
        "calibrated": True,
        "memory_curve": mem_prov,
        "collective_shape": coll_prov,
        "compute_contention": contention_prov,
        "partition_timing": steps.time_prov,
        "power_and_clock": steps.power_prov,
        "priors": sorted(set(params.to_dict()) - fitted - {"throttle_swing_mhz"}),
        "throttle_swing": {"from": "A40 (step 5)", **steps.swing_check},
        "checks": interference_check(params),
        "all_to_all": a2a_prov,
        **({"end_to_end": end_to_end_prov} if end_to_end_prov else {}),
    }
    return {
        "schema_version": 1,
        "generated_by": "python -m kareus_fx.cost_models.calibration",
        "fit_seconds": round(time.time() - t_start, 1),
        "gpus": {
            A100: {"params": params.to_dict(), "provenance": a100_prov},
            A100_80: {
                "params": params.to_dict(),
                "provenance": {
                    "calibrated": True,
                    "same_as": A100,
                    "note": "same GA100 die and clocks; the NanoFlow and Perseus data used above are from this board",
                },
            },
            "A40": {
                "params": a40.to_dict(),
                "provenance": {"calibrated": True, **steps.a40_prov},
                "spec": {
                    "values": {k: v for k, v in asdict(A40_SPEC).items() if k != "sources"},
                    "sources": A40_SPEC.sources,
                },
            },
        },
        "harness": {
            "kareus_attention_overlap": {**asdict(harness), "fitted_with": "step 3", "applies_to": KAREUS_FILE},
            "perseus_a100_board": {
                "power_limit_w": PERSEUS_A100_TDP_W,
                "applies_to": PERSEUS_A100_FILE,
                "note": "inferred: the board averaged 474-480 W at 1410 MHz, above the "
                "400 W of the standard A100 SXM4 80GB; 500 W boards exist",
            },
        },
    }


def output_path() -> Path:
    return Path(str(resources.files("kareus_fx.cost_models").joinpath(PARAMS_RESOURCE)))


def load_harness() -> OverlapHarness:
    """The fitted harness terms of the Kareus overlap measurements (for the validation benchmark)."""
    text = resources.files("kareus_fx.cost_models").joinpath(PARAMS_RESOURCE).read_text()
    h = json.loads(text)["harness"]["kareus_attention_overlap"]
    return OverlapHarness(h["block512_rate_factor"], h["tail_s"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kareus_fx.cost_models.calibration", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the package's data file)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--end-to-end",
        action="store_true",
        help="fit step 6 again on the calibration rows (about half an hour on 2 cores); "
        "without it, the last step 6's values are held",
    )
    mode.add_argument(
        "--micro-only",
        action="store_true",
        help="steps 1-5 alone: the contention coefficients as the micro data fit them",
    )
    parser.add_argument(
        "--end-to-end-cache",
        type=Path,
        default=None,
        help="keep step 6's planned rows in this JSON file, so a stopped fit resumes where it was",
    )
    args = parser.parse_args(argv)
    result = calibrate(
        log=lambda s: print(s, file=sys.stderr, flush=True),
        end_to_end={} if args.micro_only else None,
        refit_end_to_end=args.end_to_end,
        end_to_end_cache=args.end_to_end_cache,
    )
    out = args.out or output_path()
    out.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
