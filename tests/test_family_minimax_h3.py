"""MiniMax-H3 (modular pipeline only) against diffusers' MiniMaxH3ModularPipeline on one tiny checkpoint: video and
stereo audio compared, rollouts scoring both streams, policies on the family, checkpoint checks."""

from __future__ import annotations

import wave
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
import transformers
from diffusers.modular_pipelines import MiniMaxH3Blocks
from PIL import Image

import omnispec
from omnispec.cli import main
from omnispec.spec import SpecError
from omnispec.testing import minimax_h3_processor, tiny_checkpoint

SPECS = Path(__file__).resolve().parent.parent / "specs"
PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint("minimax-h3-t2v", tmp_path_factory.mktemp("minimax_h3"))


@pytest.fixture(scope="module")
def processor(tiny):
    return minimax_h3_processor(tiny[0] / "processor")


@pytest.fixture(scope="module")
def pipe(tiny, processor):
    root, overrides = tiny
    return omnispec.build("minimax-h3-t2v", source=root, overrides=overrides, components={"processor": processor})


@pytest.fixture(scope="module")
def keyframes():
    """A portrait first frame (stretched onto the canvas) and a landscape last frame (cover-cropped onto it)."""
    rng = np.random.default_rng(0)
    return (Image.fromarray(rng.integers(0, 255, (48, 40, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 255, (40, 64, 3), dtype=np.uint8)))


@pytest.fixture(scope="module")
def diffusers_pipe(tiny, processor):
    """diffusers' modular pipeline on the same files."""
    root = tiny[0]
    modules = {name: getattr(diffusers, cls).from_pretrained(root / name) for name, cls in [
        ("transformer", "MiniMaxH3Transformer3DModel"), ("vae", "AutoencoderKLMiniMaxH3"),
        ("audio_vae", "AutoencoderKLMiniMaxH3Audio"), ("scheduler", "MiniMaxH3Scheduler"),
        ("audio_scheduler", "MiniMaxH3Scheduler")]}
    modules["text_encoder"] = transformers.Qwen3VLForConditionalGeneration.from_pretrained(root / "text_encoder")
    modules["tokenizer"] = transformers.AutoTokenizer.from_pretrained(root / "tokenizer")
    ref = MiniMaxH3Blocks().init_pipeline()
    ref.update_components(processor=processor, **modules)
    return ref


def reference(ref, seed: int, steps: int, **keyframes):
    """num_inference_steps counts the grid's terminal 0: ``steps`` forwards are ``steps + 1`` of it."""
    out = ref(prompt=PROMPT, height=32, width=32, num_frames=124, num_inference_steps=steps + 1,
              generator=torch.Generator("cpu").manual_seed(seed), output_type="np", output=["videos", "audio"],
              **keyframes)
    return np.asarray(out["videos"]), out["audio"].numpy()


@pytest.fixture(scope="module")
def expected(diffusers_pipe):
    return reference(diffusers_pipe, seed=3, steps=3)


def test_t2va_video_and_stereo_audio_match_diffusers(pipe, expected):
    ours = pipe(PROMPT, seed=3)
    video, audio = expected
    assert ours.array.shape == video.shape == (1, 124, 32, 32, 3)
    assert ours.audio.shape == audio.shape == (1, 2, 1656) and ours.sample_rate == 320
    assert np.abs(ours.array - video).max() <= 1e-4
    assert np.abs(ours.audio - audio).max() <= 1e-4
    assert np.abs(ours.audio[:, 0] - ours.audio[:, 1]).max() > 1e-3  # two channels, not one copied


@pytest.mark.parametrize("which", ["first_and_last", "last"])
def test_fl2va_first_and_last_frames_match_diffusers(tiny, processor, diffusers_pipe, keyframes, which):
    first, last = keyframes
    theirs = {"image": first, "last_image": last} if which == "first_and_last" else {"last_image": last}
    ours = [{"image": first, "frame": 0}, {"image": last, "frame": -1}] if which == "first_and_last" else \
        [{"image": last, "frame": -1}]
    root, overrides = tiny
    pipe = omnispec.build("minimax-h3-fl2va", source=root, overrides=overrides, components={"processor": processor})
    out = pipe(PROMPT, seed=5, conditions=ours)
    video, audio = reference(diffusers_pipe, seed=5, steps=3, **theirs)
    assert np.abs(out.array - video).max() <= 1e-4 and np.abs(out.audio - audio).max() <= 1e-4


def test_fl2va_canvas_follows_the_first_keyframe_and_middle_frames_are_refused(tiny, processor, keyframes):
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    root, overrides = tiny
    pipe = omnispec.build("minimax-h3-fl2va", source=root, components={"processor": processor},
                          overrides=[*overrides, "recipe.defaults.height=null", "recipe.defaults.width=null"])
    first = keyframes[0]
    geometry = pipe.family.geometry(pipe.request(PROMPT, 0, image=first), 1.0)
    assert (geometry.height, geometry.width) == resolve_canvas_size(*first.size, 32, 768, 768 * 1344) == (928, 768)
    with pytest.raises(SpecError, match="frame 0 or ends on one at the last frame"):
        pipe(PROMPT, seed=0, conditions=[{"image": first, "frame": 17}])


def test_cli_run_matches_diffusers_and_writes_the_stereo_track(tiny, expected, tmp_path, capsys):
    """The processor's class is the torchvision-free loader here (transformers builds Qwen3VLProcessor's video part
    only with torchvision), so the checkpoint's class check is off for this run."""
    root, overrides = tiny
    loader = "omnispec.testing.fixtures_minimax_h3:ImageOnlyQwen3VLProcessorLoader"
    sets = [x for o in [*overrides, f"model.components.processor.class={loader}", "model.check_checkpoint=false"]
            for x in ("--set", o)]
    out = tmp_path / "out.npy"
    assert main(["run", str(SPECS / "minimax-h3-t2v.yaml"), "--source", str(root), *sets, "--prompt", PROMPT,
                 "--seed", "3", "--output", str(out)]) == 0, capsys.readouterr().err
    assert np.abs(np.load(out) - expected[0]).max() <= 1e-4
    with wave.open(str(out.with_suffix(".wav"))) as track:
        assert track.getnchannels() == 2 and track.getframerate() == 320 and track.getnframes() == 1656


def test_cli_fl2va_with_keyframe_files_matches_diffusers(tiny, diffusers_pipe, keyframes, tmp_path, capsys):
    root, overrides = tiny
    loader = "omnispec.testing.fixtures_minimax_h3:ImageOnlyQwen3VLProcessorLoader"
    sets = [x for o in [*overrides, f"model.components.processor.class={loader}", "model.check_checkpoint=false"]
            for x in ("--set", o)]
    first, last = tmp_path / "first.png", tmp_path / "last.png"
    keyframes[0].save(first)
    keyframes[1].save(last)
    out = tmp_path / "out.npy"
    assert main(["run", str(SPECS / "minimax-h3-fl2va.yaml"), "--source", str(root), *sets, "--prompt", PROMPT,
                 "--image", str(first), "--image", f"{last}@-1", "--seed", "5", "--output", str(out)]) == 0, \
        capsys.readouterr().err
    video, _ = reference(diffusers_pipe, seed=5, steps=3, image=Image.open(first), last_image=Image.open(last))
    assert np.abs(np.load(out) - video).max() <= 1e-4


def test_prompts_of_different_lengths_in_one_request_are_each_their_own_run(pipe):
    both = pipe([PROMPT, "a fox"], seed=[3, 4])  # two text lengths: two layouts, one forward each
    alone = pipe("a fox", seed=4)
    assert both.array.shape[0] == 2 and np.abs(both.array[1] - alone.array[0]).max() <= 1e-5
    assert np.abs(both.audio[1] - alone.audio[0]).max() <= 1e-5


@pytest.mark.parametrize("task", ["t2va", "fl2va"])
def test_rollout_scores_both_streams_and_replays_exactly(tiny, processor, pipe, keyframes, task):
    """fl2va: replay conditions the walks without starting them, so the keyframes' noise (each sample's first
    draws) is drawn again from the seeds."""
    kwargs = {}
    if task == "fl2va":
        pipe = omnispec.build("minimax-h3-fl2va", source=tiny[0], overrides=tiny[1],
                              components={"processor": processor})
        kwargs = {"conditions": [{"image": keyframes[0], "frame": 0}, {"image": keyframes[1], "frame": -1}]}
    ro = pipe.rollout(PROMPT, group_size=2, seed=1, sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0,
                                                                                       "length": 2}}, **kwargs)
    assert set(ro.states) == set(ro.stream_log_probs) == {"video", "audio"}
    assert torch.allclose(ro.log_probs, ro.stream_log_probs["video"] + ro.stream_log_probs["audio"])
    replay = pipe.log_prob(ro, grad=False)
    assert torch.equal(replay.log_probs.cpu(), ro.log_probs)
    ratio = (pipe.log_prob(ro, grad=False, micro_batch=1).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-5


def test_audio_walks_its_own_shift_on_the_video_grid(pipe):
    family = pipe.family
    video = torch.tensor([1.0, 0.9, 0.5, 0.0])
    audio = family.stream_sigmas(video)["audio"]
    base = video / (12 - 11 * video)
    assert torch.allclose(audio, 3 * base / (1 + 2 * base)) and audio[0] == 1 and audio[-1] == 0


def test_guidance_negative_prompts_and_sequence_split_are_refused_with_the_reason(tiny, capsys):
    with pytest.raises(SpecError, match="guidance-distilled"):
        omnispec.build(SPECS / "minimax-h3-t2v.yaml", overrides=["recipe.phases.0.guidance.terms=[{kind: cfg, "
                                                                 "scale: 3.0}]"])
    with pytest.raises(SpecError, match="context-parallel"):
        omnispec.build(SPECS / "minimax-h3-t2v.yaml", overrides=["policies.parallel.ulysses=2"])
    root, overrides = tiny
    sets = [x for o in overrides for x in ("--set", o)]
    assert main(["run", str(SPECS / "minimax-h3-t2v.yaml"), "--source", str(root), *sets, "--prompt", "x",
                 "--negative-prompt", "blurry", "--output", "unused.npy"]) == 2
    err = capsys.readouterr().err
    assert "negative_prompt" in err and "guidance-distilled" in err and "Traceback" not in err


def test_an_attention_role_and_a_cache_run_on_the_family_and_block_hooks_are_refused(tiny, processor):
    root, overrides = tiny
    pipe = omnispec.build("minimax-h3-t2v", source=root, components={"processor": processor}, overrides=[
        *overrides, "policies.attention={default: sdpa, per_role: {text: sdpa_math}}",
        "policies.cache={kind: step_mask, mask: [true, false, true]}"])
    assert pipe.policies.attention.per_role["text"] == "sdpa_math"
    out = pipe(PROMPT, seed=3)
    assert np.isfinite(out.array).all() and np.isfinite(out.audio).all()
    with pytest.raises(SpecError, match="MiniMaxH3TransformerBlock"):
        omnispec.build(SPECS / "minimax-h3-t2v.yaml", overrides=["policies.cache={kind: first_block}"])


def test_layerwise_offload_gives_the_plain_output(tiny, processor, expected):
    root, overrides = tiny
    pipe = omnispec.build("minimax-h3-t2v", source=root, components={"processor": processor},
                          overrides=[*overrides, "policies.offload={strategy: layerwise}"])
    out = pipe(PROMPT, seed=3)
    assert np.abs(out.array - expected[0]).max() <= 1e-4 and np.abs(out.audio - expected[1]).max() <= 1e-4


def test_a_checkpoint_of_another_model_is_refused_before_loading(tiny):
    root, overrides = tiny
    with pytest.raises(SpecError, match=r"model.components.transformer.class: the spec loads "
                                        r"diffusers.LTX2VideoTransformer3DModel but .*MiniMaxH3Transformer3DModel"):
        omnispec.build(SPECS / "minimax-h3-t2v.yaml", source=str(root), overrides=[
            *overrides, "model.components.transformer.class=diffusers.LTX2VideoTransformer3DModel"])


def test_a_schedule_shift_other_than_the_checkpoint_scheduler_is_refused(tiny):
    root, overrides = tiny
    with pytest.raises(SpecError, match="shift"):
        omnispec.build(SPECS / "minimax-h3-t2v.yaml", source=str(root), overrides=[
            *overrides, "recipe.phases.0.schedule.shift=5.0"])
