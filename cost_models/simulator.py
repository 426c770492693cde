"""The simulated GPU: time and energy of a partition under a (clock, comm SMs, launch slot) schedule.

Two lanes on one GPU, the way the paper's Figure 3 draws them:
- the compute lane runs the partition's kernels in slot order, each after a fixed launch gap (the
  ops of one fused kernel, ``OpCost.kernel``, run as one kernel);
- the communication lane runs the collective (with its ``comm_library``: NCCL's measured curve or
  the MSCCL++ kernel's, :meth:`KernelModel.collective_bandwidth`), started when the compute lane reaches the launch
  slot (``launch_slot=None``: after the last slot, i.e. sequential execution: the collective
  alone with its SMs while the other SMs idle).

The timeline is event driven: whenever the set of running kernels changes (a kernel starts or
ends, the collective starts, leaves its latency phase or ends) the rates are recomputed:
- a compute kernel beside the collective has ``sm_count - comm_sms`` SMs (wave quantisation);
- a memory-bound kernel and the collective share HBM bandwidth: if their demands exceed it both
  slow proportionally, and the collective also slows with the HBM draw of the kernel beside it
  (its requests queue behind the kernel's: ``comm_contention`` per unit of HBM utilisation beside a
  memory-bound kernel, ``comm_contention_compute`` beside a compute-bound one);
- exposed communication (the collective alone) leaves the other SMs idle while static and busy
  power keep being drawn.

Energy comes from :mod:`power_model`. The power cap acts on average power (the GPU's power
controller averages over milliseconds, longer than a kernel). When an execution's average power at
the requested clock exceeds the TDP, the clock throttles: it moves in the GPU's clock steps
(``spec.clock_step_mhz``) up and down around a centre level, never above the requested clock
(:meth:`PowerModel.throttle_swing`: each level of the swing held equally long, half-width
``throttle_swing_mhz``, clipped to the requested clock and the minimum clock). The centre is the
level whose swing's average power meets the TDP. Time follows the average clock (the centre: paper
Appendix A, assumption 3); dynamic energy follows the clock's distribution (the swing's average
dynamic power x that time), which by Jensen's inequality costs more than a steady clock with the
same average (Appendix A, theorem 1): a throttled execution runs slower than a steady clock at the
TDP would, at the same power. A swing of 0 is the steady clock at the TDP. Static energy is the
spec's static power x time; dynamic energy is the rest (docs/design.md).

Kernel rates and whole lanes are cached per clock and SM count: a call costs tens of
microseconds once the caches are warm.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kareus_fx.cost_models.hardware import DEFAULT_GPU, GPUSpec
from kareus_fx.cost_models.kernel_model import KernelModel
from kareus_fx.cost_models.power_model import ZERO_TERMS, EnergyTerms, PowerModel
from kareus_fx.cost_models.sim_params import SimParams, gpu_params
from kareus_fx.workload import (
    CollectiveSpec,
    CommLibrary,
    Measurement,
    OpCost,
    PartitionConfig,
    PartitionType,
    fused_kernels,
)

_INF = math.inf
_CACHE_LIMIT = 100_000


@dataclass(frozen=True)
class Segment:
    """One interval of a simulated timeline (for plots and debugging)."""

    start_s: float
    end_s: float
    compute: str | None
    """Compute kernel running, ``"gap"`` in a launch gap or tail, None when the lane waits or is done."""
    comm: bool


@dataclass(frozen=True)
class Prediction:
    """A simulated execution: the measurement plus what produced it."""

    measurement: Measurement
    clock_mhz: float
    """Time-averaged SM clock: the requested one, or lower where the power cap throttled."""
    throttled: bool
    terms: EnergyTerms
    exposed_comm_s: float
    """Time the collective ran with no compute kernel beside it."""
    timeline: tuple[Segment, ...] = ()


@dataclass(frozen=True)
class _Phase:
    """One kernel (or idle item) at one clock with a given number of SMs."""

    time_s: float
    busy_frac: float
    """SMs holding its CTAs / all SMs (its weight in HBM sharing)."""
    hbm_bytes_per_s: float
    contention_per_byte_s: float = 0.0
    """Collective slowdown per HBM byte/s this kernel draws (its contention / the saturation)."""
    active_frac: float | None = None
    """SMs holding its CTAs averaged over its time / all SMs (what draws SM-active power:
    ``KernelRates.powered_sms``); None: ``busy_frac``."""

    @property
    def powered_frac(self) -> float:
        return self.busy_frac if self.active_frac is None else self.active_frac


@dataclass(frozen=True)
class _Structure:
    """A partition's kernels in lane order; ``slot_start[j]`` is the first kernel of slot j."""

    kernels: tuple[OpCost, ...]
    slot_start: tuple[int, ...]
    flops: float
    bytes: float


