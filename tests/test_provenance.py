"""Every output records what made it (spec, request, versions, checkpoint) and is made again from that record:
``omnispec.replay``, ``omnispec run --from``, ``omnispec explain OUTPUT``."""

import json

import numpy as np
import pytest
from PIL import Image

import omnispec
from omnispec import records
from omnispec.cli import main
from omnispec.records.schema import parse_record
from omnispec.replaying import image_arguments
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS

FLUX = [*TINY_OVERRIDES["flux"], "recipe.defaults.steps=2"]
WAN = [*TINY_OVERRIDES["wan"], "recipe.defaults.steps=2"]


@pytest.fixture(scope="module")
def flux(flux_dir):
    return omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=FLUX)


def test_png_records_spec_request_versions_and_checkpoint(flux, flux_dir, tmp_path):
    out = flux(["a cat", "a dog"], seed=3, guidance_scale=4.0)
    first, second = out.save(tmp_path / "pets.png")
    made_by = records.read(second)
    assert made_by.sample == 1
    assert made_by.request.prompts == ["a cat", "a dog"] and made_by.request.seeds == [3, 4]
    assert made_by.request.guidance_scale == 4.0 and made_by.request.height == 32
    assert set(made_by.versions.model_dump()) == {"omnispec", "diffusers", "transformers", "torch"}
    assert made_by.versions.omnispec == omnispec.__version__
    assert omnispec.load_spec(made_by.spec) == flux.spec
    (root,) = made_by.checkpoint.roots.values()
    assert root.kind == "local" and root.path == str(flux_dir.resolve())
    assert "transformer/config.json" in root.config_sha256 and "model_index.json" in root.config_sha256
    assert Image.open(first).text["parameters"].startswith("a cat\nSteps: 2, Seed: 3, Size: 32x32, CFG scale: 4")


def test_replay_of_an_image_sample_is_identical(flux, tmp_path):
    out = flux(["a cat", "a dog"], seed=3)
    out.save(tmp_path / "pets.png")
    again = omnispec.replay(tmp_path / "pets-1.png")
    assert np.array_equal(again.array[0], out.array[1])
    assert again.provenance["sample"] == 1 and again.request.prompts == ["a cat", "a dog"]


def test_replay_of_a_video_from_its_mp4_is_identical(wan_dir, tmp_path):
    import av

    pipe = omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(wan_dir), overrides=WAN)
    out = pipe("a red car", seed=5, negative_prompt="blurry")
    (mp4,) = out.save(tmp_path / "car.mp4")
    with av.open(str(mp4)) as container:
        assert container.streams.video[0].frames == 5
        assert json.loads(container.metadata["comment"])["request"]["negative_prompt"] == "blurry"
    again = omnispec.replay(mp4)
    assert np.array_equal(again.array, out.array)


def test_npy_and_wav_get_a_sidecar_and_replay_the_whole_batch(flux, tmp_path):
    out = flux(["a cat", "a dog"], seed=0)
    written = out.save(tmp_path / "pets.npy")
    assert [p.name for p in written] == ["pets.npy"] and (tmp_path / "pets.npy.json").is_file()
    assert records.read(written[0]).sample is None
    assert np.array_equal(omnispec.replay(written[0]).array, out.array)


def test_an_existing_sidecar_counts_as_an_existing_output(flux, tmp_path):
    (tmp_path / "x.npy.json").write_text("{}")
    with pytest.raises(SpecError, match="x.npy.json exists"):
        flux("a cat", seed=0).save(tmp_path / "x.npy")


def test_conditioning_images_are_recorded_by_digest_and_path(flux_dir, photo, tmp_path):
    pipe = omnispec.build(SPECS / "flux1-dev-img2img.yaml", source=str(flux_dir), overrides=FLUX)
    out = pipe("a cat", seed=1, image=str(photo), strength=0.6)
    (png,) = out.save(tmp_path / "cat.png")
    (image,) = records.read(png).request.images
    assert image.path == str(photo.resolve()) and image.digest == out.request.images[0].digest
    assert np.array_equal(omnispec.replay(png).array, out.array)
    changed = tmp_path / "photo.png"
    Image.open(photo).rotate(90).save(changed)
    moved = records.read(png).request.images[0].model_copy(update={"path": str(changed)})
    with pytest.raises(SpecError, match="has changed since"):
        image_arguments([moved])


