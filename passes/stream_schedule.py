"""Codegen: the plan's partitioned-overlap schedule of one nanobatched aten graph (paper 5.2).

Input: an aten graph already in the nanobatching issue order (``issue_order.py``), its
:class:`~kareus_fx.passes.partitions.GraphPartitioning`, and per partition type (the partition
pass's type ids) a :class:`CommSchedule`: the collective's SM count and launch slot.

1. Launch slots: each scheduled partition's collective(s) move in the anchor order to right
   before the first op of launch slot ``k`` of the partition's computation (the other
   nanobatch's run), i.e. right after slot ``k-1``'s last op, its *predecessor*. Slot 0 is the
   nanobatching order (the collective first). ``launch_slot=None`` (sequential) issues it after
   the partition's last slot and waits for it at once: nothing overlaps it, as the cost model's
   sequential execution assumes. Otherwise its ``wait_tensor`` stays at the first use of the
   result. The reorder goes through :func:`apply_issue_order`, which only makes moves the data
   dependencies allow (slots of a partition never depend on its collective), so the graph
   computes what it computed before.
2. Hooks (``kareus_fx.deploy.hook_ops``): ``clock_hook(stage, instruction)`` after the inputs (the
   microbatch boundary); per scheduled partition ``comm_launch(tag, comm_sms, launch_slot,
   inputs)`` right before its collective(s), ``comm_issued(tag, outputs)`` right after them and
   ``comm_wait(tag, outputs)`` right before the first wait; ``tag`` is the partition id.
3. SM limit: ``node.meta["kareus_comm_sms"]`` on each collective, the ``comm_sms`` argument of
   ``comm_launch``, and the collective's group argument rewritten by ``group_for(group_name,
   comm_sms)`` (the deployment passes the runtime's SM-limited communicator; with gloo the
   group is the same one). ``comm_sms=None`` keeps the group's default communicator.

Partitions of types without a schedule (and leftover collectives) keep the nanobatching order
and get no hooks. Assumption: a partition's collectives have tensor results (not the list
result of a ``*_coalesced`` collective); coalesced collectives keep their order but are not
passed to the stream hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.fx

from kareus_fx.deploy.hook_ops import (
    CLOCK_HOOK,
    COMM_ISSUED,
    COMM_LAUNCH,
    COMM_WAIT,
    SEQUENTIAL_LAUNCH_SLOT,
)
from kareus_fx.errors import UnsupportedGraphError
from kareus_fx.passes.issue_order import apply_issue_order
from kareus_fx.passes.partitions import Communication, GraphPartitioning, Partition

COMM_SMS_META = "kareus_comm_sms"
LAUNCH_SLOT_META = "kareus_launch_slot"

GroupRewrite = Callable[[str, int], str]
"""``(group name, comm SMs) -> group name`` the collective is issued on."""


@dataclass(frozen=True)
class CommSchedule:
    """One partition type's communication schedule. ``launch_slot=None``: sequential."""

    comm_sms: int | None
    launch_slot: int | None


@dataclass(frozen=True)
class ScheduledPartition:
    """Where one partition's collective ended up (for tests, printing and debugging)."""

    partition_id: str
    type_id: str
    comm_sms: int | None
    launch_slot: int | None
    collectives: tuple[str, ...]
    slots: tuple[tuple[str, ...], ...]
    predecessor: str | None
    """The op the collective is issued after: slot ``k-1``'s last op (the last slot's when
    sequential); None for slot 0 (issued after its own producer, as nanobatching does)."""


def schedule_partitions(
    gm: torch.fx.GraphModule,
    partitioning: GraphPartitioning,
    schedules: Mapping[str, CommSchedule],
    *,
    stage: int,
    instruction: str,
    group_for: GroupRewrite | None = None,
) -> list[ScheduledPartition]:
    """Apply ``schedules`` (keyed by the partition pass's type ids) to ``gm`` in place; recompiles."""
    scheduled = [(p, schedules[p.type_id]) for p in partitioning.partitions if p.type_id in schedules]
    for partition, schedule in scheduled:
        _check_launch_slot(partition, schedule)
    anchors = _anchor_order(partitioning.issue_order, scheduled)
    apply_issue_order(gm, anchors)
    graph = gm.graph
    insert_clock_hook(gm, stage, instruction)
    summary = []
    for partition, schedule in scheduled:
        _insert_comm_hooks(graph, partition, schedule, group_for)
        summary.append(_summary(partition, schedule))
    graph.lint()
    gm.recompile()
    return summary


def _check_launch_slot(partition: Partition, schedule: CommSchedule) -> None:
    slot = schedule.launch_slot
    if slot is not None and not 0 <= slot < len(partition.slots):
        raise UnsupportedGraphError(
            f"partition {partition.partition_id} (type {partition.type_id}) has {len(partition.slots)} "
            f"launch slot(s) but the schedule asks for slot {slot}: the plan was made for another graph"
        )


