"""LTX-2.5 in-context generation with an IC-LoRA (family ltx25_ic, ltx2.5-ic-lora.yaml): equal to diffusers'
LTX25ModularPipeline's in_context workflow (LTX25AutoBlocks) on the tiny checkpoint with a tiny LoRA loaded by
diffusers' own loader, the same reference video and seed, video and audio compared, through omnispec.build and the
CLI; the reference downscale factor against the blocks' reference encoder; the conditioning attention strength, its
mask and the motion speed against the blocks' own inputs; rollouts replay exactly; what cannot be encoded is one
error line."""

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS, refused

TOL = 1e-4
SPEC = SPECS / "ltx2.5-ic-lora.yaml"
TINY = TINY_OVERRIDES["ltx25"]
PROMPT = "a robot dancing"
SIZE = dict(height=32, width=32, num_frames=5, frame_rate=25.0, num_inference_steps=3, max_sequence_length=16)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """A 5-frame reference video of another size and aspect (40x48), as an animated PNG (lossless), and its frames."""
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)) for _ in range(5)]
    path = tmp_path_factory.mktemp("ic") / "guide.png"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    return path, frames


@pytest.fixture(scope="module")
def ic_lora(ltx25_dir, tmp_path_factory):
    """A tiny IC-LoRA on the attentions, saved by diffusers' LTX-2 LoRA writer (``transformer.``-prefixed keys)."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2Pipeline
    from peft import LoraConfig, get_peft_model_state_dict

    donor = LTX2VideoTransformer3DModel.from_pretrained(str(ltx25_dir), subfolder="transformer")
    torch.manual_seed(7)
    donor.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights=False))
    folder = tmp_path_factory.mktemp("ic_lora")
    LTX2Pipeline.save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(donor))
    return folder


@pytest.fixture(scope="module")
def pipe(ltx25_dir, ic_lora):
    return omnispec.build(SPEC, source=str(ltx25_dir),
                          overrides=[*TINY, f"model.adapters.ic={{path: '{ic_lora}', always: true}}"])


MODULES = ("transformer", "text_encoder", "tokenizer", "connectors", "vae", "diffusion_decoder", "audio_vae", "vocoder",
           "scheduler")


def workflow(modules: dict):
    """diffusers' LTX-2.5 modular pipeline over ``modules``, its guiders as the bundled spec's guidance (STG on the
    tiny transformer's block 1)."""
    from diffusers.guiders import LTX2Guidance
    from diffusers.modular_pipelines import LTX25AutoBlocks

    blocks = LTX25AutoBlocks().init_pipeline()
    blocks.update_components(
        **{n: modules[n] for n in MODULES},
        guider=LTX2Guidance(guidance_scale=3.0, stg_scale=1.0, modality_scale=3.0, guidance_rescale=0.7,
                            spatio_temporal_guidance_blocks=[1]),
        audio_guider=LTX2Guidance(guidance_scale=7.0, stg_scale=1.0, modality_scale=3.0, guidance_rescale=0.7))
    blocks.set_progress_bar_config(disable=True)
    return blocks


def modular(ltx25_dir, ic_lora):
    """The workflow over modules loaded apart from omnispec's, the LoRA loaded by diffusers
    (``LTX2InContextPipeline.load_lora_weights``)."""
    from diffusers import LTX2VideoDiffusionDecoderModel
    from diffusers.pipelines.ltx2 import LTX2InContextPipeline

    loaded = LTX2InContextPipeline.from_pretrained(str(ltx25_dir), dtype=torch.float32)
    loaded.load_lora_weights(str(ic_lora), adapter_name="ic")
    decoder = LTX2VideoDiffusionDecoderModel.from_pretrained(str(ltx25_dir), subfolder="diffusion_decoder")
    return workflow({**loaded.components, "diffusion_decoder": decoder})


@pytest.fixture(scope="module")
def expected(ltx25_dir, ic_lora, clip):
    from diffusers.pipelines.ltx2 import LTX2ReferenceCondition

    out = modular(ltx25_dir, ic_lora)(
        prompt=PROMPT, negative_prompt="blurry", generator=torch.Generator("cpu").manual_seed(3), output_type="np",
        output=["videos", "audio"], reference_conditions=[LTX2ReferenceCondition(frames=clip[1])], **SIZE)
    return out["videos"], out["audio"].float().numpy()


def differences(array, audio, expected) -> tuple[float, float]:
    video, sound = expected
    assert array.shape == video.shape and audio.shape == sound.shape
    return float(np.abs(array - video).max()), float(np.abs(audio - sound).max())


def test_an_ic_lora_with_a_reference_video_matches_the_modular_in_context_workflow(pipe, clip, expected):
    ours = pipe(PROMPT, seed=3, negative_prompt="blurry", references=[{"video": clip[1]}])
    assert max(differences(ours.array, ours.audio, expected)) <= TOL


def test_the_cli_run_with_lora_and_reference_video_matches_the_modular_workflow(ltx25_dir, ic_lora, clip, expected,
                                                                              tmp_path):
    from omnispec.cli import main

    out = tmp_path / "clip.npy"
    sets = [a for o in TINY for a in ("--set", o)]
    assert main(["run", str(SPEC), "--source", str(ltx25_dir), *sets, "--lora", str(ic_lora), "--prompt", PROMPT,
                 "--negative-prompt", "blurry", "--seed", "3", "--reference-video", str(clip[0]),
                 "--output", str(out)]) == 0
    assert np.abs(np.load(out) - expected[0]).max() <= TOL


def test_the_reference_downscale_factor_makes_the_blocks_reference_tokens(ltx25_dir, clip):
    """Factor 2 at 64x64: the reference is encoded at 32x32 and its positions are doubled in space, as the blocks'
    reference encoder (``LTX2ReferenceEncoderStep``) makes them; the denoised latents equal the workflow's."""
    from diffusers.pipelines.ltx2 import LTX2ReferenceCondition

    pipe = omnispec.build(SPEC, source=str(ltx25_dir), overrides=[*TINY, "model.options.reference_downscale_factor=2"])
    request = pipe.request(PROMPT, seed=4, height=64, width=64, references=[{"video": clip[1]}])
    ours = pipe.generate(request, decode=False)
    state = workflow(pipe.components)(
        prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(4), output_type="latent",
        output=["videos", "reference_latents", "reference_coords"], reference_downscale_factor=2,
        reference_conditions=[LTX2ReferenceCondition(frames=clip[1])], **{**SIZE, "height": 64, "width": 64})
    geometry = pipe.family.geometry(request, 1.0)
    tokens, coords = geometry.extra["reference_tokens"], geometry.extra["reference_coords"]
    assert tokens.shape == state["reference_latents"].shape == (1, 5 * 16 * 16, 4)
    assert torch.equal(coords, state["reference_coords"]) and torch.equal(tokens, state["reference_latents"])
    video = pipe.family.unpack("video", ours.latents["video"], geometry)
    assert (video - state["videos"]).abs().max().item() <= TOL


def test_first_and_last_frame_with_two_references_of_other_lengths_match_the_workflow(ltx25_dir, clip, photo):
    """Keyframe tokens, then each reference's (5 frames and 1), in the blocks' order; no LoRA (the base model)."""
    from diffusers.pipelines.ltx2 import LTX2ReferenceCondition, LTX2VideoCondition

    pipe = omnispec.build(SPEC, source=str(ltx25_dir), overrides=[*TINY, "recipe.task=image-to-video"])
    first = Image.open(photo)
    last = first.transpose(Image.Transpose.ROTATE_90)
    ours = pipe(PROMPT, seed=6, conditions=[{"image": first, "frame": 0}, {"image": last, "frame": -1}],
                references=[{"video": clip[1]}, {"video": clip[1][:1]}])
    out = workflow(pipe.components)(
        prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(6), output_type="np", output=["videos", "audio"],
        conditions=[LTX2VideoCondition(frames=first, index=0), LTX2VideoCondition(frames=last, index=-1)],
        reference_conditions=[LTX2ReferenceCondition(frames=clip[1]), LTX2ReferenceCondition(frames=clip[1][:1])],
        **SIZE)
    assert max(differences(ours.array, ours.audio, (out["videos"], out["audio"].float().numpy()))) <= TOL


def test_an_ic_rollout_scores_both_streams_and_replays_exactly(pipe, clip):
    ro = pipe.rollout(PROMPT, group_size=1, seed=1, references=[{"video": clip[1]}],
                      sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 2}})
    assert set(ro.states) == set(ro.stream_log_probs) == {"video", "audio"}
    assert torch.allclose(ro.log_probs, ro.stream_log_probs["video"] + ro.stream_log_probs["audio"])
    replayed = pipe.log_prob(ro, grad=False).log_probs.cpu()
    assert torch.equal((replayed - ro.log_probs).exp(), torch.ones_like(ro.log_probs))


