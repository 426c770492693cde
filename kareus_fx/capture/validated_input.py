"""Reading the files kareus-fx exchanges (plans, graph dumps, Perseus CSVs) before any reader
touches them: a size bound checked before parsing, JSON without NaN or Infinity, and pydantic
schema errors turned into one line that names the file and the field.

The schemas themselves live beside the files they describe (``plan/plan_schema.py``,
``capture/dump_schema.py``, ...); this module holds only what every schema shares: the number
types (finite, bounded, ``bool`` refused) and the error wording.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, StrictInt, ValidationError

__all__ = [
    "MAX_COUNT",
    "MAX_MAGNITUDE",
    "Count",
    "Fail",
    "Number",
    "PositiveCount",
    "SchemaModel",
    "error_text",
    "finite",
    "int_range",
    "parse_json",
    "read_bounded_text",
]

MAX_MAGNITUDE = 1e30
"""The largest number any field accepts: far beyond any time (s), energy (J), FLOPs or bytes of
a real workload, and small enough that sums and products of a few stay finite."""


class SchemaModel(BaseModel):
    """Base of every file schema: strict types (no ``"3"`` for 3, no ``true`` for 1), unknown
    keys ignored (a validated file holds only the fields its schema names), immutable."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


MAX_COUNT = 2**53
"""The largest count any field accepts: the largest integer a JSON double holds exactly."""


def finite(low: float = 0.0, high: float = MAX_MAGNITUDE, *, low_inclusive: bool = True) -> PlainValidator:
    """Pydantic metadata for a finite int or float in [low, high] (``(low, high]`` when not
    ``low_inclusive``), ``bool`` refused: ``Annotated[int | float, finite(...)]``."""

    def check(value: Any) -> int | float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {type(value).__name__}")
        # an int is finite (and math.isfinite overflows on one of 400 digits, a crash fuzzing found)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("expected a finite number (NaN and infinity are refused)")
        if value < low or (value == low and not low_inclusive) or value > high:
            bound = f">= {low:g}" if low_inclusive else f"> {low:g}"
            raise ValueError(f"expected a number {bound} and <= {high:g}")
        return value  # the JSON type (int or float) is kept: fingerprints hash the values

    return PlainValidator(check)


def int_range(low: int = 0, high: int = MAX_COUNT) -> Any:
    """Pydantic metadata for an integer in [low, high]: ``Annotated[StrictInt, int_range(...)]``
    (``StrictInt`` refuses ``bool``). ``Any`` because that is what pydantic's ``Field`` returns."""
    return Field(ge=low, le=high)


# The field types used across schemas. They are type aliases (not calls in the annotation) so
# that mypy checks the models' fields; a schema with other bounds writes its own
# ``Annotated[StrictInt, int_range(low, high)]`` / ``Annotated[int | float, finite(...)]``.
Count = Annotated[StrictInt, int_range(0)]
"""An integer in [0, MAX_COUNT]."""
PositiveCount = Annotated[StrictInt, int_range(1)]
"""An integer in [1, MAX_COUNT]."""
Number = Annotated[int | float, finite()]
"""A finite number in [0, MAX_MAGNITUDE] (int or float, as the JSON had it)."""


def read_bounded_text(path: str | os.PathLike[str], max_bytes: int, error: type[Exception], what: str) -> str:
    """The UTF-8 text of ``path``, refused (``error``) when it is missing, unreadable, not text or
    larger than ``max_bytes`` (checked on the file's size, before reading it)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(
                f"{path}: {size} bytes, more than any real {what} ({max_bytes} bytes at most); this is not a {what}"
            )
        return path.read_bytes().decode("utf-8")
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror}; check the path") from None
    except UnicodeDecodeError as err:
        raise error(f"{path} is not a {what}: not UTF-8 text (byte {err.start})") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_json(text: str, source: str, error: type[Exception], what: str, fix: str) -> Any:
    """``json.loads`` that refuses NaN / Infinity and words every failure as ``error``."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise error(
            f"{source} is not a {what}: invalid JSON at line {err.lineno} column {err.colno} ({err.msg}); {fix}"
        ) from None
    except (ValueError, RecursionError) as err:  # NaN/Infinity, an int of > 4300 digits, deep nesting
        raise error(f"{source} is not a {what}: {str(err) or type(err).__name__}; {fix}") from None


def _location(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in ("function-plain[check()]",):
            continue
        else:
            text += f".{part}" if text else str(part)
    return text


def error_text(err: ValidationError, source: str) -> str:
    """``SOURCE: FIELD: what is wrong (got VALUE)`` for the first of a pydantic error's problems;
    ``SOURCE: FIELD: missing a, b, c`` when that problem is missing fields (all of them named)."""
    problems = err.errors(include_url=False)
    first = problems[0]
    where = _location(tuple(first["loc"][:-1] if first["type"] == "missing" else first["loc"]))
    if first["type"] == "missing":
        names = [str(p["loc"][-1]) for p in problems if p["type"] == "missing" and p["loc"][:-1] == first["loc"][:-1]]
        more = len(problems) - len(names)
        message = f"missing {', '.join(names)}"
    else:
        got = repr(first.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        message = f"{first['msg'].removeprefix('Value error, ')} (got {got})"
        more = len(problems) - 1
    more_text = f" and {more} more problem(s)" if more else ""
    return f"{source}: {where + ': ' if where else ''}{message}{more_text}"


Fail = Callable[[str, str], NoReturn]
"""``fail(field, what is wrong)``: raises the reader's error naming the file, the field and the fix."""


Schema = TypeVar("Schema", bound=SchemaModel)


def validated_document(
    schema: type[Schema],
    data: Any,
    cross_check: Callable[[Schema, Fail], None],
    source: str,
    error: type[Exception],
    fix: str,
) -> dict[str, Any]:
    """``data`` validated by ``schema`` and then by ``cross_check`` (which calls its ``fail(field,
    what)`` when parts disagree), as plain data holding only the schema's fields; every problem
    raised as ``error`` naming ``source``, the field and ``fix``."""
    try:
        document = schema.model_validate(data)
    except ValidationError as err:
        raise error(f"{error_text(err, source)}; {fix}") from None

    def fail(where: str, what: str) -> NoReturn:
        raise error(f"{source}: {where}: {what}; {fix}")

    cross_check(document, fail)
    return document.model_dump()
