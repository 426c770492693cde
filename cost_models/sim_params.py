"""The simulator's free parameters, per GPU, and where they come from.

``data/calibrated_params.json`` holds the values that ``python -m kareus_fx.cost_models.calibration``
fitted to the calibration data (never to validation data), each GPU with its provenance (which
file, which fit, how large the fit error). A GPU without its own calibration (H100, H200) gets
the calibrated A100 parameters carried over by spec ratios (:func:`derive_params`), and says so
in :attr:`GPUParams.provenance`; its predictions are extrapolations.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache, lru_cache
from importlib import resources
from typing import Any

from kareus_fx.cost_models.hardware import GPUSpec, canonical_gpu_name, gpu_spec

PARAMS_RESOURCE = "data/calibrated_params.json"
OVERRIDES_ENV = "KAREUS_SIM_PARAM_OVERRIDES"
"""Environment variable holding a JSON object of :class:`SimParams` fields that replace the loaded
values of every GPU, for ablations (``bench/validate_end_to_end.py --ablation``). An environment
variable, not an argument, so that the planner's spawned tuning and solver processes see it too;
the simulated profiler's kind (its parameter hash) changes with it, so a profile database never
mixes measurements made with and without it. Unset in normal use."""
# The GPU whose calibrated parameters other GPUs are derived from.
REFERENCE_GPU = "A100-SXM4-40GB"


@dataclass(frozen=True)
class SimParams:
    """Free parameters of the kernel, collective and power models. Units in the names.

    The defaults are priors: the calibration starts its fits there, and the parameters it does not
    fit (its provenance lists those it does) keep these values, each justified below.
    """

    # Compute kernels.
    gemm_efficiency: float = 0.7
    """Fraction of the spec's dense tensor peak a large compute-bound kernel sustains."""
    cta_flops: float = 2.0 * 128 * 128 * 2048
    """FLOPs per CTA (tile), which sets the wave count a kernel has on a given number of SMs."""
    cta_bytes: float = 256 * 1024
    """HBM bytes per CTA of a memory-bound kernel (grid size of elementwise-like kernels)."""
    kernel_overhead_s: float = 5e-6
    """Launch gap before every kernel on the compute stream (the GPU idles meanwhile)."""
    roofline_sharpness: float = 4.0
    """Corner of the smooth max of a kernel's compute and memory time (larger = sharper)."""
    # Memory-bound kernels (NanoFlow memory_bound_kernel_vs_blocks.csv).
    mem_bw_per_sm_bytes_per_s: float = 35e9
    mem_bw_efficiency: float = 0.85
    """Fraction of the spec HBM bandwidth the saturated curve reaches."""
    mem_knee: float = 3.0
    per_sm_clock_exponent: float = 0.5
    """Per-SM request rate of a memory-bound kernel scales as (clock / max clock) ** this."""
    # Collectives (Kareus attention-overlap data for the scale; NanoFlow for the shape).
    comm_bus_bw_per_sm_bytes_per_s: float = 7e9
    """All-reduce bus bandwidth per SM (one 1024-thread CTA per SM)."""
    comm_bus_bw_cap_bytes_per_s: float = 80e9
    comm_knee: float = 2.0
    comm_peer_exponent: float = 1.0
    """Per-SM rate and cap grow as (group size - 1) ** this (calibrated at 2 GPUs). 1: every peer
    is served at once (direct peer access); paper section 3.2.1 (4 SMs hide a TP=4 all-reduce) and
    6.2.1 (6 SMs hide a TP=8 one) need it. Not fitted: the calibration data has one group size."""
    comm_clock_exponent: float = 0.0
    """A collective's per-SM rate (both libraries) scales as (clock / max clock) ** this. The prior,
    0: lowering the clock leaves communication bandwidth largely unchanged (paper sections 1 and
    3.2.3). Not fitted: the calibration data hold collectives at one clock only (the Kareus
    attention rows at the unlocked clock, NanoFlow's NCCL curves at the default clock); 1 would put
    every cycle of a request in the SM clock domain (the upper bound, ``bench/collective_clock.py``)."""
    comm_latency_s: float = 50e-6
    comm_hbm_bytes_per_bus_byte: float = 3.0
    """HBM traffic a collective causes per bus byte: a two-shot all-reduce reads its input, serves
    and receives the peers' halves and writes its output, about three local bytes per bus byte. A
    prior: in the calibration data it trades off against ``comm_request_weight``."""
    comm_contention: float = 2.0
    """Collective slowdown per unit of HBM utilisation by a memory-bound kernel beside it (its
    requests queue behind the kernel's streaming ones). Fitted on the Kareus attention partition,
    whose overlap windows hold LayerNorm, RoPE and bias-dropout-add kernels."""
    comm_contention_compute: float = 2.0
    """The same beside a compute-bound kernel (tile loads, L2 hits: shorter queues). Fitted to
    NanoFlow's measured network-kernel-beside-GEMM curve (``network_interference.csv``). A kernel
    between the two gets the mix weighted by its memory share (``KernelRates.memory_share``)."""
    comm_request_weight: float = 1.0
    """HBM share weight of one collective SM relative to one kernel SM when their demands exceed
    the bandwidth (weighted max-min fair sharing). A prior (each SM's requests weigh the same):
    the calibration data fits equally well from 0.06 to 10."""
    comm_factor_all_gather: float = 1.0
    comm_factor_reduce_scatter: float = 1.0
    comm_factor_all_to_all: float = 1.0
    """Per-SM bus rate of each kind relative to all-reduce."""
    all_to_all_nvlink_efficiency: float = 0.85
    """Share of the spec's NVLink bandwidth (``GPUSpec.nvlink_bandwidth_bytes_per_s``: links x NCCL's
    effective rate per link) an all-to-all's NVLink lane reaches with enough SMs: the lane's cap for
    both libraries, whose per-SM rates (the SM response) stay their own. Fitted on DeepEP's intranode
    rows (calibration step 7, :mod:`~kareus_fx.cost_models.all_to_all`)."""
    all_to_all_network_efficiency: float = 0.85
    """Share of one GPU's part of its node's network line rate (``GPUSpec.node_network_share_bytes_per_s``)
    an all-to-all's off-node lane reaches. Fitted on DeepEP's internode rows (step 7)."""
    all_to_all_latency_s: float = 50e-6
    """Fixed cost of one all-to-all, in place of ``comm_latency_s`` (fitted on the MSCCL++ all-reduce
    data; DeepEP's rows fit it twice as badly, with both lanes near their links' full rate). Fitted
    with the two efficiencies (step 7; the prior is ``comm_latency_s``'s): it lands at its lower
    bound, 0, since the rows (60-310 MB a rank, one size each) show no fixed cost. Small
    all-to-alls are priced by their bytes alone."""
    default_comm_sms: int = 24
    """SMs a collective gets outside a tuned partition (non-partitioned parts, sequential runs, the
    Megatron-LM and nanobatching baselines): NCCL's channel count, one CTA per SM per channel
    (NVIDIA/nccl issue 689). NCCL sets up 24 channels on 8 A100-SXM GPUs behind NVSwitch
    (NVIDIA/nccl-tests issue 100, the ``Channel 23/24`` log lines). A prior, not a fit: assumed the
    same for the 2- and 4-GPU groups inside a node, whose per-GPU NVLink bandwidth is the same."""
    nccl_bus_bw_per_cta_bytes_per_s: float = 12e9
    """Reduce-scatter bus bandwidth per CTA of NCCL (``default_comm_sms`` collectives: the baselines',
    and Kareus's outside its tuned partitions, which Kareus runs with MSCCL++, paper section 5).
    Fitted to NanoFlow's NCCL runs on 8 A100-SXM GPUs with 8, 16 and 32 CTAs (calibration step 2).
    Other kinds scale by their kind factor; a ring's bus bandwidth does not depend on the group size
    (an assumption: the data hold 8-GPU groups only)."""
    nccl_bus_bw_cap_bytes_per_s: float = 210e9
    """NCCL's bus bandwidth with many CTAs (the links' limit, the same for every kind); fitted with
    ``nccl_bus_bw_per_cta_bytes_per_s``."""
    # Power (energy = static + busy + SM-active + per-FLOP + per-byte terms).
    busy_power_w: float = 25.0
    """Power above static while the GPU runs a workload (clocks, uncore), at max clock and voltage."""
    sm_active_power_w: float = 40.0
    """Extra power with every SM holding resident compute CTAs, at max clock and voltage."""
    comm_sm_active_power_w: float = 40.0
    """The same for SMs holding a collective's CTAs (prorated by the SMs it runs on). A
    collective's CTA moves and adds data (loads, stores, flag polls); it issues no tensor-core
    work, so the prior, equal to ``sm_active_power_w``, is an upper bound. Fitted on the Kareus
    attention data, whose sequential rows (the all-reduce alone on 1-20 SMs, then the same
    compute) price an SM running the collective apart from the compute's."""
    flop_energy_j: float = 1.0e-12
    """Energy per FLOP at the max-clock voltage (scales with voltage squared)."""
    hbm_energy_j_per_byte: float = 8 * 7.8e-12
    """HBM2 DRAM access about 3.9 pJ/bit (O'Connor et al., "Fine-Grained DRAM", MICRO 2017), doubled
    for on-chip movement. A prior: every Kareus calibration row moves the same bytes."""
    link_energy_j_per_byte: float = 8 * 1.25e-12
    """NVLink-class SerDes, about 1.25 pJ/bit. A prior, for the same reason."""
    voltage_floor: float = 0.85
    """Core voltage at and below the knee, relative to the voltage at max clock."""
    voltage_knee_frac: float = 0.75
    """Clock (fraction of max) below which the voltage stays at its floor; above it rises linearly."""
    throttle_swing_mhz: float = 0.0
    """Half-width of the clock's swing while the power cap throttles (``PowerModel.throttle_swing``).
    The prior, 0, is a steady clock at the cap. Fitted on the Perseus A40 profile, the calibration
    data where the cap binds (300 W above about 1,455 MHz: time stops falling while power keeps
    rising); the A100 takes the A40's value (the same Ampere power-management loop; its own
    calibration data never throttles steadily enough to identify it)."""

    def comm_kind_factor(self, kind: str) -> float:
        if kind == "all_gather":
            return self.comm_factor_all_gather
        if kind == "reduce_scatter":
            return self.comm_factor_reduce_scatter
        if kind == "all_to_all":
            return self.comm_factor_all_to_all
        return 1.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SimParams:
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown simulator parameters {sorted(unknown)}; known: {sorted(known)}")
        return cls(**values)