WEIGHTED = "model.options={conditioning_attention_strength: 0.6, motion_speed: 0.5}"


@pytest.fixture(scope="module")
def weighted(ltx25_dir):
    """The base model (no LoRA) with the reference tokens' attention at 0.6, motion at half speed, keyframes."""
    return omnispec.build(SPEC, source=str(ltx25_dir), overrides=[*TINY, WEIGHTED, "recipe.task=image-to-video"])


def attention_mask(frames: int) -> list[np.ndarray]:
    """A mask per frame over the reference's pixels: a ramp across its width, darker each frame."""
    ramp = np.linspace(0, 255, 48, dtype=np.float32)[None, :].repeat(40, axis=0)
    return [(ramp * (1 - 0.15 * k)).astype(np.uint8) for k in range(frames)]


def test_a_weighted_masked_slower_request_with_a_keyframe_matches_the_workflow(weighted, clip, photo):
    """conditioning_attention_strength and motion_speed (model.options) and a mask per frame (request mask) with a
    last-frame keyframe between the video's and the reference's tokens: the denoised video and audio latents equal
    the blocks' (given the same values as conditioning_attention_strength, conditioning_attention_mask, motion_speed);
    a rollout of that request replays with ratio exactly 1."""
    from diffusers.pipelines.ltx2 import LTX2ReferenceCondition, LTX2VideoCondition

    last = Image.open(photo)
    mask = attention_mask(5)
    request = weighted.request(PROMPT, seed=5, conditions=[{"image": last, "frame": -1}], mask=mask,
                               references=[{"video": clip[1]}], steps=2)
    ours = weighted.generate(request, decode=False)
    state = workflow(weighted.components)(
        prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(5), output_type="latent",
        output=["videos", "audio_latents"], conditions=[LTX2VideoCondition(frames=last, index=-1)],
        reference_conditions=[LTX2ReferenceCondition(frames=clip[1])], conditioning_attention_strength=0.6,
        conditioning_attention_mask=torch.from_numpy(np.stack(mask).astype(np.float32) / 255)[None, None],
        motion_speed=0.5, **{**SIZE, "num_inference_steps": 2})
    geometry = weighted.family.geometry(request, 1.0)
    video = weighted.family.unpack("video", ours.latents["video"], geometry)
    assert (video - state["videos"]).abs().max().item() <= TOL
    assert (ours.latents["audio"] - state["audio_latents"]).abs().max().item() <= TOL
    ro = weighted.rollout(PROMPT, group_size=1, seed=5, conditions=[{"image": last, "frame": -1}], mask=mask,
                          references=[{"video": clip[1]}], steps=2,
                          sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 1}})
    replayed = weighted.log_prob(ro, grad=False).log_probs.cpu()
    assert torch.equal((replayed - ro.log_probs).exp(), torch.ones_like(ro.log_probs))


