"""Partitioned-overlap structure of a nanobatched aten graph (paper sections 4.2 and 4.5).

Input: an aten forward or backward graph whose nodes carry ``kareus_cost`` (passes/analysis.py)
and a nanobatch label per node (0, 1, or None for work shared by both nanobatches).

1. Per nanobatch, its computation is cut into *segments* by its communications. A
   communication is one collective or several fused ones: collectives of the same kind and group
   issued before any computation that needs one of them (the K and V all-gathers of context
   parallelism). Computation that does not depend on an open communication is issued before it.
2. Issue order (the nanobatching baseline, "communication as soon as possible"):
   ``A.seg0, A.comm0, B.seg0, B.comm0, A.seg1, A.comm1, B.seg1, ...``: each communication is
   issued right after the segment that produces it, and the other nanobatch's next segment
   overlaps it.
3. A *partition* is one communication of one nanobatch plus the other nanobatch's segment that
   follows it in the issue order (the longest contiguous run of computation without a dependency
   on the communication, checked on a networkx graph of the aten graph).
4. Its computation is grouped into *launch slots*: one compute-bound kernel, or consecutive
   memory-bound kernels (kernels as Inductor fuses them, ``passes/kernel_groups.py``; the ops
   of one kernel that follow each other stay in one slot). Launch slots after which even the slowest idealised computation cannot hide
   the fastest idealised collective are excluded (appendix C); sequential execution is always a
   candidate (that is the tuner's business: ``launch_slot=None``).
5. Partitions with the same structure (ops, shapes, dtypes, collective kind, bytes and group)
   share a type. A partition whose structure occurs once but whose ops extend a repeating type's
   ops (the first layer's computation preceded by the embedding, the last followed by the output
   layer and loss) is trimmed to that type; the trimmed ops become leftovers.
6. Edge partitions: a type with fewer than half as many partitions as the graph's most frequent
   type is an edge of the repeating structure (first and last layers, embedding, output layer,
   loss); its partitions are dissolved and run sequentially as leftovers, as the paper does
   ("first and last partitions" belong to no partition). Tuning them would spend a type's whole
   search budget on a few percent of the microbatch.

Everything outside partitions (segments nothing overlaps, shared work, trimmed ops, edge
partitions) is the leftover, whose cost a microbatch must include.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import networkx as nx
import torch.fx

from kareus_fx.cost_models.hardware import GPUSpec
from kareus_fx.passes.analysis import META_KEY, CollectiveInfo, NodeCost, hinted, module_path
from kareus_fx.passes.kernel_groups import KERNEL_META
from kareus_fx.workload import CollectiveSpec, GraphName, OpCost, PartitionType, SlotSpec

PARTITION_META_KEY = "kareus_partition"
SLOT_META_KEY = "kareus_slot"
_ALGORITHM_TRAFFIC = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


@dataclass
class Communication:
    """One logical communication of one nanobatch: fused collectives and their waits."""

    nanobatch: int
    collectives: list[torch.fx.Node] = field(default_factory=list)

    @property
    def waits(self) -> list[torch.fx.Node]:
        return [user for c in self.collectives for user in c.users if _cost(user).kind == "wait"]


@dataclass
class NanobatchProgram:
    """A nanobatch's computation cut by its communications: ``len(segments) == len(comms) + 1``."""

    nanobatch: int
    segments: list[list[torch.fx.Node]]
    comms: list[Communication]


@dataclass
class Partition:
    """One communication and the other nanobatch's computation it overlaps."""

    partition_id: str
    comm: Communication
    slots: list[list[torch.fx.Node]]
    type_id: str = ""


@dataclass
class GraphPartitioning:
    """Everything the tuner and the cost of a microbatch need from one graph."""

    graph: GraphName
    partitions: list[Partition]
    types: dict[str, PartitionType]
    type_labels: dict[str, str]
    leftover: list[torch.fx.Node]
    issue_order: list[torch.fx.Node]


def build_programs(gm: torch.fx.GraphModule, labels: dict[torch.fx.Node, int | None]) -> list[NanobatchProgram]:
    """Segment both nanobatches' computation at their communications (step 1)."""
    return [_build_program(gm, labels, nanobatch) for nanobatch in (0, 1)]


