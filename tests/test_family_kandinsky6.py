"""Kandinsky 6 (video + audio streams, ``Kandinsky6TI2VAPipeline``): text- and image-to-video equal the diffusers
pipeline on the same tiny checkpoint and seed, video and audio both compared, through ``omnispec.build`` and the
CLI; rollouts on an undistilled checkpoint score both streams and replay exactly, the distilled PiFlow checkpoint
refuses them with the reason; policies work or are refused; a mismatched checkpoint is refused before loading."""

import wave

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES, kandinsky6_tokenizer

from conftest import SPECS

TOL = 1e-4
TINY = TINY_OVERRIDES["kandinsky6"]
T2V, I2V = SPECS / "kandinsky6-distill-t2v.yaml", SPECS / "kandinsky6-distill-i2v.yaml"
# The undistilled layout (plain velocities, a flow-matching Euler scheduler): what rollouts need.
UNDISTILLED = [*TINY, "model.components.scheduler.class=diffusers.FlowMatchEulerDiscreteScheduler",
               "recipe.defaults.steps=4"]
WINDOW = {"kind": "sde", "window": {"kind": "fixed", "start": 1, "length": 2}}


@pytest.fixture(scope="module")
def k6_dir(kandinsky6_dir):
    return kandinsky6_dir  # the session's distilled checkpoint (conftest), shared with the catalog tests


@pytest.fixture(scope="module")
def k6_undistilled_dir(tmp_path_factory):
    from omnispec.testing import tiny_kandinsky6

    return tiny_kandinsky6(tmp_path_factory.mktemp("kandinsky6_undistilled"), distilled=False)


@pytest.fixture(scope="module")
def reference(k6_dir):
    """The diffusers pipeline on the fixture, its tokenizer loaded as the spec loads it (see the fixture)."""
    from diffusers import Kandinsky6TI2VAPipeline

    pipe = Kandinsky6TI2VAPipeline.from_pretrained(str(k6_dir), tokenizer=None, dtype=torch.float32)
    pipe.tokenizer = kandinsky6_tokenizer(k6_dir)
    pipe.set_progress_bar_config(disable=True)

    def run(seed, **kwargs):
        return pipe(prompt="a cat dancing", height=32, width=32, num_frames=5, num_inference_steps=3,
                    guidance_scale=1.0, max_sequence_length=16, generator=[torch.Generator("cpu").manual_seed(seed)],
                    output_type="np", return_dict=False, **kwargs)

    return run


@pytest.fixture(scope="module")
def image(photo):
    return Image.open(photo).convert("RGB")  # 24x40: resized and centre-cropped to 32x32


def assert_same(ours, video, audio):
    assert ours.array.shape == video.shape == (1, 5, 32, 32, 3)
    assert ours.audio.shape == (1, 1, audio.shape[-1]) and ours.sample_rate == 160
    assert np.abs(ours.array - video).max() <= TOL
    assert np.abs(ours.audio[:, 0] - audio).max() <= TOL


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_both_tasks_match_diffusers_on_video_and_audio(k6_dir, reference, image, task):
    spec, extra = (T2V, {}) if task == "t2v" else (I2V, {"image": image})
    ours = omnispec.build(spec, source=str(k6_dir), overrides=TINY)("a cat dancing", seed=3, **extra)
    video, audio = reference(3, **extra)
    assert_same(ours, video, audio)
    if task == "i2v":  # the reference frame conditions the clip
        assert np.abs(ours.array - reference(3)[0]).max() > 1e-3


