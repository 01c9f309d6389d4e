"""LTX-2.5 (video + audio, the diffusion video decoder): each task equals diffusers' LTX25ModularPipeline (its
LTX25AutoBlocks) on the same tiny checkpoint and seed, video and audio both compared, through omnispec.build and
the CLI; rollouts score both streams and replay exactly; policies; the checkpoint checks."""

import json
import shutil
import wave

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS

TOL = 1e-4
TINY = TINY_OVERRIDES["ltx25"]
PROMPT = "a robot dancing"
SIZE = dict(height=32, width=32, num_frames=5, frame_rate=25.0, num_inference_steps=3, max_sequence_length=16)


def modular(pipe):
    """diffusers' LTX-2.5 modular pipeline over the modules omnispec loaded, its guiders set as the bundled spec's
    guidance (STG on the tiny transformer's block 1)."""
    from diffusers.guiders import LTX2Guidance
    from diffusers.modular_pipelines import LTX25AutoBlocks

    ref = LTX25AutoBlocks().init_pipeline()
    names = ("transformer", "text_encoder", "tokenizer", "connectors", "vae", "diffusion_decoder", "audio_vae",
             "vocoder", "scheduler")
    ref.update_components(
        **{n: pipe.components[n] for n in names},
        guider=LTX2Guidance(guidance_scale=3.0, stg_scale=1.0, modality_scale=3.0, guidance_rescale=0.7,
                            spatio_temporal_guidance_blocks=[1]),
        audio_guider=LTX2Guidance(guidance_scale=7.0, stg_scale=1.0, modality_scale=3.0, guidance_rescale=0.7))
    return ref


def run_modular(pipe, seed, **inputs):
    out = modular(pipe)(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
                        output=["videos", "audio"], **SIZE, **inputs)
    return out["videos"], out["audio"]


def assert_same(ours, video, audio):
    assert ours.array.shape == video.shape and ours.audio.shape == tuple(audio.shape)
    assert np.abs(ours.array - video).max() <= TOL
    assert np.abs(ours.audio - audio.float().numpy()).max() <= TOL


@pytest.fixture(scope="module")
def t2v(ltx25_dir):
    return omnispec.build(SPECS / "ltx2.5-t2v.yaml", source=str(ltx25_dir), overrides=TINY)


@pytest.fixture(scope="module")
def t2v_reference(t2v):
    return run_modular(t2v, 3, negative_prompt="blurry")


def test_t2v_with_every_guidance_term_on_both_streams_matches_the_modular_pipeline(t2v, t2v_reference):
    ours = t2v(PROMPT, seed=3, negative_prompt="blurry")
    assert ours.sample_rate == 48000 and len(ours.frames) == 1
    assert_same(ours, *t2v_reference)


def test_the_cli_run_matches_the_modular_pipeline(ltx25_dir, t2v_reference, tmp_path):
    from omnispec.cli import main

    out = tmp_path / "clip.npy"
    sets = [a for o in TINY for a in ("--set", o)]
    assert main(["run", str(SPECS / "ltx2.5-t2v.yaml"), "--source", str(ltx25_dir), *sets, "--prompt", PROMPT,
                 "--negative-prompt", "blurry", "--seed", "3", "--output", str(out)]) == 0
    video, audio = t2v_reference
    assert np.abs(np.load(out) - video).max() <= TOL
    with wave.open(str(tmp_path / "clip.wav")) as w:  # the sound track beside the frames
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (2, 48000, audio.shape[-1])


def test_i2v_matches_the_modular_image2video_workflow_with_ltx25s_crf(ltx25_dir, photo):
    pipe = omnispec.build(SPECS / "ltx2.5-i2v.yaml", source=str(ltx25_dir), overrides=TINY)
    image = Image.open(photo)
    ours = pipe(PROMPT, seed=4, image=image)
    assert_same(ours, *run_modular(pipe, 4, image=image))
    from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

    assert resolve_default_image_crf(pipe.components["text_encoder"]) == 18  # Gemma 4: LTX-2.5's CRF


def test_first_and_last_frame_match_the_modular_condition_workflow(ltx25_dir, photo):
    from diffusers.pipelines.ltx2 import LTX2VideoCondition

    first = Image.open(photo)
    last = first.transpose(Image.Transpose.ROTATE_90)
    pipe = omnispec.build(SPECS / "ltx2.5-keyframes.yaml", source=str(ltx25_dir), overrides=TINY)
    ours = pipe(PROMPT, seed=6, conditions=[{"image": first, "frame": 0}, {"image": last, "frame": -1}])
    reference = run_modular(pipe, 6, conditions=[LTX2VideoCondition(frames=first, index=0),
                                                 LTX2VideoCondition(frames=last, index=-1)])
    assert_same(ours, *reference)