def test_the_cli_run_with_a_strength_a_speed_and_a_mask_image_matches_the_workflow(ltx25_dir, weighted, clip,
                                                                                   tmp_path):
    """--set the two options and --mask one image (for every frame of the reference): the video equals the blocks'
    given that image repeated over the reference's frames."""
    from diffusers.pipelines.ltx2 import LTX2ReferenceCondition

    from omnispec.cli import main

    picture = attention_mask(1)[0]
    Image.fromarray(picture).save(tmp_path / "mask.png")
    sets = [a for o in [*TINY, "model.options.conditioning_attention_strength=0.3", "model.options.motion_speed=2"]
            for a in ("--set", o)]
    assert main(["run", str(SPEC), "--source", str(ltx25_dir), *sets, "--prompt", PROMPT, "--seed", "2",
                 "--reference-video", str(clip[0]), "--mask", str(tmp_path / "mask.png"), "--steps", "2",
                 "--output", str(tmp_path / "clip.npy")]) == 0
    out = workflow(weighted.components)(
        prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(2), output_type="np", output=["videos"],
        reference_conditions=[LTX2ReferenceCondition(frames=clip[1])], conditioning_attention_strength=0.3,
        conditioning_attention_mask=torch.from_numpy(picture.astype(np.float32) / 255)[None, None, None].repeat(
            1, 1, 5, 1, 1), motion_speed=2.0, **{**SIZE, "num_inference_steps": 2})
    assert np.abs(np.load(tmp_path / "clip.npy") - out["videos"]).max() <= TOL


