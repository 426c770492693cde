"""Calibration step 7: the all-to-all's lane efficiencies and latency from DeepEP's measurements.

The data (``data/calibration/deepep/normal_kernels.csv``, sources in ``SOURCES.md``) are DeepEP's
normal (training) dispatch and combine kernels on H800 GPUs, 8 to a node, in DeepSeek-V3's
pretraining setting: 4096 tokens per rank, hidden 7168, top-8 of 256 experts, FP8 dispatch (7168
bytes plus one 4-byte scale per 128 channels a token), BF16 combine, 24 SMs. Its first version's
rows (the ones fitted) are one message size each; the second version's are checks.

How DeepEP's "bottleneck bandwidth" maps to bytes per link (its test scripts divide a byte count by
the kernel's time; ``R``: distinct ranks a token's experts live on, ``N``: distinct nodes, both
averaged over the test's routing, ``T`` tokens of ``h`` bytes):

- Intranode (NVLink): the bytes a rank receives, its own tokens included: ``C = T x R x h``. With
  random routing each rank is as likely as any other, so ``(g - 1) / g`` of them cross NVLink.
- Internode (RDMA): the bytes a rank sends to nodes, one copy per (token, destination node), its
  own node included: ``C = T x N x h``. The copy for its own node stays on the node, so
  ``(n - 1) / n`` of them cross the network (n nodes, each as likely). Each arriving copy is then
  forwarded over NVLink to the node's ranks holding the token's experts, ``R / N`` per copy, one in
  ``m`` of them (m ranks a node) being the forwarder itself: ``C x (R / N) x (m - 1) / m`` NVLink
  bytes. With two nodes (EP16) the forwarding makes NVLink the slower lane, which is why that row
  shows a lower "RDMA" bandwidth than EP32 and EP64.

Combine moves the same bytes the other way. The routing statistics come from a seeded Monte-Carlo
run of the test's routing (random scores; nodes as expert groups, the top ``min(nodes, 4)`` groups
by their best score, then the top 8 experts among them), so DeepSeek-V3's node-limited routing
cuts the off-node copies the way it did in the measurement.

The fit: each row's time ``C / bandwidth`` against ``all_to_all_latency_s`` plus the slower lane
(:meth:`KernelModel.all_to_all_lane_time_s` on an H800 spec: the A100 parameters carried over by
spec ratios, with the sources' 160 GB/s NVLink and 50 GB/s network per GPU), the NVLink lane on the
row's SMs with the MSCCL++ per-SM curve (DeepEP's kernels, like MSCCL++'s, write to peers
directly); least squares on the log of the bandwidth over the eight rows. The efficiencies carry to
every GPU unchanged (:func:`~kareus_fx.cost_models.sim_params.derive_params` keeps efficiencies).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from kareus_fx.cost_models.hardware import GPUSpec, gpu_spec
from kareus_fx.cost_models.kernel_model import KernelModel
from kareus_fx.cost_models.sim_params import SimParams, derive_params

DEEPEP_FILE = "deepep/normal_kernels.csv"
DEEPEP_SOURCE = "deepseek-ai/DeepEP, commit 0297fc801788b14b338a46554faca28d419e518a (docs/legacy.md, README.md)"
FIELDS = ("all_to_all_nvlink_efficiency", "all_to_all_network_efficiency", "all_to_all_latency_s")
ROUTING_TOKENS = 16384
"""Tokens of the Monte-Carlo routing run: the averages' standard errors are below 0.2 %."""
ROUTING_SEED = 0
A100 = "A100-SXM4-40GB"
H100 = "H100-SXM5-80GB"
EFFICIENCY_MIN = 0.05
"""Lower bound of the efficiencies (at most 1); the latency lies between 0 and the all-reduce's ``comm_latency_s``."""


@dataclass(frozen=True)
class DeepEPRow:
    """One row of ``normal_kernels.csv`` (units in the names; the CSV's GB/s are 1e9 bytes/s)."""

    version: str
    arch: str
    direction: str
    ep: int
    nodes: int
    gpus_per_node: int
    sms: int
    tokens: int
    top_k: int
    experts: int
    topk_nodes: int
    token_bytes: float
    bottleneck: str
    bandwidth_bytes_per_s: float
    nvlink_bytes_per_s: float
    rdma_bytes_per_s: float

    @property
    def label(self) -> str:
        return f"{self.version} {self.arch} {self.direction} EP{self.ep} ({self.sms} SMs)"