def test_rollout_scores_each_stream_and_replays_exactly(ltx25_dir):
    pipe = omnispec.build(SPECS / "ltx2.5-t2v.yaml", source=str(ltx25_dir), overrides=TINY)
    ro = pipe.rollout(PROMPT, group_size=2, seed=1,
                      sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 2}})
    assert set(ro.states) == set(ro.stream_log_probs) == {"video", "audio"}
    assert torch.allclose(ro.log_probs, ro.stream_log_probs["video"] + ro.stream_log_probs["audio"])
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)
    ratio = (pipe.log_prob(ro, grad=False, micro_batch=1).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-5


# ---- policies ----------------------------------------------------------------------------------------------------

def test_attention_roles_fall_back_to_their_category_then_the_default(ltx25_dir):
    pipe = omnispec.build(SPECS / "ltx2.5-t2v.yaml", source=str(ltx25_dir), overrides=[
        *TINY, "policies.attention={default: sdpa, per_role: {self: sdpa_math, audio_self: sdpa}}"])
    chosen = pipe.policies.attention.per_role
    assert chosen["video_self"] == "sdpa_math" and chosen["audio_self"] == "sdpa"
    assert chosen["video_cross"] == chosen["audio_to_video"] == "sdpa"


def test_a_step_cache_runs_and_skips_the_masked_steps_forwards(ltx25_dir):
    pipe = omnispec.build(SPECS / "ltx2.5-t2v.yaml", source=str(ltx25_dir), overrides=[
        *TINY, "policies.cache={kind: step_mask, mask: [true, false, true]}"])
    calls = []
    hook = pipe.components["transformer"].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        out = pipe(PROMPT, seed=0)
    finally:
        hook.remove()
    assert len(calls) == 2 * 2  # two of three steps, each the CFG+STG forward and the modality one
    assert out.array.shape == (1, 5, 32, 32, 3) and np.isfinite(out.array).all()


def test_sequence_parallel_and_cudnn_under_compile_are_refused_with_the_reason():
    with pytest.raises(SpecError, match="split-RoPE"):
        omnispec.build(SPECS / "ltx2.5-t2v.yaml", overrides=["policies.parallel.ulysses=2"])
    with pytest.raises(SpecError, match="sdpa_cudnn.*use auto, sdpa, flash4, sage or int8_fp8 with compile"):
        omnispec.load_spec(SPECS / "ltx2.5-t2v.yaml", overrides=["policies.attention.default=sdpa_cudnn",
                                                                 "policies.compile.mode=regional"])


def test_a_phase_that_does_not_start_from_noise_is_refused_with_the_reason(ltx25_dir):
    refine = ("recipe.phases=[{name: a, denoiser: transformer, schedule: {kind: flow_match}}, {name: b, denoiser: "
              "transformer, schedule: {kind: flow_match}, input: {kind: previous}}]")
    with pytest.raises(SpecError, match="diffusion decoder draws its noise") as info:
        omnispec.build(SPECS / "ltx2.5-t2v.yaml", source=str(ltx25_dir), overrides=[*TINY, refine])
    assert "recipe.phases.1.input" in str(info.value)


# ---- the checkpoint ----------------------------------------------------------------------------------------------

def test_an_ltx2_checkpoint_without_the_diffusion_decoder_is_refused_before_loading(ltx25_dir, tmp_path, monkeypatch):
    import diffusers

    root = tmp_path / "ckpt"
    shutil.copytree(ltx25_dir, root)
    index = json.loads((root / "model_index.json").read_text())
    del index["diffusion_decoder"]
    (root / "model_index.json").write_text(json.dumps(index))
    monkeypatch.setattr(diffusers.LTX2VideoTransformer3DModel, "from_pretrained", None)  # any load would fail
    with pytest.raises(SpecError) as info:
        omnispec.build(SPECS / "ltx2.5-t2v.yaml", source=str(root), overrides=TINY)
    text = str(info.value)
    assert "diffusion_decoder" in text and "LTX2VideoDiffusionDecoderModel" in text and "ltx25" in text


def test_init_tells_ltx25_from_ltx2_by_the_diffusion_decoder(ltx25_dir, ltx2_dir, capsys):
    from omnispec.cli import main

    for source, family in ((ltx25_dir, "ltx25"), (ltx2_dir, "ltx2")):
        assert main(["init", str(source)]) == 0
        assert f"family: {family}\n" in capsys.readouterr().out