def partition_graph(
    gm: torch.fx.GraphModule,
    labels: dict[torch.fx.Node, int | None],
    graph: GraphName,
    gpu: GPUSpec,
) -> GraphPartitioning:
    """Find partitions, launch slots and partition types of one analysed, labelled aten graph.

    Labels each node with ``node.meta["kareus_partition"]`` (partition id or None) and
    ``node.meta["kareus_slot"]`` (slot index within its partition, "comm" for its collectives).
    """
    programs = build_programs(gm, labels)
    depends_on = _collective_dependencies(_networkx_graph(gm))
    partitions = _pair_partitions(programs, depends_on, graph)
    issue_order = _issue_order(programs)
    partitions = _drop_edge_partitions(partitions)
    type_of, types, labels_by_type = _assign_types(partitions, graph, gpu)
    in_partition = {n for p in partitions for n in p.comm.collectives + p.comm.waits + [m for s in p.slots for m in s]}
    for node in gm.graph.nodes:
        node.meta[PARTITION_META_KEY] = None
        node.meta[SLOT_META_KEY] = None
    for partition in partitions:
        partition.type_id = type_of[partition.partition_id]
        for node in partition.comm.collectives + partition.comm.waits:
            node.meta[PARTITION_META_KEY] = partition.partition_id
            node.meta[SLOT_META_KEY] = "comm"
        for index, slot in enumerate(partition.slots):
            for node in slot:
                node.meta[PARTITION_META_KEY] = partition.partition_id
                node.meta[SLOT_META_KEY] = index
    leftover = [n for n in gm.graph.nodes if _cost(n).kind in ("compute", "collective") and n not in in_partition]
    return GraphPartitioning(
        graph=graph,
        partitions=partitions,
        types=types,
        type_labels=labels_by_type,
        leftover=leftover,
        issue_order=issue_order,
    )


def _build_program(
    gm: torch.fx.GraphModule, labels: dict[torch.fx.Node, int | None], nanobatch: int
) -> NanobatchProgram:
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    latest_collective: dict[torch.fx.Node, int] = {}  # latest own collective a node depends on
    segments: list[list[torch.fx.Node]] = [[]]
    comms: list[Communication] = []
    open_comm: Communication | None = None
    for node in gm.graph.nodes:
        depends = max((latest_collective.get(i, -1) for i in node.all_input_nodes), default=-1)
        cost = _cost(node)
        own = labels.get(node) == nanobatch
        if own and cost.kind == "collective":
            latest_collective[node] = position[node]
        elif depends >= 0:
            latest_collective[node] = depends
        if not own or cost.kind not in ("compute", "collective"):
            continue
        if cost.kind == "collective":
            if open_comm is not None and not _fusable(open_comm.collectives[0], node):
                _close(open_comm, comms, segments)
                open_comm = None
            if open_comm is None:
                open_comm = Communication(nanobatch=nanobatch)
            open_comm.collectives.append(node)
            continue
        if open_comm is not None and depends >= position[open_comm.collectives[0]]:
            _close(open_comm, comms, segments)
            open_comm = None
        segments[-1].append(node)
    if open_comm is not None:
        _close(open_comm, comms, segments)
    return NanobatchProgram(nanobatch=nanobatch, segments=segments, comms=comms)


def _close(comm: Communication, comms: list[Communication], segments: list[list[torch.fx.Node]]) -> None:
    comms.append(comm)
    segments.append([])


def _fusable(first: torch.fx.Node, other: torch.fx.Node) -> bool:
    a, b = _collective(first), _collective(other)
    return a.kind == b.kind and a.group_name == b.group_name


def _pair_partitions(
    programs: list[NanobatchProgram], depends_on: dict[torch.fx.Node, int], graph: GraphName
) -> list[Partition]:
    """Step 3: A.comm_i overlaps B.seg_i; B.comm_i overlaps A.seg_{i+1}."""
    first, second = programs
    partitions: list[Partition] = []
    for i, comm in enumerate(first.comms):
        partitions.append(
            _partition(comm, second.segments[i] if i < len(second.segments) else [], depends_on, graph, len(partitions))
        )
        if i < len(second.comms):
            run = first.segments[i + 1] if i + 1 < len(first.segments) else []
            partitions.append(_partition(second.comms[i], run, depends_on, graph, len(partitions)))
    for comm in second.comms[len(first.comms) :]:
        partitions.append(_partition(comm, [], depends_on, graph, len(partitions)))
    return [p for p in partitions if p.slots]


