"""Logging and progress: an ``omnispec`` logger, ``-v``/``-q``, the libraries' own verbosity variables respected,
``--version`` from one source, ``omnispec.rl`` after ``import omnispec``, ``pipe.explain()`` as text, and a Hub id
without a network failing at once with the way out."""

import logging
import os
import subprocess
import sys
import time

import pytest

import omnispec
from omnispec.cli import main

from conftest import ROOT, SPECS


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "omnispec", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def test_version_has_one_source(capsys):
    import tomllib

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"omnispec {omnispec.__version__}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "omnispec.version.__version__"}


def test_import_omnispec_exposes_rl_without_importing_torch_first():
    code = ("import sys, omnispec; assert 'torch' not in sys.modules; "
            "print(omnispec.rl.set_lora.__name__, omnispec.rl.reference.__name__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.split() == ["set_lora", "reference"], res.stderr


def test_build_has_a_typed_signature():
    import inspect

    params = inspect.signature(omnispec.build).parameters
    assert list(params)[:4] == ["spec_or_path", "source", "overrides", "device"]
    assert {"components", "process_group", "trust_code"} <= set(params)
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values())


def test_pipeline_explain_is_the_rendered_plan_and_a_dict_on_request():
    from omnispec.spec import render_explain

    pipe = omnispec.build(SPECS / "digits.yaml", overrides=["runtime.progress=false"])
    info = pipe.explain(as_dict=True)
    text = pipe.explain()
    assert isinstance(text, str) and text == render_explain(info)
    assert "phase 'generate'" in text and "applied here:" in text and info["phases"][0]["steps"] == 20


def test_default_run_shows_progress_and_quiet_shows_none(tmp_path):
    res = _cli("run", "digits", "--prompt", "7", "--steps", "2", "--output", str(tmp_path / "a.png"))
    assert res.returncode == 0, res.stderr
    assert "loaded 3 component(s)" in res.stderr and "decoding 1 sample(s)" in res.stderr
    assert "generate:" in res.stderr  # the denoising bar
    quiet = _cli("run", "digits", "--prompt", "7", "--steps", "2", "--output", str(tmp_path / "b.png"), "-q")
    assert quiet.returncode == 0 and quiet.stderr.strip() == "", quiet.stderr
    assert quiet.stdout.strip() == str(tmp_path / "b.png")


def test_library_verbosity_variables_win_over_the_flags(monkeypatch):
    import diffusers
    import transformers

    from omnispec.log import configure, logger

    before = (diffusers.utils.logging.get_verbosity(), transformers.utils.logging.get_verbosity())
    monkeypatch.setenv("DIFFUSERS_VERBOSITY", "info")
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    diffusers.utils.logging.set_verbosity(logging.INFO)
    try:
        configure(-1)
        assert diffusers.utils.logging.get_verbosity() == logging.INFO  # the user's DIFFUSERS_VERBOSITY stands
        assert transformers.utils.logging.get_verbosity() == logging.ERROR
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"  # the user's choice, not -q's
        assert logger.name == "omnispec" and logger.level == logging.ERROR  # -q: errors only
        configure(0)
        assert logger.level == logging.INFO
    finally:
        diffusers.utils.logging.set_verbosity(before[0])
        transformers.utils.logging.set_verbosity(before[1])
        monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)


def test_a_hub_id_without_a_network_fails_at_once_naming_the_way_out(tmp_path):
    start = time.perf_counter()
    res = _cli("run", "flux1-dev", "--prompt", "x", "--output", str(tmp_path / "x.png"),
               env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "unreachable" in res.stderr and "--source" in res.stderr and "HF_HUB_OFFLINE=1" in res.stderr
    assert time.perf_counter() - start < 60  # imports included; no download retries