# ---- what cannot be used ----------------------------------------------------------------------------------------

def test_a_reference_the_vae_cannot_encode_is_one_error_line(clip, tmp_path, capsys):
    short = tmp_path / "short.png"
    clip[1][0].save(short, save_all=True, append_images=clip[1][1:4])  # 4 frames: off the VAE's 4k+1 grid
    base = ["run", str(SPEC), *[a for o in TINY for a in ("--set", o)], "--prompt", "x",
            "--output", str(tmp_path / "o.mp4")]
    refused([*base, "--reference-video", str(short)], "request.references.0", "4 frames", "k*4+1", capsys=capsys)
    refused([*base, "--reference-video", str(clip[0]), "--set", "model.options.reference_downscale_factor=2"],
            "request.height", "multiple of 64", capsys=capsys)
    refused([*base, "--reference-video", str(clip[0]), "--set", "model.options.reference_downscale_factor=0"],
            "model.options.reference_downscale_factor", capsys=capsys)
    refused(base, "request.references", "reference videos", capsys=capsys)
    refused([*base, "--reference", str(clip[0])], "request.references.0", capsys=capsys)


def test_options_and_masks_it_cannot_use_are_one_error_line(clip, tmp_path, capsys):
    base = ["run", str(SPEC), *[a for o in TINY for a in ("--set", o)], "--prompt", "x", "--reference-video",
            str(clip[0]), "--output", str(tmp_path / "o.mp4")]
    for value in ("1.5", "-0.1", "true"):
        refused([*base, "--set", f"model.options.conditioning_attention_strength={value}"],
                "model.options.conditioning_attention_strength", "from 0", capsys=capsys)
    for value in ("0", "-1", "1000"):
        refused([*base, "--set", f"model.options.motion_speed={value}"], "model.options.motion_speed", capsys=capsys)
    four = tmp_path / "four.png"  # 4 mask frames over a 5-frame reference (2 latent frames): 1 + n*1 holds
    frames = [Image.fromarray(f) for f in attention_mask(4)]
    frames[0].save(four, save_all=True, append_images=frames[1:])
    Image.fromarray(attention_mask(1)[0]).save(tmp_path / "m.png")
    refused([*base, "--mask", str(tmp_path / "m.png"), "--mask-blur", "2"], "request.mask_blur", capsys=capsys)
    refused(["run", str(SPECS / "ltx2.5-t2v.yaml"), *[a for o in TINY for a in ("--set", o)], "--prompt", "x", "--mask",
             str(tmp_path / "m.png"), "--output", str(tmp_path / "o.mp4")], "request.mask", "takes no mask",
            capsys=capsys)
    refused(["run", str(SPECS / "minimax-h3-ref2va.yaml"), "--prompt", "x", "--reference-video", str(clip[0]),
             "--mask", str(tmp_path / "m.png"), "--output", str(tmp_path / "o.mp4")], "request.mask",
            "reads no mask with its references", capsys=capsys)


def test_a_mask_whose_frames_do_not_divide_the_reference_latent_frames_is_refused(clip):
    from omnispec.runtime.families.ltx25 import LTX25InContextFamily
    from omnispec.spec import load_spec
    from omnispec.spec.request import resolve_request

    spec = load_spec(SPEC, overrides=[*TINY, "recipe.defaults.frames=17"])
    reference = [Image.fromarray(f).convert("RGB") for f in attention_mask(1)] * 17  # 5 latent frames (4k+1 grid)
    request = resolve_request(spec, PROMPT, references=[{"video": reference}], mask=attention_mask(4))
    with pytest.raises(SpecError, match=r"1 \+ n\*4 frames"):
        LTX25InContextFamily.check_request(request, spec)
    LTX25InContextFamily.check_request(resolve_request(spec, PROMPT, references=[{"video": reference}],
                                                       mask=attention_mask(5)), spec)


def test_without_a_reference_video_the_family_says_which_spec_runs_the_lora(pipe):
    with pytest.raises(SpecError, match="ltx2.5-keyframes or ltx2.5-t2v with --lora"):
        pipe(PROMPT, seed=0)
