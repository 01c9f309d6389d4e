"""The embedded digits model: loads through the normal path, is deterministic, follows prompts; trainer runs."""

import numpy as np
import pytest
import torch

import omnispec

import preloaded
from conftest import ROOT, SPECS


@pytest.fixture(scope="module")
def digits():
    return omnispec.build(SPECS / "digits.yaml", overrides=["runtime.progress=false"])


def test_shipped_weights_are_small_and_load_through_from_pretrained(digits):
    weights = ROOT / "src_models" / "digits" / "weights"
    size = sum(p.stat().st_size for p in weights.rglob("*") if p.is_file())
    assert size < 8 * 2**20
    assert type(digits.components["transformer"]).__name__ == "DigitsDiT"


def test_generation_is_bitwise_deterministic_for_a_seed(digits):
    a = digits("seven", seed=123).array
    b = digits("seven", seed=123).array
    assert a.shape == (1, 32, 32, 1) and np.array_equal(a, b)


def test_images_are_bright_ink_on_dark_ground(digits):
    a = digits("the digit three", seed=1).array[0, ..., 0]
    assert np.median(a) < 0.2 and a.max() > 0.7


def test_prompts_steer_the_class():
    from benchmarks.digits_quality import evaluate, train_classifier

    pipe = omnispec.build(SPECS / "digits.yaml", overrides=["runtime.progress=false", "recipe.defaults.steps=12"])
    classifier = train_classifier()
    assert classifier.held_out_accuracy >= 0.97
    result = evaluate(pipe, classifier, per_digit=3)
    assert result["accuracy"] >= 0.8
    assert result["forwards_per_image"] == 24.0  # CFG: 2 rows per step


def test_trainer_runs_a_few_iterations(tmp_path):
    from src_models.digits.train import train

    out = train(steps=3, batch=8, out=tmp_path, log_every=1)
    assert len(out["history"]) == 3 and all(np.isfinite(h["loss"]) for h in out["history"])
    pipe = omnispec.build(SPECS / "digits.yaml", source=str(tmp_path), overrides=["runtime.progress=false"])
    assert pipe("one", seed=0, steps=2).array.shape == (1, 32, 32, 1)
    torch.manual_seed(0)


def test_cli_writes_a_recognisable_seven(tmp_path):
    import sys

    from PIL import Image

    from benchmarks.digits_quality import to_8x8, train_classifier

    res = preloaded.python_m([sys.executable, "-m", "omnispec", "run", str(SPECS / "digits.yaml"), "--prompt", "seven",
                              "--output", str(tmp_path / "seven.png")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    image = np.asarray(Image.open(tmp_path / "seven.png"), dtype=np.float32)[None, ..., None] / 255.0
    assert train_classifier().predict(to_8x8(image))[0] == 7