@dataclass(frozen=True)
class LaneBytes:
    """One rank's bytes in a DeepEP row: what DeepEP counts, and what crosses each lane."""

    counted: float
    nvlink: float
    network: float


def _number(text: str) -> float:
    return float(text) if text else 0.0


def load_rows(fitted_only: bool = True) -> list[DeepEPRow]:
    """The CSV's rows (default: only those marked fitted, DeepEP's first version on H800)."""
    text = resources.files("kareus_fx.cost_models").joinpath(f"data/calibration/{DEEPEP_FILE}").read_text()
    rows = []
    for r in csv.DictReader(text.splitlines()):
        if fitted_only and r["fitted"] != "yes":
            continue
        rows.append(
            DeepEPRow(
                r["version"],
                r["arch"],
                r["direction"],
                int(r["ep"]),
                int(r["nodes"]),
                int(r["gpus_per_node"]),
                int(r["sms"]),
                int(r["tokens"]),
                int(r["top_k"]),
                int(_number(r["experts"])),
                int(_number(r["topk_nodes"])),
                _number(r["token_bytes"]),
                r["bottleneck"],
                float(r["bottleneck_GBps"]) * 1e9,
                _number(r["nvlink_GBps"]) * 1e9,
                _number(r["rdma_GBps"]) * 1e9,
            )
        )
    return rows