def test_changed_checkpoint_configs_or_in_memory_weights_refuse_replay(flux, tmp_path):
    out = flux("a cat", seed=0)
    made_by = parse_record({**out.provenance, "weights_changed": 1})
    assert "changed in memory" in str(records.replay_problems(made_by, None)[0])
    data = json.loads(json.dumps(out.provenance))
    (root,) = data["checkpoint"]["roots"].values()
    root["config_sha256"]["transformer/config.json"] = "0" * 64
    assert "transformer/config.json" in str(records.replay_problems(parse_record(data), None)[0])


def test_cli_run_from_an_output_makes_the_same_file_and_explain_shows_what_made_it(flux_dir, tmp_path, capsys):
    sets = [a for o in FLUX for a in ("--set", o)]
    assert main(["run", "flux1-dev", "--source", str(flux_dir), "--prompt", "a cat", "--prompt", "a dog", "--seed", "7",
                 "--output", str(tmp_path / "pets.png"), *sets]) == 0
    assert main(["run", "--from", str(tmp_path / "pets-1.png"), "--output", str(tmp_path / "again.png")]) == 0
    assert np.array_equal(np.asarray(Image.open(tmp_path / "pets-1.png")), np.asarray(Image.open(tmp_path / "again.png")))
    assert records.read(tmp_path / "again.png").sample == 1
    capsys.readouterr()
    assert main(["run", "--from", str(tmp_path / "pets-1.png"), "--seed", "9", "--output", str(tmp_path / "s9.png")]) == 0
    request = records.read(tmp_path / "s9.png").request
    assert (request.prompts, request.seeds) == (["a dog"], [9])  # the file's own prompt with the new seed
    capsys.readouterr()
    assert main(["explain", str(tmp_path / "pets-1.png")]) == 0
    text = capsys.readouterr().out
    assert "prompt 'a dog', seed 8 (sample 1 of 2)" in text and "checkpoint: " in text and "phase 'generate'" in text


def test_explain_of_a_file_without_a_record_says_so(tmp_path, capsys):
    Image.new("RGB", (8, 8)).save(tmp_path / "plain.png")
    assert main(["explain", str(tmp_path / "plain.png")]) == 2
    assert "records nothing about how it was made" in capsys.readouterr().err


def test_a_record_replays_from_any_directory_and_refuses_a_changed_lora(flux_dir, tmp_path, monkeypatch, capsys):
    """Relative ``--source`` and ``--lora`` are recorded resolved; the LoRA file is recorded by its SHA-256."""
    from test_lora_files import kohya_lora

    work = tmp_path / "work"
    (work / "loras").mkdir(parents=True)
    _, weight_name = kohya_lora(work / "loras")
    (tmp_path / "ckpt").symlink_to(flux_dir, target_is_directory=True)
    monkeypatch.chdir(work)
    sets = [a for o in FLUX for a in ("--set", o)]
    assert main(["run", "flux1-dev", "--source", "../ckpt", "--lora", f"loras/{weight_name}@0.8", "--prompt", "a cat",
                 "--output", "cat.npy", *sets]) == 0
    monkeypatch.chdir(tmp_path.parent)
    assert main(["run", "--from", str(work / "cat.npy"), "--output", str(tmp_path / "again.npy")]) == 0
    assert np.array_equal(np.load(work / "cat.npy"), np.load(tmp_path / "again.npy"))
    capsys.readouterr()
    assert main(["explain", str(work / "cat.npy")]) == 0
    assert f"lora_0           {work / 'loras' / weight_name}, scale 0.8, on in every phase" in capsys.readouterr().out
    lora = work / "loras" / weight_name
    lora.write_bytes(lora.read_bytes()[:-1] + b" ")
    capsys.readouterr()
    assert main(["run", "--from", str(work / "cat.npy"), "--output", str(tmp_path / "changed.npy")]) == 2
    assert f"the LoRA file {lora.resolve()} has changed since" in capsys.readouterr().err


def test_a_deeply_nested_record_is_refused_without_a_traceback(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["explain", str(deep)]) == 2
    assert "nested deeper than" in capsys.readouterr().err
    record = tmp_path / "made.npy"
    np.save(record, np.zeros(1))
    (tmp_path / "made.npy.json").write_text("{\"omnispec\": " + "[" * 50_000 + "]" * 50_000 + "}")
    for argv in (["explain", str(record)], ["run", "--from", str(record), "--output", str(tmp_path / "x.npy")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "record was not read" in err and "Traceback" not in err
