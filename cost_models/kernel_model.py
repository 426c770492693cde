"""How fast one kernel or one collective runs, given the SM clock and the SMs it can use.

Paper section 3 in rates:
- Compute throughput scales with the clock and with the SMs a kernel gets; a kernel of ``c``
  CTAs on ``s`` SMs runs ``ceil(c / s)`` waves, so losing SMs to a collective costs whole waves
  (wave quantisation).
- A memory-bound kernel needs SMs to reach HBM bandwidth: achieved bandwidth is a saturating
  curve of the SM count (about 35 GB/s per SM up to about 85% of peak on A100; NanoFlow's
  ``memory_bound_kernel_vs_blocks.csv``). Peak HBM bandwidth does not depend on the SM clock;
  the per-SM rate does in part (``per_sm_clock_exponent``: the share of a request's round trip
  spent in the SM clock domain).
- A collective likewise needs SMs to reach link bandwidth (NanoFlow ``collectives/*_blocks.csv``
  for the curve's shape; the Kareus all-reduce data for its scale); its per-SM rate follows the
  clock by its own exponent (``comm_clock_exponent``, a prior: no calibration data vary it).
- An all-to-all runs on two lanes at once, NVLink inside the node (the same per-SM curves, capped at
  its fitted share of NVLink) and the GPU's share of the node network across nodes, the slower one
  setting its time (:mod:`~kareus_fx.cost_models.all_to_all`).
- A kernel's time is a smooth maximum of its compute time and its memory time (roofline with
  imperfect overlap), plus a fixed launch gap before it.

All functions are plain float arithmetic: the simulator calls them in its inner loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kareus_fx.cost_models.all_to_all import all_to_all_split
from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.cost_models.sim_params import SimParams
from kareus_fx.workload import CollectiveKind, CollectiveSpec, CommLibrary


def smooth_min(x: float, cap: float, sharpness: float) -> float:
    """``min(x, cap)`` with a rounded knee: ``(x^-p + cap^-p)^(-1/p)``."""
    if x <= 0.0:
        return 0.0
    return (x**-sharpness + cap**-sharpness) ** (-1.0 / sharpness)


def smooth_max(a: float, b: float, sharpness: float) -> float:
    """``max(a, b)`` with a rounded corner: ``(a^p + b^p)^(1/p)``."""
    if a <= 0.0:
        return b
    if b <= 0.0:
        return a
    return (a**sharpness + b**sharpness) ** (1.0 / sharpness)


def memory_share(compute_s: float, memory_s: float, sharpness: float) -> float:
    """Share of a smooth roofline ``(c^p + m^p)^(1/p)`` that its memory term makes up."""
    if memory_s <= 0.0:
        return 0.0
    if compute_s <= 0.0:
        return 1.0
    ratio = compute_s / memory_s
    if sharpness * math.log(ratio) > 700.0:  # ratio ** sharpness would overflow; the share is 0 to double precision
        return 0.0
    return 1.0 / (1.0 + ratio**sharpness)


def mean_resident_sms(ctas: int, sms: int, memory_share_of_kernel: float) -> float:
    """SMs holding a kernel's CTAs, averaged over its time, when it runs ``ctas`` CTAs on ``sms`` SMs.

    A compute-bound kernel's time is its waves (``ceil(ctas / sms)``) of one CTA's time each
    (wave quantisation); in the last wave only ``ctas - (waves - 1) x sms`` SMs hold a CTA and the
    others sit empty, drawing no SM-active power (the power model charges SMs holding resident
    CTAs: ``SimParams.sm_active_power_w``). Averaged over the waves that is ``ctas / waves`` SMs:
    a 256-CTA GEMM on 108 SMs runs 3 waves, the SMs busy 79 % of its time (NVIDIA, "Matrix
    Multiplication Background User's Guide", wave quantization: "the last wave partially occupies
    the GPU"). A memory-bound kernel's time is set by HBM bandwidth, not by its waves: its resident
    CTAs stream until the bytes are moved, so it keeps ``min(ctas, sms)``. Between the two the
    kernel's memory share (:func:`memory_share`) weights the two (an assumption).
    """
    busy = float(min(ctas, sms))
    if ctas <= sms:
        return busy
    waves = math.ceil(ctas / sms)
    wave_mean = ctas / waves
    share = min(max(memory_share_of_kernel, 0.0), 1.0)
    return share * busy + (1.0 - share) * wave_mean


@dataclass(frozen=True)
class KernelRates:
    """One kernel's standalone behaviour with a given number of SMs at a given clock."""

    time_s: float
    """Kernel time without the launch gap."""
    hbm_bytes_per_s: float
    """HBM bandwidth it draws while it runs."""
    busy_sms: float
    """SMs holding its CTAs (at most the SMs it may use)."""
    memory_share: float = 0.0
    """How memory-bound it is, 0 (compute-bound) to 1: its memory time's share of the smooth
    roofline, ``m^p / (c^p + m^p)`` with ``p = roofline_sharpness``."""
    resident_sms: float | None = None
    """SMs holding its CTAs averaged over its time (what draws SM-active power): ``busy_sms`` less
    the SMs a partial last wave leaves empty (:func:`mean_resident_sms`); None: ``busy_sms``."""

    @property
    def powered_sms(self) -> float:
        """The SMs whose SM-active power the kernel draws, averaged over its time."""
        return self.busy_sms if self.resident_sms is None else self.resident_sms


class KernelModel:
    """Rates of compute kernels and collectives on one GPU with one parameter set."""

    def __init__(self, spec: GPUSpec, params: SimParams) -> None:
        self.spec = spec
        self.params = params
        self.sm_count = spec.sm_count
        self.hbm_saturation_bytes_per_s = params.mem_bw_efficiency * spec.hbm_bandwidth_bytes_per_s

    # ----- compute kernels -------------------------------------------------------------------
    def clock_scale(self, clock_mhz: float) -> float:
        """Per-SM memory-request rate relative to the maximum clock."""
        return (clock_mhz / self.spec.clock_max_mhz) ** self.params.per_sm_clock_exponent

    def comm_clock_scale(self, clock_mhz: float) -> float:
        """A collective's per-SM rate relative to the maximum clock (``comm_clock_exponent``)."""
        return (clock_mhz / self.spec.clock_max_mhz) ** self.params.comm_clock_exponent

    def memory_bandwidth(self, sms: float, clock_mhz: float) -> float:
        """HBM bandwidth a memory-bound kernel reaches with ``sms`` SMs (bytes/s)."""
        p = self.params
        linear = p.mem_bw_per_sm_bytes_per_s * self.clock_scale(clock_mhz) * sms
        return smooth_min(linear, self.hbm_saturation_bytes_per_s, p.mem_knee)

    def ctas(self, flops: float, nbytes: float) -> int:
        """CTAs of a kernel: fixed FLOPs per CTA, or fixed bytes per CTA for memory-bound ones."""
        p = self.params
        return max(1, math.ceil(flops / p.cta_flops), math.ceil(nbytes / p.cta_bytes))

    def kernel(self, flops: float, nbytes: float, sms: int, clock_mhz: float) -> KernelRates:
        """Time, HBM draw and busy SMs of one kernel running alone on ``sms`` SMs."""
        p = self.params
        ctas = self.ctas(flops, nbytes)
        waves = math.ceil(ctas / sms)
        per_sm_flops = self.spec.peak_flops_per_s(clock_mhz) * p.gemm_efficiency / self.sm_count
        # Wave quantisation: each wave takes one CTA's time on one SM.
        compute_s = waves * (flops / ctas) / per_sm_flops if flops > 0 else 0.0
        busy = float(min(ctas, sms))
        memory_s = nbytes / self.memory_bandwidth(busy, clock_mhz) if nbytes > 0 else 0.0
        time_s = smooth_max(compute_s, memory_s, p.roofline_sharpness)
        share = memory_share(compute_s, memory_s, p.roofline_sharpness)
        return KernelRates(
            time_s,
            nbytes / time_s if time_s > 0 else 0.0,
            busy,
            share,
            mean_resident_sms(ctas, sms, share),
        )

    def comm_contention(self, memory_share_of_kernel: float) -> float:
        """Collective slowdown per unit of HBM utilisation by the kernel beside it (see
        :class:`~kareus_fx.cost_models.sim_params.SimParams`): from ``comm_contention_compute``
        beside a compute-bound kernel to ``comm_contention`` beside a memory-bound one."""
        p = self.params
        return p.comm_contention_compute + (p.comm_contention - p.comm_contention_compute) * memory_share_of_kernel

    # ----- collectives -----------------------------------------------------------------------
    @staticmethod
    def bus_bytes(collective: CollectiveSpec) -> float:
        """Bytes each rank moves over its links (the nccl-tests "bus bandwidth" convention)."""
        g = collective.group_size
        if g <= 1:
            return 0.0
        factor = 2.0 * (g - 1) / g if collective.kind == "all_reduce" else (g - 1) / g
        return factor * collective.bytes

    def collective_bandwidth(
        self, collective: CollectiveSpec, sms: int, clock_mhz: float, library: CommLibrary = "mscclpp"
    ) -> float:
        """Bus bandwidth (bytes/s) of a collective running alone on ``sms`` SMs with ``library``.

        ``"nccl"``: NCCL's measured curve (:meth:`nccl_bandwidth`). ``"mscclpp"``: Kareus's MSCCL++
        kernel: the per-SM rate and the cap are calibrated on a 2-GPU group (one peer). A CTA of a
        direct-access collective (MSCCL++) keeps requests in flight to every peer at once, so both
        grow as ``peers ** comm_peer_exponent``; the cap never exceeds the GPU's NVLink bandwidth.
        An all-to-all: its bus bytes over its slower lane's time (:meth:`all_to_all_lane_time_s`).
        """
        if collective.kind == "all_to_all":
            g = collective.group_size
            if g <= 1:  # nothing leaves the GPU: the NVLink lane's rate, for callers that divide by it
                return self.all_to_all_nvlink_bandwidth(0, sms, clock_mhz, library)
            split = all_to_all_split(self.spec, g)
            lane_s = self.all_to_all_lane_time_s(
                split.nvlink_fraction, split.network_fraction, split.ranks_per_node - 1, sms, clock_mhz, library
            )
            return (g - 1) / g / lane_s
        if library == "nccl":
            return self.nccl_bandwidth(collective, sms, clock_mhz)
        p = self.params
        peers = max(1, collective.group_size - 1) ** p.comm_peer_exponent
        cap = min(p.comm_bus_bw_cap_bytes_per_s * peers, self.spec.nvlink_bandwidth_bytes_per_s)
        per_sm = self.comm_per_sm_rate(collective.kind, collective.group_size - 1, library)
        return smooth_min(per_sm * self.comm_clock_scale(clock_mhz) * sms, cap, p.comm_knee)

    def comm_per_sm_rate(self, kind: CollectiveKind, peers: int, library: CommLibrary) -> float:
        """Bus bytes/s one SM (one CTA) of a ``kind`` collective moves at the maximum clock.

        ``"mscclpp"``: the all-reduce's per-SM rate times the kind factor times
        ``peers ** comm_peer_exponent``. ``"nccl"``: NCCL's per-CTA reduce-scatter rate scaled by the
        kind factor relative to the reduce-scatter's (a ring's rate does not depend on the peers).
        """
        p = self.params
        if library == "nccl":
            return p.nccl_bus_bw_per_cta_bytes_per_s * p.comm_kind_factor(kind) / p.comm_factor_reduce_scatter
        return p.comm_bus_bw_per_sm_bytes_per_s * p.comm_kind_factor(kind) * max(1, peers) ** p.comm_peer_exponent

    def nccl_bandwidth(self, collective: CollectiveSpec, ctas: int, clock_mhz: float) -> float:
        """Bus bandwidth (bytes/s) of NCCL's collective on ``ctas`` CTAs (one per channel; the
        baselines run ``default_comm_sms``, NCCL's default channel count).

        NCCL's curve of bandwidth against CTAs is measured on 8 A100-SXM GPUs (calibration step 2);
        a ring's bus bandwidth is assumed the same for the 2- and 4-GPU groups inside the node.
        Other kinds than the measured reduce-scatter scale their per-CTA rate by their kind factor;
        the cap is the links', the same for every kind. Kareus's MSCCL++ kernels
        (:meth:`collective_bandwidth` with ``"mscclpp"``) are calibrated separately. An all-to-all
        runs on its two lanes (:meth:`collective_bandwidth`), its NVLink lane on this per-CTA rate.
        """
        if collective.kind == "all_to_all":
            return self.collective_bandwidth(collective, ctas, clock_mhz, "nccl")
        p = self.params
        per_cta = self.comm_per_sm_rate(collective.kind, collective.group_size - 1, "nccl")
        cap = min(p.nccl_bus_bw_cap_bytes_per_s, self.spec.nvlink_bandwidth_bytes_per_s)
        return smooth_min(per_cta * self.comm_clock_scale(clock_mhz) * ctas, cap, p.comm_knee)

    def all_to_all_nvlink_bandwidth(self, peers: int, sms: int, clock_mhz: float, library: CommLibrary) -> float:
        """Bytes/s an all-to-all's NVLink lane moves on ``sms`` SMs with ``peers`` other ranks on the
        node: the library's per-SM rate, smoothly capped at ``all_to_all_nvlink_efficiency`` x NVLink
        (:mod:`~kareus_fx.cost_models.all_to_all`)."""
        p = self.params
        per_sm = self.comm_per_sm_rate("all_to_all", peers, library)
        cap = p.all_to_all_nvlink_efficiency * self.spec.nvlink_bandwidth_bytes_per_s
        return smooth_min(per_sm * self.comm_clock_scale(clock_mhz) * sms, cap, p.comm_knee)

    def all_to_all_network_bandwidth(self) -> float:
        """Bytes/s an all-to-all's off-node lane moves: ``all_to_all_network_efficiency`` x the GPU's
        share of its node's network (no SM or clock dependence: the NIC moves the bytes)."""
        share = self.spec.node_network_share_bytes_per_s
        if share is None:
            raise ValueError(f"no node network is known for the {self.spec.name}: an all-to-all across nodes")
        return self.params.all_to_all_network_efficiency * share

    def all_to_all_lane_time_s(
        self, nvlink_bytes: float, network_bytes: float, peers: int, sms: int, clock_mhz: float, library: CommLibrary
    ) -> float:
        """Seconds for ``nvlink_bytes`` over NVLink and ``network_bytes`` to other nodes, moved at
        once (the slower lane), without the latency."""
        nvlink_s = (
            nvlink_bytes / self.all_to_all_nvlink_bandwidth(peers, sms, clock_mhz, library) if nvlink_bytes > 0 else 0.0
        )
        network_s = network_bytes / self.all_to_all_network_bandwidth() if network_bytes > 0 else 0.0
        return max(nvlink_s, network_s)

    def collective_latency_s(self, collective: CollectiveSpec) -> float:
        """Fixed cost of a collective: ``all_to_all_latency_s`` for an all-to-all, else ``comm_latency_s``."""
        p = self.params
        return p.all_to_all_latency_s if collective.kind == "all_to_all" else p.comm_latency_s

    def collective_time(
        self, collective: CollectiveSpec, sms: int, clock_mhz: float, library: CommLibrary = "mscclpp"
    ) -> float:
        """Standalone time of a collective on ``sms`` SMs: fixed latency plus bytes over bandwidth."""
        bus = self.bus_bytes(collective)
        if bus <= 0.0:
            return 0.0
        # A fused collective is one kernel (paper section 4.5): one latency for all its parts.
        return self.collective_latency_s(collective) + bus / self.collective_bandwidth(
            collective, sms, clock_mhz, library
        )