def _partition(
    comm: Communication, run: list[torch.fx.Node], depends_on: dict[torch.fx.Node, int], graph: GraphName, index: int
) -> Partition:
    comm_bits = 0
    for collective in comm.collectives:
        inherited = 0
        for inp in collective.all_input_nodes:
            inherited |= depends_on[inp]
        comm_bits |= depends_on[collective] & ~inherited  # the collective's own bit
    independent_prefix: list[torch.fx.Node] = []
    for node in run:
        if depends_on[node] & comm_bits:
            break
        independent_prefix.append(node)
    return Partition(partition_id=f"{graph}:p{index}", comm=comm, slots=group_slots(independent_prefix))


def group_slots(nodes: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Compute-bound kernels are a slot each; consecutive memory-bound kernels share one slot."""
    slots: list[list[torch.fx.Node]] = []
    for node in nodes:
        memory_bound = _cost(node).bound == "memory"
        kernel = node.meta.get(KERNEL_META)
        same_kernel = bool(slots) and kernel is not None and slots[-1][-1].meta.get(KERNEL_META) == kernel
        if same_kernel or (memory_bound and slots and _cost(slots[-1][-1]).bound == "memory"):
            slots[-1].append(node)
        else:
            slots.append([node])
    return slots


def _issue_order(programs: list[NanobatchProgram]) -> list[torch.fx.Node]:
    """Step 2: the anchor order of computation and collectives; waits go to first use later."""
    first, second = programs
    order: list[torch.fx.Node] = []
    for i in range(max(len(first.segments), len(second.segments))):
        for program in (first, second):
            if i < len(program.segments):
                order.extend(program.segments[i])
            if i < len(program.comms):
                order.extend(program.comms[i].collectives)
    return order


def _drop_edge_partitions(partitions: list[Partition]) -> list[Partition]:
    """Trim one-off partitions to a repeating type where possible, then dissolve edge types (step 6)."""
    counts = Counter(_signature(p) for p in partitions)
    repeating = [sig for sig, count in counts.items() if count > 1]
    for partition in partitions:
        if counts[_signature(partition)] == 1:
            trimmed = _trim_to_repeating(partition, repeating)
            if trimmed is not None:
                partition.slots = trimmed
    counts = Counter(_signature(p) for p in partitions)
    most = max(counts.values(), default=0)
    return [p for p in partitions if 2 * counts[_signature(p)] >= most]


def _assign_types(
    partitions: list[Partition], graph: GraphName, gpu: GPUSpec
) -> tuple[dict[str, str], dict[str, PartitionType], dict[str, str]]:
    members: dict[tuple, list[Partition]] = defaultdict(list)
    for partition in partitions:
        members[_signature(partition)].append(partition)
    type_of: dict[str, str] = {}
    types: dict[str, PartitionType] = {}
    labels: dict[str, str] = {}
    for sig, group in members.items():
        exemplar = group[0]
        kind = _collective(exemplar.comm.collectives[0]).kind
        type_id = f"{graph}.{kind}.{hashlib.sha1(repr(sig).encode()).hexdigest()[:8]}"
        slot_specs = tuple(SlotSpec(ops=tuple(_op_cost(n) for n in slot)) for slot in exemplar.slots)
        collective = _collective_spec(exemplar.comm.collectives)
        types[type_id] = PartitionType(
            type_id=type_id,
            graph=graph,
            slots=slot_specs,
            collective=collective,
            count=len(group),
            launch_slots=candidate_launch_slots(slot_specs, collective, gpu),
        )
        labels[type_id] = _describe(exemplar)
        for partition in group:
            type_of[partition.partition_id] = type_id
    return type_of, types, labels


def _trim_to_repeating(partition: Partition, repeating: list[tuple]) -> list[list[torch.fx.Node]] | None:
    """Longest repeating type whose ops are a prefix or suffix of this partition's ops."""
    nodes = [n for slot in partition.slots for n in slot]
    ops = [_node_signature(n) for n in nodes]
    comm_sig = _comm_signature(partition.comm)
    best: list[torch.fx.Node] | None = None
    for sig in repeating:
        if sig[0] != comm_sig:
            continue
        type_ops = [op for slot in sig[1] for op in slot]
        width = len(type_ops)
        if width >= len(ops):
            continue
        for start in (len(ops) - width, 0):
            if ops[start : start + width] == type_ops and (best is None or width > len(best)):
                best = nodes[start : start + width]
    return group_slots(best) if best is not None else None


def candidate_launch_slots(slots: tuple[SlotSpec, ...], collective: CollectiveSpec, gpu: GPUSpec) -> tuple[int, ...]:
    """Slots at which launching the collective does not always expose it (appendix C).

    Slot ``s`` is kept unless the computation from ``s`` to the end, idealised at its slowest
    (roofline at the lowest tuning clock), is shorter than the collective idealised at its
    fastest (ring traffic at the GPU's NVLink bandwidth with all the SMs it wants).
    """
    comm_s = collective_lower_bound_s(collective, gpu)
    clock = gpu.tuning_clock_min_mhz
    slot_s = [
        max(slot.flops / gpu.peak_flops_per_s(clock), slot.bytes / gpu.hbm_bandwidth_bytes_per_s) for slot in slots
    ]
    remaining_s = [sum(slot_s[i:]) for i in range(len(slots))]
    return tuple(i for i, remaining in enumerate(remaining_s) if remaining >= comm_s)


def collective_lower_bound_s(collective: CollectiveSpec, gpu: GPUSpec) -> float:
    """Ring-algorithm time of a collective at full NVLink bandwidth (no SM or latency limits)."""
    n = collective.group_size
    traffic = _ALGORITHM_TRAFFIC[collective.kind] * (n - 1) / n * collective.bytes
    return traffic / gpu.nvlink_bandwidth_bytes_per_s


def _signature(partition: Partition) -> tuple:
    return (_comm_signature(partition.comm), tuple(tuple(_node_signature(n) for n in slot) for slot in partition.slots))


def _comm_signature(comm: Communication) -> tuple:
    return tuple((c.kind, c.bytes, c.group_size) for c in (_collective(n) for n in comm.collectives))


def _node_signature(node: torch.fx.Node) -> tuple:
    val = node.meta.get("val")
    shape = (
        hinted(getattr(val, "shape", ()))
        if not isinstance(val, (tuple, list))
        else tuple(hinted(getattr(v, "shape", ())) for v in val)
    )
    return (str(node.target), shape, str(getattr(val, "dtype", "")))


def _collective_spec(collectives: list[torch.fx.Node]) -> CollectiveSpec:
    infos = [_collective(n) for n in collectives]
    return CollectiveSpec(
        kind=infos[0].kind,
        bytes=sum(i.bytes for i in infos),
        group_size=infos[0].group_size or 1,
        fused=len(infos),
    )


def _op_cost(node: torch.fx.Node) -> OpCost:
    cost = _cost(node)
    return OpCost(
        name=node.name,
        target=str(node.target),
        flops=cost.flops,
        bytes=cost.bytes,
        bound=cost.bound,
        kernel=node.meta.get(KERNEL_META),
    )


def _describe(partition: Partition) -> str:
    """Human label: collective kind and the module its compute-bound ops share (layer starred)."""
    nodes = [n for slot in partition.slots for n in slot]
    heavy = [n for n in nodes if _cost(n).bound == "compute"] or nodes
    paths = [_LAYER_INDEX.sub(".*", module_path(n) or "").split(".") for n in heavy]
    common: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    kind = _collective(partition.comm.collectives[0]).kind
    fused = f" x{len(partition.comm.collectives)} fused" if len(partition.comm.collectives) > 1 else ""
    return f"{kind}{fused} over {'.'.join(common) or 'model'}"


def _collective_dependencies(dependency_graph: nx.DiGraph) -> dict[torch.fx.Node, int]:
    """Per node, a bit set of the collectives it (transitively) depends on, itself included.

    One pass in topological order; a node depends on collective ``c`` iff its bits include
    ``c``'s own bit. Cheaper than a descendants search per collective on graphs with thousands
    of nodes and hundreds of collectives.
    """
    bits: dict[torch.fx.Node, int] = {}
    next_bit = 1
    for node in nx.topological_sort(dependency_graph):
        mask = 0
        for inp in dependency_graph.predecessors(node):
            mask |= bits[inp]
        if _cost(node).kind == "collective":
            mask |= next_bit
            next_bit <<= 1
        bits[node] = mask
    return bits


def _networkx_graph(gm: torch.fx.GraphModule) -> nx.DiGraph:
    graph = nx.DiGraph()
    for node in gm.graph.nodes:
        graph.add_node(node)
        for inp in node.all_input_nodes:
            graph.add_edge(inp, node)
    return graph


def _cost(node: torch.fx.Node) -> NodeCost:
    return node.meta.get(META_KEY, NodeCost(kind="other"))


def _collective(node: torch.fx.Node) -> CollectiveInfo:
    """The collective of ``node``, a partition's communication node (the analysis gave it one)."""
    info = _cost(node).collective
    if info is None:
        raise ValueError(f"node {node.name} stands for a partition's collective but the analysis found none in it")
    return info