@dataclass(frozen=True)
class _Lane:
    """Per-item data of a compute lane at one clock and comm SM count (items: gaps and kernels)."""

    kernel_of: tuple[int, ...]
    """Kernel index of each item, -1 for an idle item (launch gap, tail)."""
    first_item: tuple[int, ...]
    """Item at which kernel k's launch begins (its gap); the last entry: after the last kernel."""
    alone: tuple[_Phase, ...]
    shared: tuple[_Phase, ...]
    """Each item with every SM, and beside the collective."""
    cum_time: tuple[float, ...]
    cum_busy: tuple[float, ...]
    """Prefix sums over the alone items of time and of SM-busy seconds (busy fraction x time)."""


@dataclass
class _Run:
    terms: EnergyTerms
    exposed_comm_s: float
    segments: list[Segment] | None = None


class Simulator:
    """Predicts partitions, sequences of ops and whole microbatches on one GPU model.

    ``gpu`` is a GPU name (its calibrated parameters are loaded) or a :class:`GPUSpec` (then give
    ``params``; otherwise the default GPU's calibrated values are used unchanged).
    """

    def __init__(self, gpu: str | GPUSpec = DEFAULT_GPU, params: SimParams | None = None) -> None:
        if isinstance(gpu, GPUSpec):
            spec = gpu
            if params is None:
                params = gpu_params(DEFAULT_GPU).params
        else:
            loaded = gpu_params(gpu)
            spec = loaded.spec
            params = params if params is not None else loaded.params
        self.spec = spec
        self.params = params
        self.kernels = KernelModel(spec, params)
        self.power = PowerModel(spec, params)
        self._sat = self.kernels.hbm_saturation_bytes_per_s
        self._phases: dict[tuple, _Phase] = {}
        self._caps: dict[tuple, float] = {}
        self._structures: dict[int, tuple[PartitionType, _Structure]] = {}
        self._lanes: dict[tuple, _Lane] = {}
        self._cap_clocks: dict[tuple, tuple[float, float]] = {}
        self._search_powers: dict[float, float] = {}
        """Average power per clock level during one throttle-centre search (``_level_power_w``)."""

    # ----- public API ------------------------------------------------------------------------
    def measure(self, ptype: PartitionType, config: PartitionConfig) -> Measurement:
        """Time and energy of one partition (the :class:`~kareus_fx.workload.Profiler` shape)."""
        return self.predict(ptype, config).measurement

    def predict(
        self,
        ptype: PartitionType,
        config: PartitionConfig,
        *,
        timeline: bool = False,
        join_slot: int | None = None,
        launch_gap_s: float = 0.0,
        comm_rate_scale: float = 1.0,
        tail_s: float = 0.0,
    ) -> Prediction:
        """Simulate one partition under ``config``.

        The keyword-only options after ``timeline`` describe measurement harnesses rather than the
        partitioned-overlap runtime: ``join_slot`` makes that slot wait for the collective (an
        overlap window that ends early); ``launch_gap_s`` idles the GPU when the collective is
        launched and again after a join (host synchronisations); ``comm_rate_scale`` scales the
        collective's per-SM rate (another CTA size); ``tail_s`` idles the compute lane after its
        last kernel (host work at the end of an iteration) while the collective may go on.
        """
        self._check_config(ptype, config)
        n_slots = len(ptype.slots)
        launch = n_slots if config.launch_slot is None else config.launch_slot
        if join_slot is not None and not launch <= join_slot <= n_slots:
            raise ValueError(f"join_slot {join_slot} must lie between the launch slot {launch} and {n_slots}")
        structure = self._structure(ptype)
        first = structure.slot_start[launch]
        join = None if join_slot is None else structure.slot_start[join_slot]

        def run(clock: float) -> _Run:
            return self._timeline(
                structure,
                ptype.collective,
                clock,
                config.comm_sms,
                first,
                join,
                launch_gap_s,
                comm_rate_scale,
                timeline,
                tail_s,
                config.comm_library,
            )

        key = (id(structure), config.comm_sms, config.comm_library, first, join, launch_gap_s, comm_rate_scale, tail_s)
        return self._finish(run, float(config.clock_mhz), key)

    def predict_sequence(
        self,
        ops: Sequence[OpCost],
        collectives: Sequence[CollectiveSpec] = (),
        clock_mhz: float | None = None,
        comm_sms: int | None = None,
        comm_library: CommLibrary = "nccl",
    ) -> Prediction:
        """Non-partitioned work: ``ops`` in order, then each collective alone (``comm_sms`` each,
        with ``comm_library``: NCCL's default channels unless told otherwise)."""
        clock, sms = self._defaults(clock_mhz, comm_sms)
        kernels, collectives = fused_kernels(ops), list(collectives)  # fused once, run at every searched clock
        return self._finish(lambda f: self._sequence_run(kernels, collectives, f, sms, comm_library), clock)

    def predict_sequence_async(
        self,
        ops: Sequence[OpCost],
        collectives: Sequence[CollectiveSpec],
        beside: Iterable[PartitionType],
        clock_mhz: float | None = None,
        comm_sms: int | None = None,
        comm_library: CommLibrary = "nccl",
    ) -> Prediction:
        """:meth:`predict_sequence` of ``ops`` and ``collectives``, then each of ``beside``
        ``count`` times with its collective launched before its kernels (a framework's
        asynchronous collective beside independent work: Transformer Engine's input-gradient
        all-reduce beside the weight-gradient GEMM, ``kareus_fx/frameworks/megatron_async_dgrad.py``), all on
        ``comm_sms`` SMs with ``comm_library``, under one power cap."""
        clock, sms = self._defaults(clock_mhz, comm_sms)
        kernels, rest, pairs = fused_kernels(ops), list(collectives), list(beside)

        def run(f: float) -> _Run:
            alone = self._sequence_run(kernels, rest, f, sms, comm_library)
            terms, exposed = alone.terms, alone.exposed_comm_s
            for pt in pairs:
                part = self._timeline(
                    self._structure(pt), pt.collective, f, sms, 0, None, 0.0, 1.0, False, 0.0, comm_library
                )
                terms = terms + part.terms.scaled(pt.count)
                exposed += part.exposed_comm_s * pt.count
            return _Run(terms, exposed)

        return self._finish(run, clock)

    def predict_microbatch(
        self,
        ptypes: Iterable[PartitionType],
        clock_mhz: float | None = None,
        comm_sms: int | None = None,
        other_ops: Sequence[OpCost] = (),
        other_collectives: Sequence[CollectiveSpec] = (),
        comm_library: CommLibrary = "nccl",
    ) -> Prediction:
        """A whole microbatch in sequential mode at one clock: every partition type ``count`` times
        (computation, then its collective alone), plus the non-partitioned ops and collectives."""
        clock, sms = self._defaults(clock_mhz, comm_sms)
        ptypes, other_kernels, other_collectives = list(ptypes), fused_kernels(other_ops), list(other_collectives)

        def run(f: float) -> _Run:
            terms, exposed = ZERO_TERMS, 0.0
            for pt in ptypes:
                structure = self._structure(pt)
                part = self._timeline(
                    structure, pt.collective, f, sms, len(structure.kernels), None, 0.0, 1.0, False, 0.0, comm_library
                )
                terms = terms + part.terms.scaled(pt.count)
                exposed += part.exposed_comm_s * pt.count
            rest = self._sequence_run(other_kernels, other_collectives, f, sms, comm_library)
            return _Run(terms + rest.terms, exposed + rest.exposed_comm_s)

        return self._finish(run, clock)

    def with_noise(self, measurement: Measurement, rng: np.random.Generator, noise_std: float) -> Measurement:
        """A measurement as a noisy profiler would report it: log-normal time and power noise of
        relative size ``noise_std``; static energy follows the noisy time."""
        if noise_std <= 0.0:
            return measurement
        time_factor, power_factor = np.exp(rng.normal(0.0, noise_std, size=2))
        time_s = measurement.time_s * float(time_factor)
        static = self.power.static_energy_j(time_s)
        energy = max(measurement.energy_j * float(time_factor * power_factor), static)
        return Measurement(time_s, energy, energy - static, static)

    # ----- phases: one kernel at one clock ---------------------------------------------------
    def _phase(self, op: OpCost, sms: int, clock: float) -> _Phase:
        key = (op.flops, op.bytes, sms, clock)
        phase = self._phases.get(key)
        if phase is None:
            r = self.kernels.kernel(op.flops, op.bytes, sms, clock)
            phase = _Phase(
                r.time_s,
                r.busy_sms / self.spec.sm_count,
                r.hbm_bytes_per_s,
                self.kernels.comm_contention(r.memory_share) / self._sat,
                r.powered_sms / self.spec.sm_count,
            )
            if len(self._phases) > _CACHE_LIMIT:
                self._phases.clear()
            self._phases[key] = phase
        return phase

    # ----- the power cap ------------------------------------------------------------------------
    def _finish(self, run: Callable[[float], _Run], clock: float, key: tuple | None = None) -> Prediction:
        """Run at ``clock``; if the average power exceeds the TDP, throttled (module docstring).

        The throttled centre depends on the requested clock only through the swing's clip, so it
        is cached under ``key`` (the schedule without its clock) and the requested clock, and under
        ``key`` alone once the swing is not clipped (any request at least the swing above the
        centre throttles the same: one timeline, not a search).
        """
        if key is not None:
            unclipped = self._cap_clocks.get(key)
            if unclipped is not None and clock > unclipped[0] + self.params.throttle_swing_mhz:
                return self._throttled(run, *unclipped)
            cached = self._cap_clocks.get((key, clock))
            if cached is not None:
                return self._throttled(run, *cached)
        result = run(clock)
        if self._average_power(result.terms) <= self.spec.tdp_w:
            return self._package(result)
        throttle = self._throttle_centre(run, clock)
        if key is not None:
            if len(self._cap_clocks) > _CACHE_LIMIT:
                self._cap_clocks.clear()
            unclipped_request = clock >= throttle[0] + self.params.throttle_swing_mhz
            self._cap_clocks[key if unclipped_request else (key, clock)] = throttle
        return self._throttled(run, *throttle)

    def _throttle_centre(self, run: Callable[[float], _Run], requested_mhz: float) -> tuple[float, float]:
        """(centre MHz, average power W) of an execution throttled at the TDP: the centre whose
        swing's average power meets the TDP (bisection to 0.5 MHz), where the power is the TDP; or
        the minimum clock, over the TDP even there, with its swing's power."""
        tdp = self.spec.tdp_w
        self._search_powers = {}
        lo, hi = float(self.spec.clock_min_mhz), requested_mhz
        lowest_w = self._swing_power_w(run, lo, requested_mhz)
        if lowest_w >= tdp:
            return lo, lowest_w
        while hi - lo > 0.5:
            mid = 0.5 * (lo + hi)
            if self._swing_power_w(run, mid, requested_mhz) > tdp:
                hi = mid
            else:
                lo = mid
        return lo, tdp

    def _swing_power_w(self, run: Callable[[float], _Run], centre_mhz: float, requested_mhz: float) -> float:
        """Average power of the throttle swing around ``centre_mhz`` (each level equally long); a
        swing with no room (one level) is the steady clock, simulated at the centre itself."""
        levels = self.power.throttle_swing(centre_mhz, requested_mhz)
        if len(levels) == 1:
            return self._average_power(run(centre_mhz).terms)
        return sum(weight * self._level_power_w(run, level) for level, weight in levels)

    def _level_power_w(self, run: Callable[[float], _Run], clock_mhz: float) -> float:
        """Average power at ``clock_mhz``, linear between the GPU's clock levels (the clocks a
        throttling GPU runs at), each simulated once per search (``_search_powers``)."""
        step, lowest = self.spec.clock_step_mhz, self.spec.clock_min_mhz
        position = (clock_mhz - lowest) / step
        below = math.floor(position)
        frac = position - below

        def at(level: float) -> float:
            power = self._search_powers.get(level)
            if power is None:
                power = self._search_powers[level] = self._average_power(run(level).terms)
            return power

        low_w = at(float(lowest + below * step))
        return low_w if frac < 1e-9 else low_w + frac * (at(float(lowest + (below + 1) * step)) - low_w)

    def _throttled(self, run: Callable[[float], _Run], centre_mhz: float, power_w: float) -> Prediction:
        """The execution throttled around ``centre_mhz``: time and terms at the centre; dynamic
        energy = (the swing's average power ``power_w`` - static) x time."""
        result = run(centre_mhz)
        dynamic_w = power_w - self.spec.static_power_w
        return self._package(result, throttled_dynamic_j=dynamic_w * result.terms.time_s)

    def _average_power(self, terms: EnergyTerms) -> float:
        return self.power.energy_j(terms) / terms.time_s if terms.time_s > 0 else 0.0

    # ----- lanes and timelines -----------------------------------------------------------------
    def _structure(self, ptype: PartitionType) -> _Structure:
        """The partition's kernels in lane order (cached per partition-type object)."""
        hit = self._structures.get(id(ptype))
        if hit is not None and hit[0] is ptype:
            return hit[1]
        per_slot = [fused_kernels(slot.ops) for slot in ptype.slots]
        kernels = tuple(kernel for slot in per_slot for kernel in slot)
        starts = [0]
        for slot in per_slot:
            starts.append(starts[-1] + len(slot))
        structure = _Structure(kernels, tuple(starts), sum(op.flops for op in kernels), sum(op.bytes for op in kernels))
        if len(self._structures) > 4096:
            # Lanes and cap clocks are keyed by structure ids, which are unique only while the
            # structures are held here: forget them together.
            self._structures.clear()
            self._lanes.clear()
            self._cap_clocks.clear()
        self._structures[id(ptype)] = (ptype, structure)
        return structure

    def _lane(self, structure: _Structure, clock: float, comm_sms: int, tail_s: float) -> _Lane:
        """Per-item phases of a lane: each kernel preceded by its launch gap, then the tail."""
        key = (id(structure), clock, comm_sms, tail_s)
        lane = self._lanes.get(key)
        if lane is not None:
            return lane
        sm_count = self.spec.sm_count
        gap = self.params.kernel_overhead_s
        kernel_of: list[int] = []
        first_item: list[int] = []
        alone: list[_Phase] = []
        shared: list[_Phase] = []

        def idle(seconds: float) -> None:
            kernel_of.append(-1)
            alone.append(_Phase(seconds, 0.0, 0.0))
            shared.append(alone[-1])

        for k, op in enumerate(structure.kernels):
            first_item.append(len(kernel_of))
            if gap > 0.0:
                idle(gap)
            kernel_of.append(k)
            alone.append(self._phase(op, sm_count, clock))
            shared.append(self._phase(op, sm_count - comm_sms, clock))
        first_item.append(len(kernel_of))
        if tail_s > 0.0:
            idle(tail_s)
        lane = _Lane(
            tuple(kernel_of),
            tuple(first_item),
            tuple(alone),
            tuple(shared),
            tuple(itertools.accumulate((a.time_s for a in alone), initial=0.0)),
            tuple(itertools.accumulate((a.time_s * a.powered_frac for a in alone), initial=0.0)),
        )
        if len(self._lanes) > _CACHE_LIMIT:
            self._lanes.clear()
        self._lanes[key] = lane
        return lane

    def _timeline(
        self,
        structure: _Structure,
        coll: CollectiveSpec,
        clock: float,
        comm_sms: int,
        first: int,
        join: int | None,
        launch_gap_s: float,
        comm_rate_scale: float,
        record: bool,
        tail_s: float = 0.0,
        library: CommLibrary = "mscclpp",
    ) -> _Run:
        """Compute lane (kernels in order, each after its launch gap) and comm lane (the collective,
        launched when the lane reaches kernel ``first``). The lane may not start kernel ``join``
        before the collective ends. ``tail_s`` idles the lane after its last kernel (the collective
        may still run then). The execution ends when both lanes are done."""
        p = self.params
        sm_count = self.spec.sm_count
        bus = self.kernels.bus_bytes(coll)
        bandwidth = (
            self.kernels.collective_bandwidth(coll, comm_sms, clock, library) * comm_rate_scale if bus > 0 else 0.0
        )
        lane = self._lane(structure, clock, comm_sms, tail_s)
        kernels = structure.kernels
        kernel_of = lane.kernel_of
        n_items = len(kernel_of)
        start_item = lane.first_item[first]
        join_item = None if join is None else lane.first_item[join]
        segs: list[Segment] | None = [] if record else None

        def record_alone(t0: float, lo: int, hi: int) -> None:
            if segs is None:
                return
            for j in range(lo, hi):
                dur = lane.alone[j].time_s
                if dur > 0.0:
                    k = kernel_of[j]
                    segs.append(Segment(t0, t0 + dur, "gap" if k < 0 else kernels[k].name, False))
                t0 += dur

        # 1. Lane items before the launch, every SM for the compute kernels.
        record_alone(0.0, 0, start_item)
        t = lane.cum_time[start_item]
        busy = lane.cum_busy[start_item]  # integral of busy SMs / all SMs
        comm_busy = 0.0  # integral of the collective's SMs / all SMs

        # 2. The collective runs; the lane goes on beside it with the remaining SMs.
        exposed = 0.0
        i = start_item
        if bus > 0.0:
            if launch_gap_s > 0.0:  # host synchronisation before the launch: the GPU idles
                if segs is not None:
                    segs.append(Segment(t, t + launch_gap_s, None, False))
                t += launch_gap_s
            comm_frac = comm_sms / sm_count
            latency = self.kernels.collective_latency_s(coll)
            remaining = bus
            comm_weight = p.comm_request_weight * comm_frac
            hbm_per_bus = p.comm_hbm_bytes_per_bus_byte
            offered = hbm_per_bus * bandwidth
            sat = self._sat
            shared = lane.shared
            stop = n_items if join_item is None else min(join_item, n_items)
            frac = 1.0  # share of the current item still to do
            while True:
                blocked = i >= stop
                if blocked:
                    lane_rate = k_busy = k_powered = k_demand = kappa_per_demand = 0.0
                else:
                    ph = shared[i]
                    lane_rate = 1.0 / ph.time_s if ph.time_s > 0.0 else _INF
                    k_busy, k_demand, kappa_per_demand = ph.busy_frac, ph.hbm_bytes_per_s, ph.contention_per_byte_s
                    k_powered = ph.powered_frac
                if latency > 0.0:
                    comm_rate = 0.0
                    comm_t = latency
                else:
                    # Requests queue behind the kernel's: the collective slows with its HBM draw.
                    comm_rate = bandwidth / (1.0 + kappa_per_demand * k_demand)
                    if k_demand + offered > sat:
                        # Over the HBM bandwidth: weighted max-min fair shares between the kernel
                        # and the requests the collective's SMs issue (its offered load, whatever
                        # it achieves); weights = the SMs issuing them.
                        k_share = sat * k_busy / (k_busy + comm_weight)
                        if k_demand <= k_share:
                            k_alloc = k_demand
                        else:
                            k_alloc = sat - offered if offered <= sat - k_share else k_share
                        lane_rate *= k_alloc / k_demand
                        if hbm_per_bus * comm_rate > sat - k_alloc:
                            comm_rate = (sat - k_alloc) / hbm_per_bus
                    comm_t = remaining / comm_rate
                lane_t = _INF if blocked else (frac / lane_rate if lane_rate < _INF else 0.0)
                dt = comm_t if comm_t < lane_t else lane_t
                if blocked or kernel_of[i] < 0:
                    exposed += dt
                if segs is not None and dt > 0.0:
                    name = None if blocked else ("gap" if kernel_of[i] < 0 else kernels[kernel_of[i]].name)
                    segs.append(Segment(t, t + dt, name, True))
                t += dt
                busy += k_powered * dt
                comm_busy += comm_frac * dt
                if lane_t <= comm_t:
                    i, frac = i + 1, 1.0
                elif not blocked:
                    frac -= lane_rate * dt
                if comm_t <= lane_t:
                    if latency > 0.0:
                        latency = 0.0
                    else:
                        break
                elif latency > 0.0:
                    latency -= dt
                else:
                    remaining -= comm_rate * dt
            # The item the collective ended in finishes alone; a join waits out the host gap.
            if join_item is not None and i >= join_item:
                if launch_gap_s > 0.0 and i < n_items:
                    if segs is not None:
                        segs.append(Segment(t, t + launch_gap_s, None, False))
                    t += launch_gap_s
            elif i < n_items and frac < 1.0:
                a = lane.alone[i]
                dur = max(frac, 0.0) * a.time_s
                if segs is not None and dur > 0.0:
                    k = kernel_of[i]
                    segs.append(Segment(t, t + dur, "gap" if k < 0 else kernels[k].name, False))
                t += dur
                busy += dur * a.powered_frac
                i += 1

        # 3. The rest of the lane, every SM again.
        record_alone(t, i, n_items)
        t += lane.cum_time[n_items] - lane.cum_time[i]
        busy += lane.cum_busy[n_items] - lane.cum_busy[i]
        return _Run(
            self._terms(
                clock, t, busy, structure.flops, structure.bytes + p.comm_hbm_bytes_per_bus_byte * bus, bus, comm_busy
            ),
            exposed,
            segs,
        )

    def _terms(
        self,
        clock: float,
        time_s: float,
        busy_s: float,
        flops: float,
        hbm_bytes: float,
        link_bytes: float,
        comm_busy_s: float = 0.0,
    ) -> EnergyTerms:
        """Energy terms of an execution at one clock (everything ran at that clock); ``busy_s`` and
        ``comm_busy_s``: SM-seconds (as a share of all SMs) of the compute kernels and of the collectives."""
        v = self.power.voltage(clock)
        scale = clock / self.spec.clock_max_mhz * v * v
        return EnergyTerms(
            time_s,
            scale * time_s,
            scale * busy_s,
            v * v * flops,
            hbm_bytes,
            link_bytes,
            clock * time_s,
            scale * comm_busy_s,
        )

    def _sequence_run(
        self,
        kernels: Sequence[OpCost],
        collectives: Sequence[CollectiveSpec],
        clock: float,
        sms: int,
        library: CommLibrary = "nccl",
    ) -> _Run:
        """Kernels (``fused_kernels`` of the ops) in order on every SM, then each collective alone
        on ``sms`` SMs with ``library``. The caller fuses once: a throttled run is simulated at many clocks."""
        sm_count = self.spec.sm_count
        gap = self.params.kernel_overhead_s
        t = busy = comm_busy = flops = nbytes = link = exposed = 0.0
        for op in kernels:
            ph = self._phase(op, sm_count, clock)
            t += gap + ph.time_s
            busy += ph.powered_frac * ph.time_s
            flops += op.flops
            nbytes += op.bytes
        for coll in collectives:
            dur = self.kernels.collective_time(coll, sms, clock, library)
            bus = self.kernels.bus_bytes(coll)
            t += dur
            exposed += dur
            comm_busy += dur * sms / sm_count
            nbytes += self.params.comm_hbm_bytes_per_bus_byte * bus
            link += bus
        return _Run(self._terms(clock, t, busy, flops, nbytes, link, comm_busy), exposed)

    def _package(self, run: _Run, throttled_dynamic_j: float | None = None) -> Prediction:
        """The prediction of ``run``; a throttled run's dynamic energy is given (``_throttled``)."""
        terms = run.terms
        static = self.power.static_energy_j(terms.time_s)
        dynamic = self.power.dynamic_energy_j(terms) if throttled_dynamic_j is None else throttled_dynamic_j
        measurement = Measurement(terms.time_s, static + dynamic, dynamic, static)
        timeline = tuple(run.segments) if run.segments else ()
        return Prediction(
            measurement, terms.average_clock_mhz, throttled_dynamic_j is not None, terms, run.exposed_comm_s, timeline
        )

    # ----- argument checks --------------------------------------------------------------------
    def _defaults(self, clock_mhz: float | None, comm_sms: int | None) -> tuple[float, int]:
        clock = float(self.spec.clock_max_mhz if clock_mhz is None else clock_mhz)
        sms = self.params.default_comm_sms if comm_sms is None else comm_sms
        self._check_clock(clock)
        self._check_sms(sms)
        return clock, sms

    def _check_clock(self, clock: float) -> None:
        if not self.spec.clock_min_mhz <= clock <= self.spec.clock_max_mhz:
            raise ValueError(
                f"clock {clock} MHz outside {self.spec.name}'s range "
                f"{self.spec.clock_min_mhz}-{self.spec.clock_max_mhz} MHz"
            )

    def _check_sms(self, sms: int) -> None:
        if not 1 <= sms < self.spec.sm_count:
            raise ValueError(f"comm_sms {sms} must be between 1 and {self.spec.sm_count - 1} on {self.spec.name}")

    def _check_config(self, ptype: PartitionType, config: PartitionConfig) -> None:
        self._check_clock(config.clock_mhz)
        self._check_sms(config.comm_sms)
        if config.launch_slot is not None and not 0 <= config.launch_slot < len(ptype.slots):
            raise ValueError(
                f"launch_slot {config.launch_slot} outside the partition's "
                f"{len(ptype.slots)} slots (None means sequential)"
            )
