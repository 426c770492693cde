"""partition_types_from_dump: a type's costs are those most of its partitions share (the middle
layers'), not its first partition's, which is an edge layer's."""

from __future__ import annotations

from kareus_fx.capture.dump import partition_types_from_dump


def _node(name: str, op: str, nbytes: float, kernel: str) -> dict:
    return {
        "name": name,
        "op": op,
        "kind": "compute",
        "flops": 1.0,
        "bytes": nbytes,
        "bound": "memory",
        "kernel": kernel,
    }


def _layer(i: int, add_bytes: float, norm_bytes: float) -> tuple[list[dict], dict]:
    """One layer's partition: a residual add + norm slot of two kernels (320 bytes in all)."""
    nodes = [
        _node(f"add_{i}", "aten.add.Tensor", add_bytes, f"k{2 * i}"),
        _node(f"mul_{i}", "aten.mul.Tensor", norm_bytes, f"k{2 * i + 1}"),
    ]
    return nodes, {"type": "forward.all_reduce.t", "slots": [[f"add_{i}", f"mul_{i}"]], "collectives": []}


def _dump(layers: list[tuple[float, float]]) -> dict:
    built = [_layer(i, *b) for i, b in enumerate(layers)]
    return {
        "graphs": [
            {
                "name": "forward",
                "nodes": [n for nodes, _ in built for n in nodes],
                "partitions": [p for _, p in built],
                "partition_types": [
                    {
                        "type": "forward.all_reduce.t",
                        "count": len(layers),
                        "launch_slots": [0],
                        "collective": {"kind": "all_reduce", "bytes": 64.0, "group_size": 8},
                    }
                ],
            }
        ]
    }


def _add_bytes(dump: dict) -> float:
    (ptype,) = partition_types_from_dump(dump).values()
    return ptype.slots[0].ops[0].bytes


def test_the_middle_layers_costs_not_the_first_layers():
    # the first layer reads the embedding's output and splits the slot's bytes 128 + 192
    assert _add_bytes(_dump([(128.0, 192.0), (192.0, 128.0), (192.0, 128.0), (192.0, 128.0)])) == 192.0


def test_equally_common_costs_resolve_to_the_later_layers():
    # a 2-layer stage: the first layer is an edge, the second a middle layer
    assert _add_bytes(_dump([(128.0, 192.0), (192.0, 128.0)])) == 192.0