@dataclass(frozen=True)
class GPUParams:
    """Parameters for one GPU, with the spec they apply to and their provenance."""

    spec: GPUSpec
    params: SimParams
    provenance: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def derive_params(base: SimParams, base_spec: GPUSpec, target: GPUSpec) -> SimParams:
    """Carry calibrated parameters to an uncalibrated GPU by spec ratios.

    Per-SM HBM rate follows HBM bandwidth per SM; collective rates follow link bandwidth; energy
    per FLOP follows the dynamic-power headroom (TDP - static) per peak FLOP/s; busy and SM power
    follow the headroom. Efficiencies, curve shapes and the voltage curve (relative to max clock)
    are kept. These are assumptions, not fits.
    """
    bw_per_sm = (target.hbm_bandwidth_bytes_per_s / target.sm_count) / (
        base_spec.hbm_bandwidth_bytes_per_s / base_spec.sm_count
    )
    link = target.nvlink_bandwidth_bytes_per_s / base_spec.nvlink_bandwidth_bytes_per_s
    headroom = (target.tdp_w - target.static_power_w) / (base_spec.tdp_w - base_spec.static_power_w)
    flops_ratio = target.peak_flops_per_s() / base_spec.peak_flops_per_s()
    return replace(
        base,
        mem_bw_per_sm_bytes_per_s=base.mem_bw_per_sm_bytes_per_s * bw_per_sm,
        comm_bus_bw_per_sm_bytes_per_s=base.comm_bus_bw_per_sm_bytes_per_s * link,
        comm_bus_bw_cap_bytes_per_s=base.comm_bus_bw_cap_bytes_per_s * link,
        nccl_bus_bw_per_cta_bytes_per_s=base.nccl_bus_bw_per_cta_bytes_per_s * link,
        nccl_bus_bw_cap_bytes_per_s=base.nccl_bus_bw_cap_bytes_per_s * link,
        busy_power_w=base.busy_power_w * headroom,
        sm_active_power_w=base.sm_active_power_w * headroom,
        comm_sm_active_power_w=base.comm_sm_active_power_w * headroom,
        flop_energy_j=base.flop_energy_j * headroom / flops_ratio,
    )


