"""Kandinsky 6 super-resolution (``Kandinsky6SRPipeline``): the upscaled video equals the diffusers pipeline's on the
same tiny checkpoint, video and seed, at every scale, through the latent upscaler and through pixel tiles, through
``omnispec.build`` and the CLI; rollouts on an undistilled checkpoint replay exactly, the distilled one refuses them
with the reason; policies work or are refused; the release's other checkpoint is refused naming its family."""

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS

TOL = 1e-4
TINY = TINY_OVERRIDES["kandinsky6_sr"]
SR, T2V = SPECS / "kandinsky6-sr.yaml", SPECS / "kandinsky6-distill-t2v.yaml"
# The undistilled layout without the latent upscaler (plain velocities, Euler; pixel tiles): what rollouts need.
UNDISTILLED = [*TINY, "recipe.defaults.steps=4", (
    "model.components={transformer: {role: denoiser, class: diffusers.Kandinsky6SRTransformer3DModel, subfolder: "
    "transformer}, vae: {role: vae, class: diffusers.Kandinsky6SRVAE, subfolder: vae}, scheduler: {role: scheduler, "
    "class: diffusers.FlowMatchEulerDiscreteScheduler, subfolder: scheduler}}")]
WINDOW = {"kind": "sde", "window": {"kind": "fixed", "start": 1, "length": 2}}
# the transformer's flex attention runs eagerly on the CPU, which torch warns about (the tiles here are tiny)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(scope="module")
def sr_dir(kandinsky6_sr_dir):
    return kandinsky6_sr_dir  # the session's distilled checkpoint with its upscaler bank (conftest)


@pytest.fixture(scope="module")
def sr_plain_dir(tmp_path_factory):
    from omnispec.testing import tiny_kandinsky6_sr

    return tiny_kandinsky6_sr(tmp_path_factory.mktemp("kandinsky6_sr_plain"), distilled=False, upscaler=False)


@pytest.fixture(scope="module")
def video():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)) for _ in range(5)]


