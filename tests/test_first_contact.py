"""What a newcomer meets: nothing the recipe ignores is taken silently, sizes follow the input image, the CLI is
quiet, diffusers' habits are understood."""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import omnispec
from omnispec import records
from omnispec.cli import main
from omnispec.log import HARMLESS
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import ROOT, SPECS, inherited_path

FLUX = TINY_OVERRIDES["flux"]
SETS = [a for o in FLUX for a in ("--set", o)]


def cli(*argv, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "omnispec", *argv], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=300)


# ---- no silent wrongness -------------------------------------------------------------------------------

def test_steps_are_refused_where_every_phase_walks_its_own(tmp_path, capsys):
    fixed = ["--set", "recipe.phases.0.schedule.steps=2"]
    assert main(["run", "digits", "--prompt", "7", "--steps", "12", *fixed, "--output", str(tmp_path / "x.png")]) == 2
    assert "request.steps: no phase of recipe 'digits' takes the request's steps" in capsys.readouterr().err
    assert main(["run", "digits", "--prompt", "7", *fixed, "--output", str(tmp_path / "ok.png")]) == 0


def test_a_one_expert_spec_is_refused_on_a_two_expert_checkpoint(wan22_dir):
    with pytest.raises(SpecError, match=r"transformer_2 \(WanTransformer3DModel\) that this spec does not load; it "
                                        r"is a two-expert checkpoint \(boundary_ratio 0.875\)"):
        omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(wan22_dir), overrides=TINY_OVERRIDES["wan"])


def test_a_prompt_longer_than_the_sequence_is_cut_with_a_warning(caplog):
    pipe = omnispec.build("digits", overrides=["runtime.progress=false", "recipe.defaults.steps=1"])
    long = "the digit seven seven seven seven seven seven seven"
    with caplog.at_level(logging.WARNING, logger="omnispec"):
        pipe(long, seed=0)
        pipe(long, seed=1)  # encoded once: cached, so said once
    said = [r.getMessage() for r in caplog.records if "tokens" in r.getMessage()]
    assert len(said) == 1 and "only the first 8 are used" in said[0] and f"{long!r} has " in said[0]


def test_a_negative_prompt_the_recipe_never_uses_is_said_once(caplog):
    pipe = omnispec.build("digits", overrides=["runtime.progress=false", "recipe.phases.0.guidance.terms=[]"])
    with caplog.at_level(logging.WARNING, logger="omnispec"):
        pipe.request("seven", negative_prompt="blurry")
        pipe.request("two", negative_prompt="blurry")
    assert sum("runs no negative-prompt pass" in r.getMessage() for r in caplog.records) == 1


# ---- sizes a user expects -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_photo(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide") / "wide.png"
    Image.fromarray((np.random.RandomState(1).rand(40, 72, 3) * 255).astype(np.uint8)).save(path)
    return path


def test_image_to_image_without_a_size_keeps_the_images(flux_dir, wide_photo, tmp_path, caplog):
    overrides = [o for o in FLUX if "height" not in o and "width" not in o]  # the bundled spec's: no size
    pipe = omnispec.build(SPECS / "flux1-dev-img2img.yaml", source=str(flux_dir), overrides=overrides)
    with caplog.at_level(logging.INFO, logger="omnispec"):
        out = pipe("a cat", seed=0, image=str(wide_photo))
    assert out.array.shape[1:3] == (32, 64)  # 40 x 72 floored to multiples of 16
    assert any("generating at 64x32 (no size was given: from the input image)" in r.getMessage()
               for r in caplog.records)
    (png,) = out.save(tmp_path / "cat.png")
    made = records.read(png).request
    assert (made.height, made.width, made.requested.model_dump()) == (32, 64, {"height": None, "width": None})
    assert np.array_equal(omnispec.replay(png).array, out.array)
    explicit = pipe("a cat", seed=0, image=str(wide_photo), height=48, width=48)  # parity: the size asked for
    assert explicit.array.shape[1:3] == (48, 48) and records.read(explicit.save(tmp_path / "e.png")[0]).request.requested is None


def test_kontext_fits_the_images_aspect_to_its_area_and_records_both(flux_dir, wide_photo, tmp_path):
    overrides = [o for o in FLUX if "height" not in o and "width" not in o] + ["model.options.max_area=2048",
                                                                               "model.options.auto_resize=false"]
    pipe = omnispec.build(SPECS / "flux1-kontext-dev.yaml", source=str(flux_dir), overrides=overrides)
    out = pipe("make it blue", seed=0, image=str(wide_photo), steps=1)
    height, width = out.array.shape[1:3]
    assert width > height and abs(height * width - 2048) <= 1024  # 64 x 32: the image's aspect at ~2048 px
    made = records.read(out.save(tmp_path / "blue.png")[0])
    assert (made.request.height, made.request.width) == (height, width) and made.request.requested is not None
    assert f"Size: {width}x{height}" in Image.open(tmp_path / "blue.png").text["parameters"]


