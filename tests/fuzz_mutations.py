"""Hypothesis strategies that mutate a JSON document the ways a hand edit, a bad copy or another
tool breaks a file: a key or element removed, a value swapped for another type, NaN or infinity,
a huge or negative number, an extra key, a wrong string, an element repeated or two swapped, a
number or string nudged to another plausible value; then, sometimes, the text cut short or
garbled (a stray character, NaN, 1e999, a 5000-digit number).

The path to each mutated value is drawn level by level from the root, so a top-level field is hit
as often as one deep in a large list.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import strategies as st

REPLACEMENTS: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    0.0,
    -0.5,
    0.5,
    3,
    1e-300,
    "",
    "x",
    "T0",
    "0/forward",
    "forward",
    "all_reduce",
    [],
    {},
    [0],
    [1.0, 2.0],
    {"x": 1},
    {"T0": {"comm_sms": 1, "launch_slot": 0}},
    float("nan"),
    float("inf"),
    float("-inf"),
    1e308,
    -1e308,
    10**30,
    2**64,
    -(10**20),
    10**400,
    1e29,
)
"""Values swapped in: other types, NaN/inf, huge and negative numbers, plausible wrong strings."""


def _children(value: Any) -> list[Any]:
    return list(value) if isinstance(value, dict) else list(range(len(value))) if isinstance(value, list) else []


@st.composite
def _path(draw: st.DrawFn, doc: Any) -> list[Any]:
    """A path from the root: at each level one child (half the time one of the containers among
    them, so deep fields are reached as often as the root's scalars), stopping at a leaf or
    (1 in 4) earlier."""
    path: list[Any] = []
    node = doc
    while True:
        children = _children(node)
        if not children or (path and draw(st.integers(0, 3)) == 0):
            return path
        containers = [k for k in children if isinstance(node[k], (dict, list)) and node[k]]
        if containers and draw(st.booleans()):
            children = containers
        key = children[draw(st.integers(0, len(children) - 1))]
        path.append(key)
        node = node[key]


def _copy_path(doc: Any, path: list[Any]) -> Any:
    """``doc`` with each container on ``path`` (the root included) copied shallowly: the seed is
    never changed and the rest is shared (a deep copy of a large seed per example is slow)."""
    root = copy.copy(doc)
    node = root
    for key in path[:-1]:
        node[key] = copy.copy(node[key])
        node = node[key]
    return root


def _apply(doc: Any, path: list[Any], kind: str, draw: st.DrawFn) -> Any:
    if not path:
        return draw(st.sampled_from(REPLACEMENTS)) if kind == "replace" else doc
    doc = _copy_path(doc, path)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if kind == "remove":
        del parent[key]
    elif kind == "replace":
        parent[key] = draw(st.sampled_from(REPLACEMENTS))
    elif kind == "extra" and isinstance(parent[key], dict):
        parent[key] = {
            **parent[key],
            draw(st.sampled_from(["extra", "T99", "9/forward", "forward", "xxx"])): draw(st.sampled_from(REPLACEMENTS)),
        }
    elif kind == "duplicate" and isinstance(parent, list):
        parent.insert(key, parent[key])
    elif kind == "scale" and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
        factor = draw(st.sampled_from([-1, 0, 2, 10**6, 1e20]))
        parent[key] = parent[key] * factor if abs(parent[key]) < 1e300 else factor
    elif kind == "nudge" and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
        # a plausible edit of the same type: the file often stays valid, and readers see new values
        parent[key] = (
            parent[key] + draw(st.sampled_from([-1, 1, 2]))
            if isinstance(parent[key], int)
            else parent[key] * draw(st.sampled_from([0.0, 0.5, 1.5, 1e3]))
        )  # a float: never the 400-digit int
    elif kind == "nudge" and isinstance(parent[key], str):
        parent[key] = draw(st.sampled_from(["", "x", parent[key] + "x", parent[key][::-1]]))
    elif kind == "nudge" and isinstance(parent[key], bool):
        parent[key] = not parent[key]
    elif kind == "nudge" and isinstance(parent, list):  # reorder
        other = draw(st.integers(0, len(parent) - 1))
        parent[key], parent[other] = parent[other], parent[key]
    else:  # the mutation does not apply here: swap the value instead
        parent[key] = draw(st.sampled_from(REPLACEMENTS))
    return doc


class _SeedText:
    """``json.dumps`` of a mutated seed, text for text, from the cached text of each seed container
    the mutation left shared (``_copy_path`` copies only the containers on the mutated path): the
    full serialisation of a 270 kB dump seed was most of an example's drawing time."""

    def __init__(self) -> None:
        self._text: dict[int, tuple[Any, str]] = {}  # id -> (the seed container, kept alive; its text)

    def dumps(self, doc: Any, seeds: list[Any]) -> str:
        for seed in seeds:
            if id(seed) not in self._text:
                text = self._cache(seed)
                assert text == json.dumps(seed, check_circular=False), "cached text differs from json.dumps"
        return self._dumps(doc)

    def _cache(self, node: Any) -> str:
        if isinstance(node, dict):
            text = "{" + ", ".join(f"{json.dumps(key)}: {self._cache(value)}" for key, value in node.items()) + "}"
        elif isinstance(node, list):
            text = "[" + ", ".join(self._cache(value) for value in node) + "]"
        else:
            return json.dumps(node)
        self._text[id(node)] = (node, text)
        return text

    def _dumps(self, node: Any) -> str:
        cached = self._text.get(id(node))
        if cached is not None and cached[0] is node:
            return cached[1]
        if isinstance(node, dict):
            return "{" + ", ".join(f"{json.dumps(key)}: {self._dumps(value)}" for key, value in node.items()) + "}"
        if isinstance(node, list):
            return "[" + ", ".join(self._dumps(value) for value in node) + "]"
        return json.dumps(node)


_SEED_TEXT = _SeedText()


@st.composite
def mutated_text(draw: st.DrawFn, seeds: list[Any]) -> str:
    """The JSON text of one seed document after 1-3 mutations, sometimes cut short or garbled."""
    doc = seeds[draw(st.integers(0, len(seeds) - 1))]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["remove", "replace", "replace", "extra", "duplicate", "scale", "nudge", "nudge"]))
        doc = _apply(doc, draw(_path(doc)), kind, draw)
    text = _SEED_TEXT.dumps(doc, seeds)  # NaN and Infinity: the tokens Python's json reads back
    damage = draw(st.sampled_from(["none"] * 6 + ["cut", "garble", "digits"]))
    if damage == "cut":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif damage == "garble":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(['"', "}", "]", ",", "\x00", "\ufffd", "1e999", "NaN"])) + text[at:]
    elif damage == "digits":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + "9" * 5000 + text[at:]
    return text