@lru_cache(maxsize=1)
def _params_file() -> dict[str, Any]:
    try:
        text = resources.files("kareus_fx.cost_models").joinpath(PARAMS_RESOURCE).read_text()
    except FileNotFoundError:
        return {"gpus": {}}
    return json.loads(text)


def clear_cache() -> None:
    """Forget loaded parameters (after the calibration rewrote the file)."""
    _params_file.cache_clear()
    gpu_params.cache_clear()


def extra_gpu_specs() -> dict[str, GPUSpec]:
    """GPUs that only the calibration file specifies (with sources), keyed by name."""
    out = {}
    for name, entry in _params_file().get("gpus", {}).items():
        spec = entry.get("spec")
        if spec is not None:
            out[name] = GPUSpec(**{**spec["values"], "sources": spec.get("sources", {})})
    return out


def resolve_spec(name: str) -> GPUSpec:
    """The spec for ``name``: the hardware table first, then GPUs the calibration file specifies."""
    extras = extra_gpu_specs()
    if name in extras:
        return extras[name]
    return gpu_spec(name)


def param_overrides() -> dict[str, Any]:
    """The fields ``OVERRIDES_ENV`` replaces (empty when unset); a clear error for a bad value."""
    text = os.environ.get(OVERRIDES_ENV, "").strip()
    if not text:
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{OVERRIDES_ENV} must be a JSON object of simulator parameters: {err}") from err
    known = {f.name for f in fields(SimParams)}
    if not isinstance(values, dict) or set(values) - known:
        raise ValueError(
            f"{OVERRIDES_ENV} must be a JSON object with keys among {sorted(known)}, got {text!r}; "
            f"unset it for the calibrated parameters"
        )
    return values


