"""Backend options: what ``torch.compile(..., backend="kareus", options={...})`` accepts.

Options are validated the first time Dynamo hands a graph to the backend (torch.compile itself
does not call backends eagerly). An unknown key, a wrong type or an unknown GPU raises
:class:`~kareus_fx.errors.OptionsError` listing what is valid.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from kareus_fx.cost_models.hardware import DEFAULT_GPU, canonical_gpu_name
from kareus_fx.errors import OptionsError, UnknownGPUError

_OPTION_HELP: dict[str, str] = {
    "dump_dir": "directory to write one JSON graph dump per compiled graph (str or Path)",
    "gpu": f"GPU whose spec labels ops compute- or memory-bound (default {DEFAULT_GPU})",
    "nanobatch": "split each microbatch into two nanobatches (bool, default True)",
}


@dataclass(frozen=True)
class KareusOptions:
    """Validated backend options. Field names equal the user-facing option keys."""

    dump_dir: Path | None = None
    gpu: str = DEFAULT_GPU
    nanobatch: bool = True

    @classmethod
    def from_user(cls, options: Any) -> "KareusOptions":
        """Validate the raw ``options`` value given to ``torch.compile``."""
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise OptionsError(
                f"backend='kareus' options must be a dict, got {type(options).__name__} "
                f"({options!r}); for example options={{'dump_dir': 'dumps'}}. Valid keys: "
                + _valid_keys_text()
            )
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise OptionsError(
                f"unknown backend='kareus' option(s) {', '.join(map(repr, unknown))}; valid options: "
                + _valid_keys_text()
            )
        values: dict[str, Any] = {}
        if options.get("dump_dir") is not None:
            dump_dir = options["dump_dir"]
            if not isinstance(dump_dir, (str, Path)):
                raise OptionsError(f"option 'dump_dir' must be a str or Path, got {type(dump_dir).__name__}")
            values["dump_dir"] = Path(dump_dir)
        if "gpu" in options:
            if not isinstance(options["gpu"], str):
                raise OptionsError(f"option 'gpu' must be a GPU name string, got {options['gpu']!r}")
            try:
                values["gpu"] = canonical_gpu_name(options["gpu"])
            except UnknownGPUError as err:
                raise OptionsError(f"option 'gpu': {err}") from None
        if "nanobatch" in options:
            if not isinstance(options["nanobatch"], bool):
                raise OptionsError(f"option 'nanobatch' must be True or False, got {options['nanobatch']!r}")
            values["nanobatch"] = options["nanobatch"]
        return cls(**values)


def _valid_keys_text() -> str:
    return "; ".join(f"{key}: {text}" for key, text in _OPTION_HELP.items())