# ---- diffusers habits ------------------------------------------------------------------------------------

def test_guidance_scale_zero_on_a_recipe_without_guidance_is_a_recorded_no_op(z_image_dir, tmp_path):
    pipe = omnispec.build(SPECS / "z-image-turbo.yaml", source=str(z_image_dir), overrides=TINY_OVERRIDES["z_image"])
    plain = pipe("a cat", seed=0, steps=2)
    off = pipe("a cat", seed=0, steps=2, guidance_scale=0.0)
    assert np.array_equal(plain.array, off.array)
    assert records.read(off.save(tmp_path / "cat.png")[0]).request.guidance_scale == 0.0
    with pytest.raises(SpecError, match="no guidance scale to set"):
        pipe("a cat", guidance_scale=4.0)


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchvision") is not None,
                    reason="torchvision is installed: the processor loads")
def test_a_component_that_needs_torchvision_names_the_extra(qwen_edit_dir):
    with pytest.raises(SpecError, match=r"needs torchvision .*pip install 'omnispec-diffusion\[qwen-edit\]'"):
        omnispec.build(SPECS / "qwen-image-edit.yaml", source=str(qwen_edit_dir),
                       overrides=TINY_OVERRIDES["qwen_image_edit"])


# ---- quiet by default, silent with -q, one voice under torchrun --------------------------------------------

def test_the_cli_says_nothing_of_the_libraries_and_nothing_at_all_with_q(flux_dir, wan_dir, tmp_path):
    run = ["run", "flux1-dev", "--source", str(flux_dir), "--prompt", "cat", *SETS, "--steps", "1"]
    loud = cli(*run, "--output", str(tmp_path / "a.png"))
    assert loud.returncode == 0, loud.stderr
    for noise in ("torchao", "torchvision", "Tensor objects", "pytree", "Enum subclass", "publisher trust"):
        assert noise not in loud.stderr, loud.stderr
    quiet = cli("-q", *run, "--output", str(tmp_path / "b.png"))
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.strip() == str(tmp_path / "b.png")
    video = cli("-q", "run", "wan2.1-t2v-1.3b", "--source", str(wan_dir), "--prompt", "cat", "--steps", "1",
                *[a for o in TINY_OVERRIDES["wan"] for a in ("--set", o)], "--output", str(tmp_path / "c.mp4"))
    assert video.returncode == 0 and video.stderr == "", video.stderr  # no "[0, 1]" line, no encoding bar


@pytest.mark.parametrize("verbosity, shown", [(0, False), (-1, False), (1, True)])
def test_a_librarys_syntax_warnings_reach_only_a_verbose_cli(tmp_path, verbosity, shown):
    """A library compiled at import (no bytecode cache: -B here) warns of its own source, e.g. torchao 0.17's
    invalid escape sequences on python 3.12: a note for its authors, which a run's stderr showed."""
    (tmp_path / "noisy_library.py").write_text("x = 1\nsame = x is 1\n")  # SyntaxWarning: "is" with a literal
    script = f"from omnispec.log import configure; configure({verbosity}); import noisy_library"
    path = os.pathsep.join([str(tmp_path), str(ROOT), *inherited_path()])
    out = subprocess.run([sys.executable, "-B", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr
    assert ("SyntaxWarning" in out.stderr) == shown, out.stderr


def test_a_rank_other_than_zero_says_nothing_and_exits_as_rank_zero_does(tmp_path):
    """Under torchrun every rank finds the same mistake; rank 0 says it, the others only exit 2."""
    out = cli("run", "digits", "--prompt", "7", "--output", str(tmp_path / "x.png"), env={"RANK": "1"})
    assert out.returncode == 0 and out.stderr == "", out.stderr
    bad = cli("run", "digits", "--prompt", "7", "--steps", "0", "--output", str(tmp_path / "y.png"), env={"RANK": "1"})
    assert bad.returncode == 2 and bad.stderr == "", bad.stderr
    unparsed = cli("run", "digits", "--steps", "many", env={"RANK": "1"})
    assert unparsed.returncode == 2 and unparsed.stderr == "", unparsed.stderr


def test_library_use_demotes_the_known_harmless_messages_to_debug():
    script = ("import logging; logging.basicConfig(level=logging.INFO, format='%(name)s|%(message)s')\n"
              "logging.getLogger('omnispec').setLevel(logging.DEBUG)\n"
              "import omnispec; omnispec.build('digits', overrides=['runtime.progress=false'])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = out.stderr.splitlines()
    for name, piece in HARMLESS:
        assert not [line for line in lines if piece in line and not line.startswith("omnispec|")], out.stderr
    assert any(line.startswith("omnispec|torchao: Failed to load") for line in lines) or \
        not any("Failed to load" in line for line in lines)
