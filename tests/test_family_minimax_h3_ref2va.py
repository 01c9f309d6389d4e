"""MiniMax-H3 from references (ref2va) against diffusers' MiniMaxH3ModularPipeline on one tiny checkpoint: an image,
a video with its sound and a sound in one request, and a single reference, through omnispec.build and the CLI (the
CLI reading files, diffusers decoding the same files with its references' from_file); a rollout replays exactly;
what the blocks would refuse is refused before any weight loads."""

from __future__ import annotations

import wave
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
import transformers
from diffusers.modular_pipelines import MiniMaxH3Blocks
from diffusers.modular_pipelines.minimax_h3 import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from PIL import Image

import omnispec
from omnispec.cli import main
from omnispec.spec import SpecError
from omnispec.testing import minimax_h3_processor, tiny_checkpoint
from omnispec.testing.fixtures_minimax_h3 import REF2VA_CONFIGS

av = pytest.importorskip("av")  # the video extra (in dev): the reference video file

SPECS = Path(__file__).resolve().parent.parent / "specs"
SPEC = str(SPECS / "minimax-h3-ref2va.yaml")
PROMPT = "<Picture 1> walks as in <Video 1>, speaking as <Audio 2>"
RATE = 320  # the tiny audio VAE's sample rate (another would be resampled with torchaudio)
LOADER = "omnispec.testing.fixtures_minimax_h3:ImageOnlyQwen3VLProcessorLoader"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint("minimax-h3-ref2va", tmp_path_factory.mktemp("minimax_h3_ref2va"))


@pytest.fixture(scope="module")
def processor(tiny):
    return minimax_h3_processor(tiny[0] / "processor")


@pytest.fixture(scope="module")
def pipe(tiny, processor):
    root, overrides = tiny
    return omnispec.build("minimax-h3-ref2va", source=root, overrides=overrides, components={"processor": processor})


@pytest.fixture(scope="module")
def diffusers_pipe(tiny, processor):
    """diffusers' modular pipeline on the same files, its canvas configs as the tiny overrides set them."""
    root = tiny[0]
    modules = {name: getattr(diffusers, cls).from_pretrained(root / name) for name, cls in [
        ("transformer_ref", "MiniMaxH3Transformer3DModel"), ("vae", "AutoencoderKLMiniMaxH3"),
        ("audio_vae", "AutoencoderKLMiniMaxH3Audio"), ("scheduler", "MiniMaxH3Scheduler"),
        ("audio_scheduler", "MiniMaxH3Scheduler")]}
    modules["text_encoder"] = transformers.Qwen3VLForConditionalGeneration.from_pretrained(root / "text_encoder")
    modules["tokenizer"] = transformers.AutoTokenizer.from_pretrained(root / "tokenizer")
    ref = MiniMaxH3Blocks().init_pipeline()
    ref.update_components(processor=processor, **modules)
    ref.register_to_config(**REF2VA_CONFIGS)
    return ref


@pytest.fixture(scope="module")
def media():
    """A portrait image, 24 landscape frames at 12 fps (2 s: 48 frames at the model's 24) with a stereo sound, and
    a mono voice."""
    rng = np.random.default_rng(0)
    return {"image": Image.fromarray(rng.integers(0, 255, (48, 40, 3), dtype=np.uint8)),
            "frames": rng.integers(0, 255, (24, 24, 40, 3), dtype=np.uint8),
            "sound": (0.3 * rng.standard_normal((2, 2 * RATE))).astype(np.float32),
            "voice": (0.3 * rng.standard_normal((1, RATE))).astype(np.float32)}


def reference(ref, references, seed: int, steps: int = 3):
    """num_inference_steps counts the grid's terminal 0: ``steps`` forwards are ``steps + 1`` of it."""
    out = ref(prompt=PROMPT, references=references, height=32, width=32, num_frames=124,
              num_inference_steps=steps + 1, generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
              output=["videos", "audio"])
    return np.asarray(out["videos"]), out["audio"].numpy()