@cache
def gpu_params(name: str) -> GPUParams:
    """Calibrated parameters for ``name`` (derived from the reference GPU when it has none), with
    any ``OVERRIDES_ENV`` fields replaced (recorded in the provenance)."""
    loaded = _loaded_gpu_params(name)
    overrides = param_overrides()
    if not overrides:
        return loaded
    return GPUParams(loaded.spec, replace(loaded.params, **overrides), {**loaded.provenance, "overridden": overrides})


def _loaded_gpu_params(name: str) -> GPUParams:
    extras = extra_gpu_specs()
    key = name if name in extras else canonical_gpu_name(name)
    spec = resolve_spec(key)
    entries = _params_file().get("gpus", {})
    if key in entries:
        entry = entries[key]
        return GPUParams(spec, SimParams.from_dict(entry["params"]), entry.get("provenance", {}))
    if REFERENCE_GPU in entries:
        base = SimParams.from_dict(entries[REFERENCE_GPU]["params"])
        derived = derive_params(base, gpu_spec(REFERENCE_GPU), spec)
        return GPUParams(
            spec, derived, {"derived_from": REFERENCE_GPU, "method": "derive_params spec ratios", "calibrated": False}
        )
    return GPUParams(spec, SimParams(), {"calibrated": False, "method": "defaults (no calibration file)"})