def _anchor_order(
    issue_order: list[torch.fx.Node], scheduled: list[tuple[Partition, CommSchedule]]
) -> list[torch.fx.Node]:
    """The issue order with each scheduled collective moved to its launch slot."""
    moved = {c for p, _ in scheduled for c in p.comm.collectives}
    before: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    after: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for partition, schedule in scheduled:
        if schedule.launch_slot is None:
            # Sequential: after the last slot, each collective's waits right behind it.
            nodes = [n for c in partition.comm.collectives for n in (c, *_waits_of(c))]
            after.setdefault(partition.slots[-1][-1], []).extend(nodes)
        else:
            before.setdefault(partition.slots[schedule.launch_slot][0], []).extend(partition.comm.collectives)
    anchors: list[torch.fx.Node] = []
    for node in issue_order:
        anchors.extend(before.get(node, ()))
        if node not in moved:
            anchors.append(node)
        anchors.extend(after.get(node, ()))
    return anchors


def _waits_of(collective: torch.fx.Node) -> list[torch.fx.Node]:
    return [u for u in collective.users if u.target is torch.ops._c10d_functional.wait_tensor.default]


def insert_clock_hook(gm: torch.fx.GraphModule, stage: int, instruction: str) -> None:
    """Put ``clock_hook(stage, instruction)`` right after the graph's inputs; recompiles."""
    graph = gm.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first_op):
        graph.call_function(CLOCK_HOOK, (stage, instruction))
    gm.recompile()


def _insert_comm_hooks(
    graph: torch.fx.Graph, partition: Partition, schedule: CommSchedule, group_for: GroupRewrite | None
) -> None:
    position = {node: i for i, node in enumerate(graph.nodes)}
    collectives = sorted(partition.comm.collectives, key=position.__getitem__)
    tensors = [c for c in collectives if isinstance(c.meta.get("val"), torch.Tensor)]
    inputs = [c.args[0] for c in tensors if isinstance(c.args[0], torch.fx.Node)]
    tag = partition.partition_id
    launch_slot = SEQUENTIAL_LAUNCH_SLOT if schedule.launch_slot is None else schedule.launch_slot
    with graph.inserting_before(collectives[0]):
        graph.call_function(COMM_LAUNCH, (tag, schedule.comm_sms or 0, launch_slot, inputs))
    with graph.inserting_after(collectives[-1]):
        graph.call_function(COMM_ISSUED, (tag, tensors))
    waits = [w for c in collectives for w in _waits_of(c)]
    if waits:
        with graph.inserting_before(min(waits, key=position.__getitem__)):
            graph.call_function(COMM_WAIT, (tag, tensors))
    for collective in collectives:
        collective.meta[COMM_SMS_META] = schedule.comm_sms
        collective.meta[LAUNCH_SLOT_META] = schedule.launch_slot
        if group_for is not None and schedule.comm_sms is not None:
            group = group_for(str(collective.args[-1]), schedule.comm_sms)
            collective.args = (*collective.args[:-1], group)


def _summary(partition: Partition, schedule: CommSchedule) -> ScheduledPartition:
    slot = schedule.launch_slot
    if slot is None:
        predecessor: torch.fx.Node | None = partition.slots[-1][-1]
    else:
        predecessor = partition.slots[slot - 1][-1] if slot > 0 else None
    return ScheduledPartition(
        partition_id=partition.partition_id,
        type_id=partition.type_id,
        comm_sms=schedule.comm_sms,
        launch_slot=slot,
        collectives=tuple(c.name for c in partition.comm.collectives),
        slots=tuple(tuple(n.name for n in s) for s in partition.slots),
        predecessor=None if predecessor is None else predecessor.name,
    )


def copy_partitioned_graph(
    gm: torch.fx.GraphModule, partitioning: GraphPartitioning
) -> tuple[torch.fx.GraphModule, GraphPartitioning]:
    """An independent copy of ``gm`` (one per schedule variant) with ``partitioning`` mapped onto it.

    Node metadata is copied shallowly (the fake-tensor values are shared, never mutated).
    """
    graph = torch.fx.Graph()
    mapping: dict[torch.fx.Node, torch.fx.Node] = {}
    output = graph.graph_copy(gm.graph, mapping)
    graph.output(output)

    def nodes(items: list[torch.fx.Node]) -> list[torch.fx.Node]:
        return [mapping[n] for n in items]

    partitions = [
        Partition(
            partition_id=p.partition_id,
            comm=Communication(nanobatch=p.comm.nanobatch, collectives=nodes(p.comm.collectives)),
            slots=[nodes(slot) for slot in p.slots],
            type_id=p.type_id,
        )
        for p in partitioning.partitions
    ]
    copied = GraphPartitioning(
        graph=partitioning.graph,
        partitions=partitions,
        types=partitioning.types,
        type_labels=partitioning.type_labels,
        leftover=nodes(partitioning.leftover),
        issue_order=nodes(partitioning.issue_order),
    )
    return torch.fx.GraphModule(gm, graph), copied