def differences(ours, theirs) -> tuple[float, float]:
    return float(np.abs(ours.array - theirs[0]).max()), float(np.abs(ours.audio - theirs[1]).max())


def test_an_image_a_video_with_its_sound_and_a_sound_match_diffusers(pipe, diffusers_pipe, media):
    ours = pipe(PROMPT, seed=3, references=[
        media["image"], {"video": media["frames"], "fps": 12, "audio": media["sound"], "sample_rate": RATE},
        {"audio": media["voice"], "sample_rate": RATE}])
    theirs = reference(diffusers_pipe, [
        MiniMaxH3ImageReference(image=media["image"]),
        MiniMaxH3VideoReference(frames=media["frames"], fps=12.0, audio=torch.from_numpy(media["sound"]),
                                sample_rate=RATE),
        MiniMaxH3AudioReference(audio=torch.from_numpy(media["voice"]), sample_rate=RATE)], seed=3)
    assert ours.array.shape == theirs[0].shape == (1, 124, 32, 32, 3) and ours.audio.shape == theirs[1].shape
    assert max(differences(ours, theirs)) <= 1e-4


def test_one_reference_matches_diffusers_and_the_references_steer_the_output(pipe, diffusers_pipe, media):
    ours = pipe(PROMPT, seed=4, references=media["image"])
    theirs = reference(diffusers_pipe, [MiniMaxH3ImageReference(image=media["image"])], seed=4)
    assert max(differences(ours, theirs)) <= 1e-6
    other = pipe(PROMPT, seed=4, references=[media["image"].transpose(Image.Transpose.FLIP_LEFT_RIGHT)])
    assert np.abs(other.array - ours.array).max() > 1e-5  # random tiny weights: a small but real change


def write_clip(path: Path, frames: np.ndarray, fps: int, sound: np.ndarray) -> None:
    """A Matroska file: lossless FFV1 frames and 16-bit PCM stereo sound at the tiny audio VAE's rate."""
    with av.open(str(path), "w", format="matroska") as container:
        video = container.add_stream("ffv1", rate=fps)
        video.height, video.width = frames.shape[1:3]
        video.pix_fmt = "yuv444p"
        audio = container.add_stream("pcm_s16le", rate=RATE, layout="stereo")
        for frame in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
        samples = av.AudioFrame.from_ndarray((sound * 32767).astype(np.int16).T.reshape(1, -1), format="s16",
                                             layout="stereo")
        samples.sample_rate = RATE
        container.mux(audio.encode(samples))
        container.mux(audio.encode())


def write_wav(path: Path, sound: np.ndarray) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(sound.shape[0])
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes((sound.T * 32767).astype("<i2").tobytes())


@pytest.fixture(scope="module")
def files(tmp_path_factory, media):
    folder = tmp_path_factory.mktemp("ref2va_media")
    paths = {"image": folder / "subject.png", "clip": folder / "motion.mkv", "voice": folder / "voice.wav"}
    media["image"].save(paths["image"])
    write_clip(paths["clip"], media["frames"], 12, media["sound"])
    write_wav(paths["voice"], media["voice"])
    return paths


def cli_sets(overrides) -> list[str]:
    """The processor's class is the torchvision-free loader (transformers builds Qwen3VLProcessor's video part only
    with torchvision), so the checkpoint's class check is off for these runs."""
    return [x for o in [*overrides, f"model.components.processor.class={LOADER}", "model.check_checkpoint=false"]
            for x in ("--set", o)]