def routing_counts(row: DeepEPRow, tokens: int = ROUTING_TOKENS, seed: int = ROUTING_SEED) -> tuple[float, float]:
    """Distinct ranks and distinct nodes a token's experts live on, averaged over a seeded run of
    the routing of DeepEP's test (module docstring)."""
    rng = np.random.default_rng(seed)
    scores = np.abs(rng.standard_normal((tokens, row.experts), dtype=np.float32)) + 1.0
    per_node = row.experts // row.nodes
    best = scores.reshape(tokens, row.nodes, per_node).max(axis=2)
    kept = np.argsort(-best, axis=1)[:, : row.topk_nodes]
    allowed = np.zeros((tokens, row.nodes), dtype=bool)
    np.put_along_axis(allowed, kept, True, axis=1)
    masked = np.where(np.repeat(allowed, per_node, axis=1), scores, -np.inf)
    experts = np.argpartition(-masked, row.top_k - 1, axis=1)[:, : row.top_k]

    def distinct(owner: np.ndarray, count: int) -> float:
        hit = np.zeros((tokens, count), dtype=bool)
        np.put_along_axis(hit, owner, True, axis=1)
        return float(hit.sum(axis=1).mean())

    return distinct(experts // (row.experts // row.ep), row.ep), distinct(experts // per_node, row.nodes)


def lane_bytes(row: DeepEPRow, ranks_per_token: float, nodes_per_token: float) -> LaneBytes:
    """One rank's counted, NVLink and network bytes in ``row`` (module docstring)."""
    m = row.gpus_per_node
    if row.nodes == 1:
        counted = row.tokens * ranks_per_token * row.token_bytes
        return LaneBytes(counted, counted * (row.ep - 1) / row.ep, 0.0)
    counted = row.tokens * nodes_per_token * row.token_bytes
    forwarded = counted * ranks_per_token / nodes_per_token * (m - 1) / m
    return LaneBytes(counted, forwarded, counted * (row.nodes - 1) / row.nodes)


def h800_spec(row: DeepEPRow) -> GPUSpec:
    """The H800 of DeepEP's measurements: an H100 SXM (same GH100 die and clocks) with the row's
    NVLink and per-GPU network rates, ``gpus_per_node`` GPUs a node."""
    h100 = gpu_spec(H100)
    return replace(
        h100,
        name="H800-SXM5-80GB",
        nvlink_bandwidth_bytes_per_s=row.nvlink_bytes_per_s,
        gpus_per_node=row.gpus_per_node,
        node_network_bytes_per_s=row.rdma_bytes_per_s * row.gpus_per_node,
        sources={
            **h100.sources,
            "nvlink_bandwidth_bytes_per_s": f"{DEEPEP_SOURCE}: H800, ~160 GB/s NVLink maximum",
            "node_network_bytes_per_s": f"{DEEPEP_SOURCE}: one CX7 400 Gb/s (~50 GB/s) RDMA NIC per GPU",
        },
    )


@dataclass(frozen=True)
class _Prepared:
    row: DeepEPRow
    lanes: LaneBytes
    kernels: KernelModel
    ranks_per_token: float
    nodes_per_token: float


def _prepare(params: SimParams, rows: list[DeepEPRow]) -> list[_Prepared]:
    out = []
    for row in rows:
        spec = h800_spec(row)
        derived = derive_params(params, gpu_spec(A100), spec)
        ranks, nodes = routing_counts(row)
        out.append(_Prepared(row, lane_bytes(row, ranks, nodes), KernelModel(spec, derived), ranks, nodes))
    return out


def _model(prepared: _Prepared, values: dict[str, float]) -> KernelModel:
    """The row's H800 model with the step's fields at ``values``."""
    fields: dict[str, Any] = dict(values)  # mypy would check a **dict's float values against every field
    return KernelModel(prepared.kernels.spec, replace(prepared.kernels.params, **fields))


def _predicted(prepared: _Prepared, values: dict[str, float]) -> tuple[float, str]:
    """Bandwidth DeepEP would report under ``values``, and the slower lane."""
    km = _model(prepared, values)
    row, lanes = prepared.row, prepared.lanes
    clock = km.spec.clock_max_mhz
    peers = row.gpus_per_node - 1
    nvlink_s = km.all_to_all_lane_time_s(lanes.nvlink, 0.0, peers, row.sms, clock, "mscclpp")
    network_s = km.all_to_all_lane_time_s(0.0, lanes.network, peers, row.sms, clock, "mscclpp")
    lane = "NVLink" if nvlink_s >= network_s else "network"
    return lanes.counted / (values["all_to_all_latency_s"] + max(nvlink_s, network_s)), lane


def predicted_bandwidths(params: SimParams, rows: list[DeepEPRow] | None = None) -> list[tuple[DeepEPRow, float, str]]:
    """Each fitted row with the bandwidth the model with ``params`` predicts for it and its slower lane."""
    prepared = _prepare(params, load_rows() if rows is None else rows)
    values = {name: getattr(params, name) for name in FIELDS}
    return [(p.row, *_predicted(p, values)) for p in prepared]


def _fit(prepared: list[_Prepared], hi_latency_s: float, latency_s: float | None = None) -> dict[str, float]:
    """Least squares on log bandwidth from the priors; ``latency_s`` given: the efficiencies alone."""
    measured = np.array([p.row.bandwidth_bytes_per_s for p in prepared])
    prior = SimParams()
    free = FIELDS if latency_s is None else FIELDS[:2]
    fixed = {} if latency_s is None else {"all_to_all_latency_s": latency_s}

    def values(z: np.ndarray) -> dict[str, float]:
        return {**dict(zip(free, map(float, z))), **fixed}

    def residuals(z: np.ndarray) -> np.ndarray:
        return np.log(np.array([_predicted(p, values(z))[0] for p in prepared]) / measured)

    lo = np.array([EFFICIENCY_MIN, EFFICIENCY_MIN, 0.0])[: len(free)]
    hi = np.array([1.0, 1.0, hi_latency_s])[: len(free)]
    x0 = np.clip([getattr(prior, name) for name in free], lo, hi)
    scale = np.array([1.0, 1.0, 1e-5])[: len(free)]
    return values(least_squares(residuals, x0, bounds=(lo, hi), x_scale=scale).x)


def fit_all_to_all(params: SimParams) -> tuple[dict[str, float], dict[str, Any]]:
    """Step 7: the all-to-all's NVLink and network efficiencies and latency on the DeepEP rows."""
    prepared = _prepare(params, load_rows())
    values = _fit(prepared, params.comm_latency_s)
    table = []
    for p in prepared:
        predicted, lane = _predicted(p, values)
        table.append(
            {
                "row": p.row.label,
                "measured_GBps": p.row.bandwidth_bytes_per_s / 1e9,
                "predicted_GBps": round(predicted / 1e9, 2),
                "rel_error": round(predicted / p.row.bandwidth_bytes_per_s - 1.0, 4),
                "slower_lane": lane,
            }
        )
    errors = np.array([t["rel_error"] for t in table])
    # The all-reduce's latency in place of the fitted one: how much worse the rows fit.
    with_comm = _fit(prepared, params.comm_latency_s, latency_s=params.comm_latency_s)
    comm_errors = [_predicted(p, with_comm)[0] / p.row.bandwidth_bytes_per_s - 1.0 for p in prepared]
    cap_share = {}
    for p in prepared:
        if p.row.nodes == 1:
            km = _model(p, values)
            nvlink = km.all_to_all_nvlink_bandwidth(
                p.row.gpus_per_node - 1, p.row.sms, km.spec.clock_max_mhz, "mscclpp"
            )
            cap_share[p.row.label] = round(
                nvlink / (values["all_to_all_nvlink_efficiency"] * km.spec.nvlink_bandwidth_bytes_per_s), 4
            )
    prov = {
        "file": DEEPEP_FILE,
        "source": DEEPEP_SOURCE,
        "method": "time = bytes DeepEP counts / its bandwidth against all_to_all_latency_s + the slower of the NVLink "
        "and network lanes (forwarded NVLink bytes and off-node copies from a seeded run of the test's routing, "
        f"{ROUTING_TOKENS} tokens, seed {ROUTING_SEED}), on an H800 (H100 spec with the source's 160 GB/s NVLink, "
        "50 GB/s network per GPU; A100 parameters by spec ratios); least squares on log bandwidth over the V1 rows",
        "rows": table,
        "max_abs_rel_error": float(np.max(np.abs(errors))),
        "mape": float(np.mean(np.abs(errors))),
        "routing": {
            f"EP{p.row.ep}": {
                "ranks_per_token": round(p.ranks_per_token, 3),
                "nodes_per_token": round(p.nodes_per_token, 3),
            }
            for p in prepared
        },
        "nvlink_lane_at_row_sms": {
            "note": "the NVLink lane on the intranode rows' 24 SMs relative to its cap",
            **cap_share,
        },
        "latency": f"{values['all_to_all_latency_s']:.3g} s"
        + (
            " (its lower bound: no fixed cost shows at 60-310 MB a rank)"
            if values["all_to_all_latency_s"] < 1e-9
            else ""
        )
        + "; identified only by dispatch against combine (the FP8 dispatch moves about half the combine's "
        "bytes); the all-reduce's comm_latency_s in its place leaves a max abs error of "
        f"{max(abs(e) for e in comm_errors):.3f} with the efficiencies at "
        f"{with_comm['all_to_all_nvlink_efficiency']:.3f} / {with_comm['all_to_all_network_efficiency']:.3f}",
        "checks": version2_check(values["all_to_all_network_efficiency"]),
    }
    return values, prov


def version2_check(network_efficiency: float) -> dict[str, Any]:
    """DeepEP's second version on CX7 NICs (not fitted): the share of the line rate its internode
    rows imply, their "logical" bandwidth counting the own node's copies as the first version's
    does, beside the fitted network efficiency."""
    implied = {}
    for row in load_rows(fitted_only=False):
        if row.version == "V2" and row.bottleneck == "RDMA":
            share = row.bandwidth_bytes_per_s * (row.nodes - 1) / row.nodes / row.rdma_bytes_per_s
            implied[row.label] = round(share, 3)
    return {
        "file": DEEPEP_FILE,
        "v2_implied_network_efficiency": implied,
        "fitted_network_efficiency": round(network_efficiency, 3),
        "note": "second-version kernels, 8192 tokens, 6-12 SMs, GPUs unstated beyond the architecture: "
        "reported, not fitted; they reach the first version's network efficiency with a quarter of its SMs",
    }
