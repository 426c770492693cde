"""What to plan: the request (:class:`PlanRequest`), the presets' requests and the checks that refuse
a request that cannot be planned, before any tracing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kareus_fx.capture.tracing import TraceSpec, validate_trace_spec
from kareus_fx.compose.pipeline_schedule import CompositionError, check_interleaving
from kareus_fx.cost_models.hardware import DEFAULT_GPU, canonical_gpu_name
from kareus_fx.errors import OptionsError, ParallelConfigError
from kareus_fx.frameworks.megatron_settings import HF_DEFAULTS, MegatronSettings
from kareus_fx.frameworks.registry import get_framework
from kareus_fx.models.configs import get_config
from kareus_fx.plan.presets import Preset, get_preset
from kareus_fx.plan.profiler_capabilities import profiler_capabilities
from kareus_fx.tuner.space import DEFAULT_CLOCK_STRIDE_MHZ

PROFILERS = ("simulated", "cuda", "cpu-replay")
DISTRIBUTED_PROFILERS = ("cpu-replay", "cuda")
"""Profilers that run over torch.distributed (``distributed_plan.py``); cuda also on one GPU alone."""


LIVE_GRAPH_MODEL = "live-graph"
"""``PlanRequest.model`` of a plan made from a live graph (``kareus_fx.plan.live_tuning``): no reference
model, so its layer count is unknown (``workload.layers`` is null)."""
CLOCK_MODES = ("real", "dry-run")
"""Clock modes of ``--profiler cuda``: lock each measured configuration's clock (``real``), or
leave the card's clock alone and only record the requests (``dry-run``)."""
DEFAULT_DEVICE_WINDOW_S = 5.0
MIN_DEVICE_WINDOW_S = 1.0
"""Energy windows of ``--profiler cuda`` (``--device-window``): 5 s by default (NVML's energy
counter error near 2 %); below 1 s NVML's ~100 ms counter update is more than a tenth of the window."""
STAGE_SPLITS = ("even", "balanced")
"""The named ``--stage-layers`` rules (see :attr:`PlanRequest.stage_layers`)."""


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: the workload, the GPU and how to tune."""

    model: str
    tp: int
    cp: int
    pp: int
    microbatches: int
    mbs: int
    seq: int
    layers: int | None = None
    gpu: str = DEFAULT_GPU
    profiler: str = "simulated"
    seed: int = 0
    clock_stride_mhz: int = DEFAULT_CLOCK_STRIDE_MHZ
    workers: int = 1
    preset: str | None = None
    dtype: str = "bfloat16"
    """Parameter and activation dtype of the traced model (a torch dtype name)."""
    launch_search: bool = True
    """False restricts every partition to launching its collective first (slot 0): an ablation
    that searches only clocks and SM counts (used to check that ``kareus bench`` catches it)."""
    clock_mode: str | None = None
    """``--profiler cuda`` only (see ``CLOCK_MODES``); None means ``real``."""
    device_window_s: float = DEFAULT_DEVICE_WINDOW_S
    """``--profiler cuda`` only: the least energy window of one measurement (NVML's energy counter
    updates about every 100 ms; 5 s keeps its error near 2 %)."""
    max_clock_only: bool = False
    """Kareus without frequency scaling (``--max-clock-only``, paper section 6.4): every microbatch
    runs at the GPU's maximum clock; only the kernel schedule (collective SMs, launch slot,
    execution-model switching) is tuned, at that clock. For a user who may not lock clocks: the
    plan says so (``max_clock_only`` in plan.json) and deployment requests no clock. The
    baselines are still composed at every clock (they are the plan's comparison)."""
    exact_min_cut: bool = False
    """Compose with lowtime's own min-cut (``--exact-min-cut``, the reference) instead of SciPy's
    Dinic (``compose.solver_loop``: the same cut up to lowtime's FP_ERROR tolerance)."""
    full_trace: bool = False
    """Trace every layer of each stage (``--full-trace``) instead of a slice extended to the stage's
    layer count (``layer_slice.py``). ``--profiler cuda`` always traces in full: it replays the
    dumps' recorded ops."""
    stage_layers: str | tuple[int, ...] = "even"
    """How the pipeline's stages split the decoder layers (``--stage-layers``): ``"even"`` (Megatron-LM's
    default), ``"balanced"`` (the split that evens out the stages' step times on the simulated GPU;
    ``stage_balance.py``; the emulation presets' default; the testbed presets give the artifact's
    15 + 13, ``megatron_settings.py``) or one count per stage. :func:`trace_plan_stages`
    resolves ``"balanced"`` to counts."""
    recompute: str = "none"
    """Activation checkpointing of the traced model (``--recompute``): ``"none"``, ``"full"`` (every
    decoder layer, Megatron-LM's full recompute; the presets' default, as the paper's testbed) or
    ``"selective"`` (core attention, Megatron-LM's selective recompute); see
    ``kareus_fx.models.recompute``. The backward graph then holds the recomputed forward."""
    dp: int = 1
    """Data-parallel replicas of the pipeline (``--dp``): each runs the same plan on its own data, so
    the plan's energies are ``dp`` times one pipeline's; times are one replica's (data-parallel
    gradient collectives, which the plan does not schedule, are outside it)."""
    ep: int = 1
    """Expert-parallel degree of a mixture-of-experts model (``--ep``): its expert all-to-alls run over
    ``ep`` GPUs, the TP groups of ``ep / tp`` data-parallel replicas of a stage (``dp`` must hold them)."""
    expert_imbalance: float = 1.0
    """The routing's token load on the busiest expert-parallel rank over the uniform share
    (``--expert-imbalance``): every rank is priced at that load, since the combine waits for it."""
    virtual_stages: int = 1
    """Model chunks per GPU (``--virtual-stages``): above 1 the pipeline runs interleaved 1F1B
    (``compose.pipeline_schedule``) over ``pp x virtual_stages`` global stages, GPU ``r`` holding stages ``r,
    r + pp, ...``; every stage-indexed field (``stage_layers``, the plan's ``stages``) counts global stages."""

    megatron: MegatronSettings = HF_DEFAULTS
    """The Megatron-LM framework's training settings outside the traced model (``megatron_settings.py``):
    tied embeddings, distributed optimizer (``step_tail.py``), dropout (``megatron_dropout.py``).
    The testbed presets carry the paper's artifact's; otherwise the traced model's tying, no
    distributed optimizer, no dropout."""

    framework: str | None = None
    """The training framework whose step the plan prices (``--framework``, a name of
    ``frameworks.registry.FRAMEWORKS``): what it adds to the traced model's step. None takes what the
    request implies: ``megatron-lm`` where ``megatron`` holds settings other than the defaults (the
    testbed presets), else ``traced-order`` (the traced model as it runs)."""

    calibrate_from: tuple[str, ...] = ()
    """Run logs (``--calibrate-from``, ``deploy/run_log.py``) whose measured over predicted medians
    rescale every price of the plan (``cost_models/run_calibration.py``); empty: the simulator's own."""

    compile_unit: str = "stage"
    """What the job compiles as one graph (``--compile-unit``): the whole stage (``"stage"``:
    ``torch.compile(stage_module)``) or each decoder layer (``"block"``: torchtitan's per-block
    compile, ``integrations.torchtitan.compile_blocks``). A block plan's graphs are one block's
    forward and backward (what deployment checks a live graph against); a stage costs its layer
    count times the block (``block_dump``), and the embedding, final norm, LM head and loss,
    which run un-compiled around the blocks, are not priced."""

    @property
    def world_size(self) -> int:
        """GPUs of one pipeline (tp x cp x pp); the job has ``dp`` times as many."""
        return self.tp * self.cp * self.pp

    @property
    def stage_group_size(self) -> int:
        """GPUs one stage's collectives span: its TP x CP grid, times the data-parallel replicas of
        its expert-parallel group (``ep / tp`` when ``ep > tp``)."""
        return self.tp * self.cp * max(1, self.ep // self.tp)

    @property
    def num_stages(self) -> int:
        """Global pipeline stages (model chunks): ``pp x virtual_stages``."""
        return self.pp * self.virtual_stages

    def trace_spec(self, stage: int = 0) -> TraceSpec:
        """The trace of stage ``stage``: an unresolved ``"balanced"`` split traces as the even one."""
        counts = self.stage_layers if isinstance(self.stage_layers, tuple) else None
        return TraceSpec(
            model=self.model,
            tp=self.tp,
            cp=self.cp,
            mbs=self.mbs,
            seq=self.seq,
            layers=self.layers,
            pp=self.num_stages,
            stage=stage,
            dtype=torch_dtype(self.dtype),
            stage_layers=counts,
            recompute=self.recompute,
            compile_unit=self.compile_unit,
            ep=self.ep,
            expert_imbalance=self.expert_imbalance,
        )


def plan_request_from_preset(name: str, **overrides: Any) -> PlanRequest:
    """The request of preset ``name`` (``kareus_fx.plan.presets``), with ``overrides`` applied."""
    p: Preset = get_preset(name)
    fields = {
        "model": p.model,
        "tp": p.tp,
        "cp": p.cp,
        "pp": p.pp,
        "virtual_stages": p.virtual_stages,
        "microbatches": p.microbatches,
        "mbs": p.mbs,
        "seq": p.seq,
        "preset": p.name,
        "stage_layers": p.stage_layers,
        "recompute": p.recompute,
        "dp": p.dp,
        "gpu": p.gpu,
        "megatron": p.megatron,
        "ep": p.ep,
        "expert_imbalance": p.expert_imbalance,
    }
    return PlanRequest(**{**fields, **overrides})


def validate_plan_request(req: PlanRequest) -> None:
    """Raise a clear error for a request that cannot be planned, before any tracing."""
    validate_tuning_request(req)
    if isinstance(req.dp, bool) or not isinstance(req.dp, int) or req.dp < 1:
        raise ParallelConfigError(f"--dp must be a number of data-parallel replicas (int >= 1), got {req.dp!r}")
    if isinstance(req.stage_layers, str) and req.stage_layers not in STAGE_SPLITS:
        raise ParallelConfigError(
            f"--stage-layers must be {' or '.join(STAGE_SPLITS)} or one layer count per "
            f"stage (e.g. 15,13), got {req.stage_layers!r}"
        )
    _validate_expert_parallel(req)
    validate_trace_spec(req.trace_spec())  # model, tp/cp/ep divisibility, seq, layers, pp, stage layers, unit
    if req.compile_unit == "block":
        _validate_block_request(req)


def _validate_expert_parallel(req: PlanRequest) -> None:
    """``--ep``: the expert-parallel group is the TP groups of ``ep / tp`` data-parallel replicas."""
    if isinstance(req.ep, bool) or not isinstance(req.ep, int) or req.ep < 1:
        raise ParallelConfigError(f"--ep must be an expert-parallel degree (int >= 1), got {req.ep!r}")
    if not req.expert_imbalance >= 1.0:
        raise ParallelConfigError(
            f"--expert-imbalance is the busiest rank's load over the uniform share, at least 1, got {req.expert_imbalance!r}"
        )
    moe = get_config(req.model).moe if req.model != LIVE_GRAPH_MODEL else None
    if req.stage_layers == "balanced" and moe is not None and moe.dense_layers:
        raise ParallelConfigError(
            f"--stage-layers balanced prices stages from slices of alike layers, but the first {moe.dense_layers} "
            f"layers of {req.model} are dense and the others sparse: give one layer count per stage (N,N,...) "
            "or even"
        )
    if req.ep == 1:
        return
    if req.profiler != "simulated":
        raise OptionsError(
            f"--ep {req.ep} with --profiler {req.profiler}: measuring expert all-to-alls on devices is not "
            "supported yet (the replay has no expert-parallel group); plan with --profiler simulated"
        )
    replicas = req.ep // req.tp if req.ep % req.tp == 0 else 0
    if replicas == 0 or req.dp % replicas:
        raise ParallelConfigError(
            f"--ep {req.ep} over --tp {req.tp} spans {req.ep / req.tp:g} data-parallel replicas of each stage, "
            f"which --dp {req.dp} must hold a whole number of times: use an --ep that is a multiple of --tp "
            f"and a --dp that is a multiple of --ep / --tp"
        )


def _validate_block_request(req: PlanRequest) -> None:
    """``--compile-unit block``: what a plan of one compiled block can price (``block_dump``)."""
    refused = [
        (
            not profiler_capabilities(req.profiler).prices_untraced_work,
            f"--profiler {req.profiler} (it replays a whole stage's recorded ops)",
        ),
        (req.recompute != "none", f"--recompute {req.recompute} (the checkpoint wraps the block from outside)"),
        (req.stage_layers == "balanced", "--stage-layers balanced (it prices the stages' slices)"),
    ]
    for refuse, what in refused:
        if refuse:
            raise OptionsError(
                f"--compile-unit block plans one compiled block, which does not support {what}; drop that "
                f"option (--profiler simulated, --recompute none, --stage-layers even or counts) or plan "
                f"--compile-unit stage"
            )


def validate_tuning_request(req: PlanRequest) -> None:
    """The checks that do not depend on tracing a reference model (also for live graphs)."""
    canonical_gpu_name(req.gpu)  # unknown GPU -> error listing the known ones
    if req.profiler not in PROFILERS:
        raise OptionsError(f"--profiler must be one of {', '.join(PROFILERS)}, got {req.profiler!r}")
    if req.profiler == "cuda":
        _validate_cuda_request(req)
    elif req.profiler == "cpu-replay" and req.workers != 1:
        raise OptionsError(
            f"--profiler cpu-replay measures with its process groups (--nproc or torchrun), not "
            f"tuning workers: use --workers 1 (got --workers {req.workers})"
        )
    elif req.clock_mode is not None:
        raise OptionsError(
            f"--clock-mode applies to --profiler cuda only (the {req.profiler} profiler sets no GPU clock); "
            "drop --clock-mode or add --profiler cuda"
        )
    elif req.device_window_s != DEFAULT_DEVICE_WINDOW_S:
        raise OptionsError(
            f"--device-window applies to --profiler cuda only (the {req.profiler} profiler reads no energy "
            "counter); drop --device-window or add --profiler cuda"
        )
    if req.microbatches < 1:
        raise ParallelConfigError(f"--microbatches must be a positive integer, got {req.microbatches}")
    if req.microbatches < req.pp:
        raise ParallelConfigError(
            f"{req.microbatches} microbatches cannot fill a {req.pp}-stage 1F1B pipeline (every stage "
            f"needs a microbatch in flight); use --microbatches >= {req.pp} or a smaller --pp"
        )
    try:
        check_interleaving(req.pp, req.virtual_stages, req.microbatches)
    except CompositionError as err:
        raise ParallelConfigError(f"--virtual-stages {req.virtual_stages}: {err}") from None
    torch_dtype(req.dtype)
    if req.framework is not None:
        get_framework(req.framework)  # unknown name -> error listing the frameworks
    if req.workers < 1 or req.clock_stride_mhz < 1:
        raise OptionsError("--workers and --clock-stride must be positive integers")
    if req.max_clock_only and req.clock_stride_mhz != DEFAULT_CLOCK_STRIDE_MHZ:
        raise OptionsError(
            f"--clock-stride sets the clocks Kareus tunes, but --max-clock-only tunes at the maximum clock "
            f"only: drop --clock-stride (got {req.clock_stride_mhz}) or --max-clock-only"
        )


def _validate_cuda_request(req: PlanRequest) -> None:
    """``--profiler cuda``: one process measuring on this machine's CUDA GPU, the one ``--gpu`` names."""
    if req.clock_mode is not None and req.clock_mode not in CLOCK_MODES:
        raise OptionsError(f"--clock-mode must be one of {', '.join(CLOCK_MODES)}, got {req.clock_mode!r}")
    if req.workers != 1:
        raise OptionsError(
            f"--profiler cuda measures on one GPU, one configuration at a time: use --workers 1 "
            f"(got --workers {req.workers})"
        )
    if not req.device_window_s >= MIN_DEVICE_WINDOW_S:
        raise OptionsError(
            f"--device-window must be at least {MIN_DEVICE_WINDOW_S:g} s (NVML's energy counter updates about "
            f"every 100 ms, so a shorter window reads energy with an error above 10 %), got {req.device_window_s:g}"
        )
    if not torch.cuda.is_available():
        raise OptionsError(
            "--profiler cuda measures on-device and needs a CUDA GPU, but this machine has none "
            "(torch.cuda.is_available() is False): plan here with --profiler simulated, or run "
            "kareus plan --profiler cuda on the GPU node"
        )
    family = canonical_gpu_name(req.gpu).split("-")[0]
    device = torch.cuda.get_device_name(0)
    if family not in device:
        raise OptionsError(
            f"--gpu {req.gpu} is a {family}, but this process's GPU is {device!r}: pass the --gpu of the "
            f"card that measures (e.g. --gpu h100), or select it with CUDA_VISIBLE_DEVICES"
        )


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` ("bfloat16", "float16", "float32")."""
    dtype = getattr(torch, name, None) if name in ("bfloat16", "float16", "float32") else None
    if dtype is None:
        raise OptionsError(f"dtype must be bfloat16, float16 or float32, got {name!r}")
    return dtype
