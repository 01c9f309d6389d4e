"""The wheel ships the bundled specs and the embedded model under ``omnispec``; installed, a bundled spec runs by
name from anywhere."""

import os
import subprocess
import sys
import tomllib
import zipfile

import pytest

from conftest import ROOT, inherited_path


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_package_list_names_every_package_on_disk():
    listed = set(_project()["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "omnispec").rglob("__init__.py")}
    found |= {"omnispec.specs"} | {"omnispec." + ".".join(p.parent.relative_to(ROOT).parts)
                                   for p in (ROOT / "src_models").rglob("__init__.py")}
    assert listed == found


def test_metadata_declares_license_urls_and_bounds():
    project = _project()["project"]
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert {"Homepage", "Source", "Issues"} <= set(project["urls"])
    assert any(c.startswith("Typing ::") for c in project["classifiers"]) and (ROOT / "omnispec" / "py.typed").exists()
    deps = project["dependencies"]
    assert "diffusers>=0.42,<0.43" in deps and not any(d.startswith("scikit-learn") for d in deps)
    quant = project["optional-dependencies"]["quant"]
    assert any(d.startswith("torchao>=") and "<" in d for d in quant)


def test_one_torch_resolution_and_a_free_distribution_name():
    """The base install bounds torch to one minor and no extra names torch again (none can move it), so no command
    of the README reinstalls it; the distribution is not PyPI's "omnispec", another author's placeholder."""
    project = _project()["project"]
    assert project["name"] == "omnispec-diffusion"
    (torch,) = [d for d in project["dependencies"] if d.startswith("torch")]
    assert torch == "torch>=2.13,<2.14"
    for extra, requirements in project["optional-dependencies"].items():
        assert not any(r.split(">")[0].split("<")[0].split("=")[0] == "torch" for r in requirements), extra


@pytest.mark.slow
def test_the_installed_wheel_runs_a_bundled_spec_by_name(tmp_path):
    import shutil

    source = tmp_path / "source"  # a copy: an in-tree build would leave build/ in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for name in ("omnispec", "specs", "src_models"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(source)], capture_output=True, text=True, cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("omnispec_diffusion-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "omnispec/specs/flux1-dev.yaml" in names and "omnispec/py.typed" in names
    assert "omnispec/src_models/digits/weights/transformer/diffusion_pytorch_model.safetensors" in names
    assert not any(n.startswith("src_models/") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, cwd=tmp_path)
    assert install.returncode == 0, install.stderr
    code = ("import omnispec, pathlib; assert pathlib.Path(omnispec.__file__).parent.parent == pathlib.Path(%r); "
            "p = omnispec.build('digits', overrides=['runtime.progress=false', 'recipe.defaults.steps=2']); "
            "print(type(p.components['transformer']).__module__, p('seven', seed=0).array.shape)") % str(site)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *inherited_path()])})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == "omnispec.src_models.digits.model"