def test_cli_reads_reference_files_in_order_as_diffusers_decodes_them(tiny, diffusers_pipe, files, tmp_path, capsys):
    root, overrides = tiny
    out = tmp_path / "out.npy"
    assert main(["run", SPEC, "--source", str(root), *cli_sets(overrides), "--prompt", PROMPT, "--seed", "5",
                 "--reference", str(files["image"]), "--reference-video", str(files["clip"]),
                 "--reference-audio", str(files["voice"]), "--output", str(out)]) == 0, capsys.readouterr().err
    video, audio = reference(diffusers_pipe, [MiniMaxH3ImageReference.from_file(files["image"]),
                                              MiniMaxH3VideoReference.from_file(files["clip"]),
                                              MiniMaxH3AudioReference.from_file(files["voice"])], seed=5)
    assert np.abs(np.load(out) - video).max() <= 1e-4
    with wave.open(str(out.with_suffix(".wav"))) as track:
        heard = np.frombuffer(track.readframes(track.getnframes()), "<i2").reshape(-1, 2).T / 32767.0
    assert np.abs(heard - audio[0]).max() <= 2 / 32767  # the stereo track, as 16-bit PCM
    # the record names each reference in order, so the output replays from it
    again = tmp_path / "again.npy"
    assert main(["run", "--from", str(out), "--source", str(root), *cli_sets([]), "--output", str(again)]) == 0, \
        capsys.readouterr().err
    assert np.array_equal(np.load(again), np.load(out))


def test_rollout_scores_both_streams_and_replays_exactly(pipe, media):
    ro = pipe.rollout(PROMPT, group_size=2, seed=1, references=[
        media["image"], {"video": media["frames"], "fps": 12, "audio": media["sound"], "sample_rate": RATE}],
        sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 2}})
    assert set(ro.states) == set(ro.stream_log_probs) == {"video", "audio"}
    assert torch.allclose(ro.log_probs, ro.stream_log_probs["video"] + ro.stream_log_probs["audio"])
    replay = pipe.log_prob(ro, grad=False)
    assert torch.equal(replay.log_probs.cpu(), ro.log_probs)  # the ratio is exactly 1


@pytest.mark.parametrize(("references", "fragment"), [
    ([], "1 to 12 references"),
    ([{"audio": np.zeros((1, 400), np.float32), "sample_rate": RATE}], "at least one image or video"),
    ([np.zeros((32, 32, 3), np.uint8)] * 10, "at most 9 image references"),
    ([{"video": np.zeros((10, 32, 32, 3), np.uint8)}], "at least 22 frames at 24 fps"),
    ([np.zeros((32, 160, 3), np.uint8)], "within 1:4 and 4:1"),
])
def test_requests_the_blocks_refuse_are_refused_with_the_reason(pipe, references, fragment):
    with pytest.raises(SpecError, match=fragment):
        pipe(PROMPT, seed=0, references=references)


def test_a_sound_at_another_rate_without_torchaudio_names_it(pipe, media):
    try:
        import torchaudio  # noqa: F401
    except ImportError:
        with pytest.raises(SpecError, match="needs `torchaudio`.*pip install torchaudio"):
            pipe(PROMPT, seed=0, references=[media["image"], {"audio": media["voice"], "sample_rate": 2 * RATE}])
    else:
        pytest.skip("torchaudio is installed: the sound is resampled")


def test_keyframes_and_the_other_partition_are_refused_and_init_drafts_each_partition(tiny, files, tmp_path,
                                                                                       capsys):
    root, overrides = tiny
    assert main(["run", SPEC, "--source", str(root), *cli_sets(overrides), "--prompt", "x", "--image",
                 str(files["image"]), "--reference", str(files["image"]), "--output", str(tmp_path / "x.npy")]) == 2
    assert "takes no image" in capsys.readouterr().err
    for spec, other, why in ((SPEC, "transformer", "t2va / fl2va partition"),
                             (SPECS / "minimax-h3-t2v.yaml", "transformer_ref", "ref2va partition")):
        with pytest.raises(SpecError, match=why):
            component = f"{{role: denoiser, class: diffusers.MiniMaxH3Transformer3DModel, subfolder: {other}}}"
            omnispec.build(spec, overrides=[f"model.components.{other}={component}",
                                            f"recipe.phases.0.denoiser={other}"])
    for family, left_out in (("minimax_h3", "transformer_ref"), ("minimax_h3_ref2va", "transformer")):
        assert main(["init", str(root), "--family", family]) == 0
        drafted = capsys.readouterr().out
        assert f"left out: {left_out}, " in drafted and f"\n    {left_out}:" not in drafted
