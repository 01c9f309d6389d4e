"""LTX-2 (video + audio streams): each recipe equals its diffusers pipeline chain on the same tiny checkpoint and
seed, video and audio both compared; per-stream guidance, rollouts per stream, policies on the family."""

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS, reference

TOL = 1e-4
STG_ON_BLOCK_1 = "recipe.phases.0.guidance.terms.1.layers=[1]"  # the tiny transformer has two blocks
GUIDED = {"guidance_scale": 3.0, "audio_guidance_scale": 7.0, "stg_scale": 1.0, "audio_stg_scale": 1.0,
          "modality_scale": 3.0, "audio_modality_scale": 3.0, "guidance_rescale": 0.7, "audio_guidance_rescale": 0.7,
          "spatio_temporal_guidance_blocks": [1]}
POSITIVE = {"guidance_scale": 1.0, "audio_guidance_scale": 1.0, "stg_scale": 0.0, "audio_stg_scale": 0.0,
            "modality_scale": 1.0, "audio_modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_rescale": 0.0}



def gen(seed):
    return [torch.Generator("cpu").manual_seed(seed)]


def assert_same(ours, video, audio):
    assert ours.array.shape == video.shape and ours.audio.shape == tuple(audio.shape)
    assert np.abs(ours.array - video).max() <= TOL
    assert np.abs(ours.audio - audio.float().numpy()).max() <= TOL


@pytest.mark.parametrize("version", ["2.3", "2.0", "2.3-bwe"])
def test_one_stage_t2v_with_every_guidance_term_on_both_streams_matches_diffusers(ltx2_dir, ltx20_dir, ltx23_bwe_dir,
                                                                                  version):
    """"2.3-bwe" is the bundled ltx2.3-t2v spec itself, on a checkpoint with LTX-2.3's 48 kHz vocoder."""
    from diffusers.pipelines.ltx2 import LTX2Pipeline

    source = {"2.3": ltx2_dir, "2.0": ltx20_dir, "2.3-bwe": ltx23_bwe_dir}[version]
    spec = "ltx2.3-t2v.yaml" if version == "2.3-bwe" else "ltx2-t2v.yaml"
    pipe = omnispec.build(SPECS / spec, source=str(source), overrides=[*TINY_OVERRIDES["ltx2"], STG_ON_BLOCK_1])
    ours = pipe("a robot dancing", seed=3, negative_prompt="blurry")
    assert ours.sample_rate == (48000 if version == "2.3-bwe" else 16000) and len(ours.frames) == 1
    video, audio = reference(LTX2Pipeline, source)(
        prompt="a robot dancing", negative_prompt="blurry", height=32, width=32, num_frames=5, frame_rate=25.0,
        num_inference_steps=3, max_sequence_length=16, generator=gen(3), output_type="np", return_dict=False, **GUIDED)
    assert_same(ours, video, audio)


def test_i2v_prepares_the_image_as_diffusers_does_including_its_crf(ltx2_dir, photo):
    from diffusers.pipelines.ltx2 import LTX2ImageToVideoPipeline

    pipe = omnispec.build(SPECS / "ltx2-i2v.yaml", source=str(ltx2_dir), overrides=[*TINY_OVERRIDES["ltx2"], STG_ON_BLOCK_1])
    image = Image.open(photo)
    ours = pipe("a robot dancing", seed=4, image=image)
    video, audio = reference(LTX2ImageToVideoPipeline, ltx2_dir)(
        image=image, prompt="a robot dancing", height=32, width=32, num_frames=5, frame_rate=25.0,
        num_inference_steps=3, max_sequence_length=16, generator=gen(4), output_type="np", return_dict=False, **GUIDED)
    assert_same(ours, video, audio)
    no_crf = omnispec.build(SPECS / "ltx2-i2v.yaml", source=str(ltx2_dir), overrides=[
        *TINY_OVERRIDES["ltx2"], STG_ON_BLOCK_1, "model.options.image_crf=0"])("a robot dancing", seed=4, image=image)
    assert np.abs(no_crf.array - ours.array).max() > 1e-3  # the re-compression moves the output


