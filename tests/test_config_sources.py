"""Backend options from KAREUS_CONFIG / KAREUS_OPTIONS (frameworks that take only a backend name).

What can fail: a variable's options not reaching the backend (the compile writes its dump where
the environment says); explicit ``options=`` not winning key by key; the file not being read under
the variable (TOML and JSON); a bad value not naming the variable and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kareus_fx.config_sources import CONFIG_VAR, OPTIONS_VAR, environment_options, resolve_options
from kareus_fx.errors import OptionsError


def test_sources_merge_file_then_json_then_explicit(tmp_path):
    config = tmp_path / "kareus.toml"
    config.write_text('plan = "from-file.json"\nstage = 1\nnanobatch = false\n\n[target]\ndeadline_s = 2.5\n')
    environ = {CONFIG_VAR: str(config), OPTIONS_VAR: '{"stage": 0, "plan": "from-env.json"}'}
    assert environment_options(environ) == {
        "plan": "from-env.json",
        "stage": 0,
        "nanobatch": False,
        "target": {"deadline_s": 2.5},
    }
    opts = resolve_options({"plan": "explicit.json"}, environ)
    assert (opts.plan, opts.stage, opts.nanobatch, opts.target) == (
        Path("explicit.json"),
        0,
        False,
        {"deadline_s": 2.5},
    )
    # Explicit options alone, or no environment, behave as before.
    assert resolve_options(None, {}) == resolve_options({}, {})
    assert resolve_options({"stage": 3}, {}).stage == 3


def test_json_config_file(tmp_path):
    config = tmp_path / "kareus.json"
    config.write_text(json.dumps({"gpu": "a100", "inductor": False}))
    opts = resolve_options(None, {CONFIG_VAR: str(config)})
    assert (opts.gpu, opts.inductor) == ("A100-SXM4-40GB", False)


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"stage": -1}', r"^KAREUS_OPTIONS: option 'stage' must be a pipeline stage index \(int >= 0\), got -1"),
        ('{"stag": 1}', r"^KAREUS_OPTIONS: unknown backend='kareus' option\(s\) 'stag'"),
        ('{"target": "fastest"}', r"^KAREUS_OPTIONS: option 'target' must be 'max-throughput'"),
        ("{stage: 1}", r"^KAREUS_OPTIONS is not valid JSON .*line 1 column 2.*KAREUS_OPTIONS='\{\"plan\""),
        ("[1, 2]", r"^KAREUS_OPTIONS: backend options must be an object .*got list"),
        ('{"clock_controller": "dry-run"}', r"^KAREUS_OPTIONS: option 'clock_controller' is a Python object"),
    ],
)
def test_bad_options_variable_names_variable_and_field(value, message):
    with pytest.raises(OptionsError, match=message):
        environment_options({OPTIONS_VAR: value})


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("bad.toml", 'gpu = "V100"\n', r"^KAREUS_CONFIG=.*bad.toml: option 'gpu': unknown GPU 'V100'"),
        ("bad.toml", "gpu = \n", r"^KAREUS_CONFIG=.*bad.toml is not valid TOML"),
        ("bad.json", '{"microbatches": 0}', r"^KAREUS_CONFIG=.*bad.json: option 'microbatches' must be"),
        ("bad.yaml", "gpu: A100\n", r"^KAREUS_CONFIG=.*bad.yaml: the options file must end in .toml or .json"),
        (None, None, r"^KAREUS_CONFIG=.*missing.toml: cannot read the options file"),
    ],
)
def test_bad_config_file_names_variable_and_field(tmp_path, name, text, message):
    path = tmp_path / (name or "missing.toml")
    if text is not None:
        path.write_text(text)
    with pytest.raises(OptionsError, match=message):
        environment_options({CONFIG_VAR: str(path)})


def test_conflict_between_environment_and_explicit_options_says_where_each_came_from():
    with pytest.raises(OptionsError, match=r"not both \(options \['plan'\] came from KAREUS_CONFIG / KAREUS_OPTIONS"):
        resolve_options({"tune": "simulated"}, {OPTIONS_VAR: '{"plan": "p.json"}'})


def _compile_and_run(options=None):
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    compiled = torch.compile(model, backend="kareus", options=options)
    compiled(torch.randn(4, 8)).sum().backward()


def test_backend_reads_the_environment_and_explicit_options_win(tmp_path, monkeypatch):
    from_env, explicit = tmp_path / "env", tmp_path / "explicit"
    monkeypatch.setenv(OPTIONS_VAR, json.dumps({"dump_dir": str(from_env), "inductor": False}))
    _compile_and_run()
    assert len(list(from_env.glob("kareus_graph_*.json"))) == 1
    _compile_and_run({"dump_dir": str(explicit)})
    assert len(list(explicit.glob("kareus_graph_*.json"))) == 1
    assert len(list(from_env.glob("kareus_graph_*.json"))) == 1


def test_backend_refuses_a_bad_environment_naming_it(monkeypatch):
    monkeypatch.setenv(OPTIONS_VAR, '{"nanobatch": "yes"}')
    with pytest.raises(Exception, match=r"KAREUS_OPTIONS: option 'nanobatch' must be True or False"):
        _compile_and_run()