def reference(root, video, seeds, steps=2, **kwargs):
    """One diffusers call per seed, each sample's frames stacked (what one omnispec request of those seeds gives)."""
    from diffusers import Kandinsky6SRPipeline

    pipe = Kandinsky6SRPipeline.from_pretrained(str(root), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return np.concatenate([pipe(video=video, num_inference_steps=steps, generator=[torch.Generator("cpu").manual_seed(s)],
                                output_type="np", **kwargs).frames for s in seeds])


@pytest.mark.parametrize("scale", [2, 2.25, 4])
def test_every_scale_matches_diffusers_through_the_latent_upscaler(sr_dir, video, scale):
    pipe = omnispec.build(SR, source=str(sr_dir), overrides=[*TINY, f"model.options.resolution_scale={scale}"])
    ours = pipe(["a", "b"], seed=[3, 4], video=video)
    theirs = reference(sr_dir, video, [3, 4], resolution_scale=scale)
    size = {2: (48, 80), 2.25: (56, 88), 4: (96, 160)}[scale]
    assert ours.array.shape == theirs.shape == (2, 5, *size, 3)
    assert np.abs(ours.array - theirs).max() <= TOL


def test_pixel_tiles_in_batches_match_diffusers(sr_plain_dir, video):
    options = ["model.options={resolution_scale: 2.25, lq_noise_scale: 0.5, min_overlap: 0.4, tiles_batch_size: 2}"]
    ours = omnispec.build(SR, source=str(sr_plain_dir), overrides=[*UNDISTILLED, *options])("a", seed=2, video=video)
    theirs = reference(sr_plain_dir, video, [2], steps=4, lq_noise_scale=0.5, min_overlap=0.4, tiles_batch_size=2)
    assert np.abs(ours.array - theirs).max() <= TOL


def test_cli_matches_diffusers(sr_dir, video, tmp_path, capsys):
    from omnispec.cli import main

    clip, out = tmp_path / "clip.webp", tmp_path / "big.npy"
    video[0].save(clip, save_all=True, append_images=video[1:], lossless=True)
    sets = [x for o in TINY for x in ("--set", o)]
    code = main(["run", str(SR), "--source", str(sr_dir), "--prompt", "", "--video", str(clip), "--seed", "5", *sets,
                 "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    assert np.abs(np.load(out) - reference(sr_dir, video, [5])).max() <= TOL


def test_rollouts_replay_exactly(sr_plain_dir, video):
    pipe = omnispec.build(SR, source=str(sr_plain_dir), overrides=UNDISTILLED)
    ro = pipe.rollout("a", group_size=2, seed=1, sampler=WINDOW, video=video)
    assert ro.states["latents"].dtype == torch.float32
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)
    ratio = (pipe.log_prob(ro, grad=False, micro_batch=1).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-5


def test_the_distilled_checkpoint_refuses_rollouts_and_other_schedules(sr_dir, video):
    pipe = omnispec.build(SR, source=str(sr_dir), overrides=[*TINY, "recipe.defaults.steps=4"])
    with pytest.raises(SpecError, match="PiflowScheduler.*undistilled checkpoint"):
        pipe.rollout("a", group_size=2, seed=1, sampler=WINDOW, video=video)
    with pytest.raises(SpecError, match="2 PiFlow grid points.*schedule kind scheduler"):
        omnispec.build(SR, source=str(sr_dir), overrides=[*TINY, "recipe.phases.0.schedule={kind: flow_match, shift: 5.0}"])


def test_the_other_kandinsky6_checkpoint_is_refused_naming_its_family(sr_dir, kandinsky6_dir):
    with pytest.raises(SpecError, match="lacks.*latent_upscaler.*names Kandinsky6TI2VAPipeline, which family "
                                        "'kandinsky6' runs"):
        omnispec.build(SR, source=str(kandinsky6_dir), overrides=TINY)
    with pytest.raises(SpecError, match="lacks.*text_encoder.*names Kandinsky6SRPipeline, which family "
                                        "'kandinsky6_sr' runs"):
        omnispec.build(T2V, source=str(sr_dir), overrides=TINY_OVERRIDES["kandinsky6"])
    # with every folder there (an SR spec without the upscaler bank), the index check names the family
    with pytest.raises(SpecError, match="Kandinsky6TI2VAPipeline checkpoint, which family 'kandinsky6' runs"):
        omnispec.build(SR, source=str(kandinsky6_dir), overrides=UNDISTILLED)


def test_requests_need_a_video_of_a_tile_or_more(sr_dir, video):
    pipe = omnispec.build(SR, source=str(sr_dir), overrides=[*TINY, "recipe.constraints.min_size=4"])
    with pytest.raises(SpecError, match="needs a video"):
        pipe("a", seed=0)
    with pytest.raises(SpecError, match="at least 16x16 .one tile., got 12x12"):
        pipe("a", seed=0, video=[frame.crop((0, 0, 12, 12)) for frame in video])
    with pytest.raises(SpecError, match="resolution_scale.*2, 2.25 or 4"):
        omnispec.build(SR, overrides=["model.options.resolution_scale=3"])


# ---- policies ----------------------------------------------------------------------------------------------------

REFUSED = {
    "attention": ("policies.attention.default=sdpa", "always sends to flex attention"),
    "first_block": ("policies.cache={kind: first_block, threshold: 0.2}", "not in its TransformerBlockRegistry"),
    "taylorseer": ("policies.cache={kind: taylorseer, interval: 2}", "it would cache nothing"),
    "cfg": ("recipe.phases.0.guidance.terms=[{kind: cfg, scale: 2.0}]", "takes no text and no guidance"),
    "ulysses": ("policies.parallel.ulysses=2", "no diffusers context-parallel plan"),
}


@pytest.fixture(scope="module")
def plain(sr_dir, video):
    return omnispec.build(SR, source=str(sr_dir), overrides=TINY)("a", seed=0, video=video)


def test_model_offload_gives_the_plain_output(sr_dir, video, plain):
    out = omnispec.build(SR, source=str(sr_dir), overrides=[*TINY, "policies.offload={strategy: model}"])(
        "a", seed=0, video=video)
    assert np.abs(out.array - plain.array).max() <= 1e-5


def test_a_step_cache_runs(sr_dir, video, plain):
    out = omnispec.build(SR, source=str(sr_dir), overrides=[
        *TINY, "recipe.defaults.steps=3", "policies.cache={kind: step_mask, mask: [true, false, true]}"])(
        "a", seed=0, video=video)
    assert out.array.shape == plain.array.shape and np.isfinite(out.array).all()


@pytest.mark.parametrize("policy", list(REFUSED))
def test_unsupported_policies_are_refused_with_the_reason(policy):
    override, reason = REFUSED[policy]
    with pytest.raises(SpecError, match=reason):
        omnispec.build(SR, overrides=[override])


def test_the_fast_preset_on_a_hopper_leaves_the_attention_backend_alone():
    from omnispec.policies.presets import DeviceFacts, resolve_preset
    from omnispec.runtime.families import family_class
    from omnispec.spec import load_spec

    spec = load_spec(SR, ["policies.preset=fast"])
    hopper = DeviceFacts(cuda=True, capability=(9, 0), flash4_refusal=None, torchao=True)
    resolved, outcome = resolve_preset(spec, family_class("kandinsky6_sr").targets, hopper, lambda _: [])
    assert resolved.policies.attention.default == "auto" and resolved.policies.compile.mode == "regional"
    assert "left out FlashAttention-4 for every attention (family 'kandinsky6_sr' has no attention roles)" in \
        outcome.note()