def test_an_image_to_recompress_without_pyav_is_one_error_before_any_weight_loads(ltx2_dir, photo, tmp_path,
                                                                                   monkeypatch, capsys):
    import sys

    from omnispec.cli import main

    class Built(Exception):
        pass

    def build(*args, **kwargs):
        raise Built

    monkeypatch.setitem(sys.modules, "av", None)  # PyAV absent: importing it fails
    monkeypatch.setattr("omnispec.runtime.build", build)
    sets = [a for o in [*TINY_OVERRIDES["ltx2"], STG_ON_BLOCK_1] for a in ("--set", o)]
    argv = ["run", str(SPECS / "ltx2-i2v.yaml"), "--source", str(ltx2_dir), *sets, "--prompt", "a robot dancing",
            "--image", str(photo), "--output", str(tmp_path / "x.gif")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: request.image: LTX-2 re-compresses") and "image_crf=0" in err, err
    with pytest.raises(Built):  # without the re-compression PyAV is not needed: the run goes on to load
        main([*argv, "--set", "model.options.image_crf=0"])


def test_two_stage_chain_with_the_distilled_lora_matches_diffusers_docs_chain(ltx2_dir, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline, LTX2LatentUpsamplerModel, LTX2Pipeline
    from peft import LoraConfig, get_peft_model_state_dict

    donor = LTX2VideoTransformer3DModel.from_pretrained(str(ltx2_dir), subfolder="transformer")
    torch.manual_seed(1)
    donor.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False))
    LTX2Pipeline.save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(donor))
    pipe = omnispec.build(SPECS / "ltx2-two-stage.yaml", source=str(ltx2_dir), overrides=[
        *TINY_OVERRIDES["ltx2"], "recipe.defaults.height=64", "recipe.defaults.width=64", STG_ON_BLOCK_1,
        f"model.adapters.distilled={{path: '{tmp_path}'}}"])
    ours = pipe("a robot dancing", seed=5)

    ref = reference(LTX2Pipeline, ltx2_dir)
    g = gen(5)
    draft, draft_audio = ref(prompt="a robot dancing", height=32, width=32, num_frames=5, frame_rate=25.0,
                             num_inference_steps=3, max_sequence_length=16, generator=g, output_type="latent",
                             return_dict=False, **GUIDED)
    upsampler = LTX2LatentUpsamplerModel.from_pretrained(str(ltx2_dir), subfolder="latent_upsampler")
    upsampled = LTX2LatentUpsamplePipeline(vae=ref.vae, latent_upsampler=upsampler)(
        latents=draft, latents_normalized=False, output_type="latent", return_dict=False)[0]
    ref.load_lora_weights(str(tmp_path), adapter_name="distilled")
    ref.set_adapters("distilled", 1.0)
    ref.scheduler = FlowMatchEulerDiscreteScheduler.from_config(ref.scheduler.config, use_dynamic_shifting=False,
                                                                shift_terminal=None)
    sigmas = [0.909375, 0.725, 0.421875]
    video, audio = ref(latents=upsampled, audio_latents=draft_audio, prompt="a robot dancing", num_frames=5,
                       frame_rate=25.0, num_inference_steps=3, sigmas=sigmas, noise_scale=sigmas[0],
                       max_sequence_length=16, generator=g, output_type="np", return_dict=False, **POSITIVE)
    assert_same(ours, video, audio)


def test_distilled_recipes_refuse_other_steps_custom_sigmas_and_a_negative_prompt(capsys):
    from omnispec.cli import main

    for spec in ("ltx2-distilled.yaml", "ltx2.3-distilled.yaml"):
        for flag in (["--steps", "4"], ["--sigmas", "1.0,0.7,0.4"], ["--negative-prompt", "blurry"]):
            assert main(["run", str(SPECS / spec), "--prompt", "x", *flag, "--output", "unused.mp4"]) == 2
            err = capsys.readouterr().err
            assert "refuses request field" in err and "distilled" in err and "Traceback" not in err