def test_cli_image_to_video_matches_diffusers_and_writes_the_sound_track(k6_dir, reference, image, photo, tmp_path,
                                                                         capsys):
    from omnispec.cli import main

    out = tmp_path / "clip.npy"
    sets = [x for o in TINY for x in ("--set", o)]
    code = main(["run", str(I2V), "--source", str(k6_dir), "--prompt", "a cat dancing", "--image", str(photo),
                 "--seed", "5", *sets, "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    video, audio = reference(5, image=image)
    assert np.abs(np.load(out) - video).max() <= TOL
    with wave.open(str(out.with_suffix(".wav"))) as w:
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (1, 160, audio.shape[-1])


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_rollouts_score_both_streams_and_replay_exactly(k6_undistilled_dir, image, task):
    spec, extra = (T2V, {}) if task == "t2v" else (I2V, {"image": image})
    pipe = omnispec.build(spec, source=str(k6_undistilled_dir), overrides=UNDISTILLED)
    ro = pipe.rollout("a cat dancing", group_size=2, seed=1, sampler=WINDOW, **extra)
    assert set(ro.states) == set(ro.stream_log_probs) == {"video", "audio"}
    assert ro.states["video"].dtype == ro.states["audio"].dtype == torch.float32
    assert torch.allclose(ro.log_probs, ro.stream_log_probs["video"] + ro.stream_log_probs["audio"])
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)
    ratio = (pipe.log_prob(ro, grad=False, micro_batch=1).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-5


@pytest.mark.parametrize("multistep", ["refuse", "euler"])
def test_the_distilled_checkpoint_refuses_stochastic_samplers_and_other_schedules(k6_dir, multistep):
    pipe = omnispec.build(T2V, source=str(k6_dir), overrides=[*TINY, "recipe.defaults.steps=4"])
    with pytest.raises(SpecError, match="PiflowScheduler.*undistilled checkpoint"):
        pipe.rollout("a cat", group_size=2, seed=1, sampler={**WINDOW, "multistep": multistep})
    if multistep == "refuse":
        with pytest.raises(SpecError, match="2 PiFlow grid points.*schedule kind scheduler"):
            omnispec.build(T2V, source=str(k6_dir), overrides=[*TINY, "recipe.phases.0.schedule={kind: flow_match, shift: 5.0}"])


def test_distilled_recipes_refuse_sigmas_and_a_negative_prompt(capsys):
    from omnispec.cli import main

    for flag in (["--sigmas", "1.0,0.7,0.4"], ["--negative-prompt", "blurry"]):
        assert main(["run", str(T2V), "--prompt", "x", *flag, "--output", "unused.npy"]) == 2
        err = capsys.readouterr().err
        assert "refuses request field" in err and "without CFG" in err and "Traceback" not in err


def test_a_mismatched_checkpoint_is_refused_before_loading(k6_undistilled_dir, monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers.Kandinsky6Transformer3DModel, "from_pretrained", None)  # a load would fail loudly
    with pytest.raises(SpecError) as info:
        omnispec.build(T2V, source=str(k6_undistilled_dir), overrides=TINY)
    text = str(info.value)
    assert "model.components.scheduler.class" in text and "PiflowScheduler" in text
    assert "FlowMatchEulerDiscreteScheduler" in text


# ---- policies ----------------------------------------------------------------------------------------------------

EXACT = {
    "attention": "policies.attention={default: sdpa, per_role: {self: sdpa_math, audio_to_video: sdpa_math}}",
    "offload": "policies.offload={strategy: model}",
}
REFUSED = {
    "first_block": ("policies.cache={kind: first_block, threshold: 0.2}", "not in its TransformerBlockRegistry"),
    "taylorseer": ("policies.cache={kind: taylorseer, interval: 2}", "it would cache nothing"),
    "skip_layer": ("recipe.phases.0.guidance.terms=[{kind: skip_layer, scale: 2.0, layers: [1]}]",
                   "not in its TransformerBlockRegistry"),
    "ulysses": ("policies.parallel.ulysses=2", "no diffusers context-parallel plan"),
}


@pytest.fixture(scope="module")
def plain(k6_dir):
    return omnispec.build(T2V, source=str(k6_dir), overrides=TINY)("a cat dancing", seed=0)


@pytest.mark.parametrize("policy", list(EXACT))
def test_exact_policies_give_the_plain_output(k6_dir, plain, policy):
    pipe = omnispec.build(T2V, source=str(k6_dir), overrides=[*TINY, EXACT[policy]])
    out = pipe("a cat dancing", seed=0)
    assert np.abs(out.array - plain.array).max() <= 1e-5 and np.abs(out.audio - plain.audio).max() <= 1e-5
    if policy == "attention":  # every declared role reaches attention modules; roles fall back to their category
        target = pipe.family.targets.attention
        assert set(target.modules(pipe.components["transformer"].named_modules())) == set(target.roles)
        chosen = pipe.policies.attention.per_role
        assert chosen["video_self"] == chosen["text"] == chosen["audio_to_video"] == "sdpa_math"
        assert chosen["video_cross"] == "sdpa"


def test_a_step_cache_runs(k6_dir, plain):
    out = omnispec.build(T2V, source=str(k6_dir), overrides=[
        *TINY, "policies.cache={kind: step_mask, mask: [true, false, true]}"])("a cat dancing", seed=0)
    assert out.array.shape == plain.array.shape and np.abs(out.array - plain.array).max() > 0


@pytest.mark.parametrize("policy", list(REFUSED))
def test_unsupported_policies_are_refused_with_the_reason(policy):
    override, reason = REFUSED[policy]
    with pytest.raises(SpecError, match=reason):
        omnispec.build(T2V, overrides=[override])
