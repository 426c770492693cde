"""Backend options from the environment, for frameworks that take a backend name but no options.

torchtitan (``--compile.backend kareus``) and Hugging Face ``TrainingArguments(torch_compile_backend=
"kareus")`` call ``torch.compile(..., backend="kareus")`` with no ``options``. Two variables give
them options:

- ``KAREUS_CONFIG``: path to a ``.toml`` or ``.json`` file whose top level is the options table;
- ``KAREUS_OPTIONS``: a JSON object of options.

Precedence, lowest first: ``KAREUS_CONFIG``, then ``KAREUS_OPTIONS`` (its keys replace the file's),
then the ``options=`` given to ``torch.compile`` (explicit options always win, key by key). Each
source is validated on its own by :meth:`KareusOptions.from_user` before the merge, so a bad value
raises :class:`~kareus_fx.errors.OptionsError` naming the variable and the field. Options that are
Python objects (``clock_controller``) cannot come from the environment.

TOML needs Python 3.11's ``tomllib`` (or the ``tomli`` package on 3.10); JSON always works.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kareus_fx.config import KareusOptions
from kareus_fx.errors import OptionsError

OPTIONS_VAR = "KAREUS_OPTIONS"
CONFIG_VAR = "KAREUS_CONFIG"
_OBJECT_OPTIONS = ("clock_controller",)
_EXAMPLE = '{"plan": "plan.json", "target": {"deadline_s": 2.5}}'


def environment_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options ``KAREUS_CONFIG`` and ``KAREUS_OPTIONS`` give (empty when neither is set)."""
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    path = environ.get(CONFIG_VAR, "").strip()
    if path:
        merged.update(_checked(_read_config_file(Path(path)), f"{CONFIG_VAR}={path}"))
    text = environ.get(OPTIONS_VAR, "").strip()
    if text:
        merged.update(_checked(_parse_json(text, OPTIONS_VAR), OPTIONS_VAR))
    return merged


def resolve_options(options: Any, environ: Mapping[str, str] | None = None) -> KareusOptions:
    """The validated options of one compile: ``options`` given to ``torch.compile`` over the
    environment's (explicit keys win). A non-dict ``options`` is refused as without the environment."""
    from_environment = environment_options(environ)
    if not from_environment or (options is not None and not isinstance(options, Mapping)):
        return KareusOptions.from_user(options)
    try:
        return KareusOptions.from_user({**from_environment, **(options or {})})
    except OptionsError as err:
        raise OptionsError(
            f"{err} (options {sorted(from_environment)} came from {CONFIG_VAR} / {OPTIONS_VAR}, "
            f"the others from torch.compile's options=)"
        ) from None


def _checked(options: Any, source: str) -> dict[str, Any]:
    """``options`` validated on their own; an error names ``source`` (the variable)."""
    if not isinstance(options, Mapping):
        raise OptionsError(
            f"{source}: backend options must be an object (a table of option: value), got "
            f"{type(options).__name__}; for example {OPTIONS_VAR}='{_EXAMPLE}'"
        )
    objects = [key for key in _OBJECT_OPTIONS if key in options]
    if objects:
        raise OptionsError(
            f"{source}: option {objects[0]!r} is a Python object and cannot come from the environment; "
            f"pass it in torch.compile(..., options={{{objects[0]!r}: ...}}) or drop it"
        )
    try:
        KareusOptions.from_user(options)
    except OptionsError as err:
        raise OptionsError(f"{source}: {err}") from None
    return dict(options)


def _parse_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise OptionsError(
            f"{source} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
            f"give a JSON object, for example {OPTIONS_VAR}='{_EXAMPLE}'"
        ) from None


def _read_config_file(path: Path) -> Any:
    where = f"{CONFIG_VAR}={path}"
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise OptionsError(f"{where}: the options file must end in .toml or .json, got {suffix or 'no suffix'!r}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise OptionsError(f"{where}: cannot read the options file ({err.strerror}); fix the path") from None
    if suffix == ".json":
        return _parse_json(text, where)
    toml = _toml_module(where)
    try:
        return toml.loads(text)
    except toml.TOMLDecodeError as err:
        raise OptionsError(f"{where} is not valid TOML: {err}") from None


def _toml_module(where: str) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise OptionsError(
                f"{where}: reading TOML needs Python 3.11 or `pip install tomli`; or give a .json file"
            ) from None
    return tomllib