def test_rollout_scores_each_stream_and_replays_exactly(ltx2_dir):
    pipe = omnispec.build(SPECS / "ltx2-t2v.yaml", source=str(ltx2_dir), overrides=[
        *TINY_OVERRIDES["ltx2"], STG_ON_BLOCK_1, "recipe.defaults.steps=4"])
    ro = pipe.rollout("a robot dancing", group_size=2, seed=1,
                      sampler={"kind": "sde", "window": {"kind": "fixed", "start": 1, "length": 2}})
    assert set(ro.states) == set(ro.stream_log_probs) == {"video", "audio"}
    assert ro.states["video"].dtype == ro.states["audio"].dtype == torch.float32
    assert torch.allclose(ro.log_probs, ro.stream_log_probs["video"] + ro.stream_log_probs["audio"])
    replay = pipe.log_prob(ro, grad=False)
    assert torch.equal(replay.log_probs.cpu(), ro.log_probs)
    ratio = (pipe.log_prob(ro, grad=False, micro_batch=1).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-5


def test_attention_roles_fall_back_to_their_category_then_the_default(ltx2_dir):
    pipe = omnispec.build(SPECS / "ltx2-t2v.yaml", source=str(ltx2_dir), overrides=[
        *TINY_OVERRIDES["ltx2"], "policies.attention={default: sdpa, per_role: {self: sdpa_math, audio_self: sdpa}}"])
    chosen = pipe.policies.attention.per_role
    assert chosen["video_self"] == "sdpa_math" and chosen["audio_self"] == "sdpa"
    assert chosen["video_cross"] == chosen["audio_to_video"] == "sdpa"


def test_sequence_parallel_is_refused_with_the_reason():
    with pytest.raises(SpecError, match="split-RoPE"):
        omnispec.build(SPECS / "ltx2-t2v.yaml", overrides=["policies.parallel.ulysses=2"])


@pytest.mark.parametrize("where", ["default", "per_role.audio_self"])
def test_cudnn_attention_with_compile_is_refused(where):
    """cuDNN attention under dynamo crashes on LTX-2's audio attention; the rule that refuses hooked backends
    under compile covers it, by default and per role, before anything loads."""
    with pytest.raises(SpecError, match="sdpa_cudnn.*use auto, sdpa, flash4, sage or int8_fp8 with compile"):
        omnispec.load_spec(SPECS / "ltx2-t2v.yaml", overrides=[f"policies.attention.{where}=sdpa_cudnn",
                                                               "policies.compile.mode=regional"])


def test_stg_must_be_written_as_attention_scores_on_transformer_blocks(ltx2_dir):
    with pytest.raises(SpecError, match="skip: attention_scores"):
        omnispec.build(SPECS / "ltx2-t2v.yaml", source=str(ltx2_dir), overrides=[
            *TINY_OVERRIDES["ltx2"], "recipe.phases.0.guidance.terms.1.skip=block"])


def test_stg_rows_share_the_cfg_forward_and_modality_runs_alone(ltx2_dir):
    pipe = omnispec.build(SPECS / "ltx2-t2v.yaml", source=str(ltx2_dir), overrides=[*TINY_OVERRIDES["ltx2"], STG_ON_BLOCK_1])
    calls = []
    hook = pipe.components["transformer"].register_forward_pre_hook(
        lambda m, a, kw: calls.append((kw["hidden_states"].shape[0], kw["isolate_modalities"])), with_kwargs=True)
    try:
        pipe("a robot dancing", seed=0, steps=2)
    finally:
        hook.remove()
    assert calls == [(3, False), (1, True)] * 2  # [cond, uncond, stg rows] then the modality pass, each step


def test_stg_under_regional_compile_equals_eager_and_all_perturbed_rows_keep_their_values(ltx2_dir):
    """LTX-2.3's transformer decides on the device whether every row of an STG block is perturbed; diffusers'
    processor branched on that, which a compiled block (fullgraph) refused. The family's processor blends by the
    mask instead: compiled equals eager, and a forward whose rows are all perturbed equals diffusers' processor's."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2PerturbedAttnProcessor

    from omnispec.runtime.families.ltx2 import BranchlessPerturbedAttention

    base = [*TINY_OVERRIDES["ltx2"], STG_ON_BLOCK_1, "recipe.defaults.steps=2"]
    eager = omnispec.build(SPECS / "ltx2-t2v.yaml", source=str(ltx2_dir), overrides=base)  # LTX-2.3 weights
    compiled = omnispec.build(SPECS / "ltx2-t2v.yaml", source=str(ltx2_dir), overrides=[
        *base, "policies.compile.mode=regional", "policies.compile.backend=aot_eager"])
    a, b = eager("a robot dancing", seed=1), compiled("a robot dancing", seed=1)
    assert np.abs(a.array - b.array).max() <= TOL and np.abs(a.audio - b.audio).max() <= TOL

    transformer = eager.components["transformer"]
    attn = transformer.transformer_blocks[1].attn1
    assert type(attn.processor) is BranchlessPerturbedAttention
    x = torch.randn(2, 6, attn.to_q.in_features)
    mask = torch.zeros(2)[:, None, None]  # every row perturbed, as the transformer's default mask (float32)
    with torch.no_grad():
        theirs = LTX2PerturbedAttnProcessor()(attn, x, perturbation_mask=mask, all_perturbed=torch.all(mask == 0))
        ours = attn.processor(attn, x, perturbation_mask=mask, all_perturbed=torch.all(mask == 0))
    assert torch.equal(ours, theirs)


def test_component_config_overrides_reach_the_loaded_module(ltx20_dir):
    """LTX-2.0's diffusers config ignores STG (perturbed_attn false); Lightricks' code applies it. The override
    makes the same weights follow Lightricks: the STG pass then differs from the plain one."""
    base = [*TINY_OVERRIDES["ltx2"], STG_ON_BLOCK_1, "recipe.defaults.steps=2"]
    plain = omnispec.build(SPECS / "ltx2-t2v.yaml", source=str(ltx20_dir), overrides=base)
    official = omnispec.build(SPECS / "ltx2-t2v.yaml", source=str(ltx20_dir), overrides=[
        *base, "model.components.transformer.config={perturbed_attn: true}"])
    assert not plain.components["transformer"].config.perturbed_attn
    assert official.components["transformer"].config.perturbed_attn
    assert np.abs(plain("x", seed=0).array - official("x", seed=0).array).max() > 1e-4


def test_keyframe_conditions_at_the_first_and_last_frame_match_the_condition_pipeline(ltx2_dir, photo):
    """At motion speed 0.5 (model.options.motion_speed): the video's and the last keyframe's positions are taken at
    twice the frame rate, as the pipeline's motion_speed takes them."""
    from diffusers.pipelines.ltx2 import LTX2ConditionPipeline, LTX2VideoCondition

    first = Image.open(photo)
    last = first.transpose(Image.Transpose.ROTATE_90)
    pipe = omnispec.build(SPECS / "ltx2-keyframes.yaml", source=str(ltx2_dir),
                          overrides=[*TINY_OVERRIDES["ltx2"], STG_ON_BLOCK_1, "model.options.motion_speed=0.5"])
    ours = pipe("a robot dancing", seed=6, conditions=[{"image": first, "frame": 0}, {"image": last, "frame": -1}])
    video, audio = reference(LTX2ConditionPipeline, ltx2_dir)(
        conditions=[LTX2VideoCondition(frames=first, index=0), LTX2VideoCondition(frames=last, index=-1)],
        prompt="a robot dancing", height=32, width=32, num_frames=5, frame_rate=25.0, num_inference_steps=3,
        max_sequence_length=16, generator=gen(6), output_type="np", return_dict=False, motion_speed=0.5, **GUIDED)
    assert_same(ours, video, audio)


def test_outputs_carry_the_sound_track_as_mp4_wav_and_npy_beside_wav(ltx2_dir, tmp_path):
    import wave

    import av

    pipe = omnispec.build(SPECS / "ltx2-t2v.yaml", source=str(ltx2_dir), overrides=[
        *TINY_OVERRIDES["ltx2"], STG_ON_BLOCK_1, "recipe.defaults.steps=2"])
    out = pipe("a robot dancing", seed=0)
    (mp4,) = out.save(tmp_path / "clip.mp4")
    with av.open(str(mp4)) as container:
        kinds = sorted(stream.type for stream in container.streams)
        assert kinds == ["audio", "video"] and container.streams.video[0].frames == 5
    (sound,) = out.save(tmp_path / "sound.wav")
    with wave.open(str(sound)) as w:
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (2, 16000, out.audio.shape[-1])
    written = out.save(tmp_path / "frames.npy")
    assert [p.name for p in written] == ["frames.npy", "frames.wav"]
    assert np.array_equal(np.load(written[0]), out.array)


def test_text_the_connectors_leave_unpadded_goes_without_a_mask(ltx2_dir, monkeypatch):
    """diffusers' text connectors hand the transformer a mask of ones (registers fill the padding; without them the
    padding's additive mask still reads as ones), which it turns into a bias of zeros that keeps the cross-attentions
    on a masked kernel: the forwards pass no mask then. A mask that does mark padding goes to both streams."""
    overrides = [*TINY_OVERRIDES["ltx2"], "runtime.encoding_cache_bytes=0"]  # every call encodes its prompt
    pipe = omnispec.build(SPECS / "ltx2-t2v.yaml", source=str(ltx2_dir), overrides=overrides)
    seen = []
    hook = pipe.components["transformer"].register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw["encoder_attention_mask"], kw["audio_encoder_attention_mask"])),
        with_kwargs=True)
    plain = pipe("a robot", seed=0, steps=1).array
    assert seen and all(video is None and audio is None for video, audio in seen)
    connectors = pipe.family.helper.connectors

    def last_token_padded(*args, **kwargs):
        video, audio, mask = connectors(*args, **kwargs)
        return video, audio, torch.cat([mask[:, :-1], torch.zeros_like(mask[:, -1:])], dim=1)

    monkeypatch.setattr(pipe.family.helper, "connectors", last_token_padded)
    seen.clear()
    try:
        padded = pipe("a robot", seed=0, steps=1).array
    finally:
        hook.remove()
    assert seen and all(video is not None and audio is video and not video.all() for video, audio in seen)
    assert np.abs(padded - plain).max() > 0  # the last text token no longer counts
