"""Qwen-Image (text-to-image, Edit, Edit-Plus), Z-Image and HunyuanVideo-1.5 (text- and image-to-video) equal their
diffusers pipelines on tiny checkpoints (float32, CPU, same seed and guidance); each policy works or is refused."""

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES, qwen_vl_processor

from conftest import SPECS, generators, reference

TOL = 1e-4




@pytest.fixture(scope="module")
def picture():
    """A non-square photo-like image (the editing and image-to-video pipelines size by aspect)."""
    return Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype(np.uint8))


# ---- Qwen-Image --------------------------------------------------------------------------------------------------

def test_qwen_image_true_cfg_with_its_norm_rescale_matches_diffusers(qwen_image_dir):
    from diffusers import QwenImagePipeline

    pipe = omnispec.build(SPECS / "qwen-image.yaml", source=str(qwen_image_dir), overrides=TINY_OVERRIDES["qwen_image"])
    prompts = ["a photo of a cat", "a red car in the snow on a cold day"]  # prompts of different lengths
    ours = pipe(prompts, seed=[0, 1], negative_prompt="blurry")
    ref = reference(QwenImagePipeline, qwen_image_dir)(
        prompts, negative_prompt=["blurry"] * 2, true_cfg_scale=4.0, height=32, width=64, num_inference_steps=3,
        generator=generators(0, 1), output_type="np").images
    assert ours.array.shape == ref.shape == (2, 32, 64, 3)
    assert np.abs(ours.array - ref).max() <= TOL


@pytest.fixture(scope="module")
def qwen_processor(qwen_edit_dir):
    # transformers loads a Qwen2VLProcessor only with torchvision; both sides get this one in memory.
    return qwen_vl_processor(qwen_edit_dir / "processor")


def test_qwen_image_edit_matches_diffusers(qwen_edit_dir, qwen_processor, picture):
    """Two prompts in one request (diffusers' processor takes one prompt per image, so it runs them one by one)."""
    from diffusers import QwenImageEditPipeline

    pipe = omnispec.build(SPECS / "qwen-image-edit.yaml", source=str(qwen_edit_dir),
                          overrides=TINY_OVERRIDES["qwen_image_edit"], components={"processor": qwen_processor})
    prompts = ["make it blue", "a cat on a red car"]
    ours = pipe(prompts, seed=2, image=picture, negative_prompt="blurry", height=64, width=32)
    ref = reference(QwenImageEditPipeline, qwen_edit_dir, processor=qwen_processor)
    images = np.concatenate([ref(image=picture, prompt=p, negative_prompt="blurry", true_cfg_scale=4.0, height=64,
                                 width=32, num_inference_steps=2, generator=generators(s), output_type="np").images
                             for s, p in enumerate(prompts, start=2)])
    assert ours.array.shape == images.shape == (2, 64, 32, 3)
    assert np.abs(ours.array - images).max() <= TOL


def test_qwen_image_edit_plus_with_two_images_and_zero_cond_t_matches_diffusers(qwen_edit_dir, qwen_processor,
                                                                               picture):
    """Two reference images; the transformer's zero_cond_t (Qwen-Image-Edit-2511) modulates them at t = 0."""
    from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel

    pipe = omnispec.build(SPECS / "qwen-image-edit-plus.yaml", source=str(qwen_edit_dir),
                          overrides=[*TINY_OVERRIDES["qwen_image_edit"],
                                     "model.components.transformer.config.zero_cond_t=true"],
                          components={"processor": qwen_processor})
    images = [picture, picture.resize((32, 32))]
    ours = pipe("make it blue", seed=3, conditions=images, negative_prompt="blurry", height=32, width=32)
    transformer = QwenImageTransformer2DModel.from_pretrained(qwen_edit_dir, subfolder="transformer", zero_cond_t=True)
    ref = reference(QwenImageEditPlusPipeline, qwen_edit_dir, processor=qwen_processor, transformer=transformer)(
        image=images, prompt="make it blue", negative_prompt="blurry", true_cfg_scale=4.0, height=32, width=32,
        num_inference_steps=2, generator=generators(3), output_type="np").images
    assert np.abs(ours.array - ref).max() <= TOL


# ---- Z-Image -----------------------------------------------------------------------------------------------------

Z_CFG = [*TINY_OVERRIDES["z_image"],
         ("recipe.phases.0.guidance={terms: [{kind: cfg, scale: 3.0, formulation: original, "
          "window: {by: sigma, start: 0.8, end: 1.0}}], renorm: {over: sample, max_ratio: 0.5}}")]


@pytest.mark.parametrize("case", ["turbo", "cfg-normalized-truncated"])
def test_z_image_matches_diffusers(z_image_dir, case):
    """Turbo: no CFG. CFG in Z-Image's convention (``cond + 3 (cond - uncond)``), cfg_normalization 0.5 as a per-sample
    norm cap, cfg_truncation 0.2 as the sigma window [0.8, 1]."""
    from diffusers import ZImagePipeline

    cfg = case != "turbo"
    pipe = omnispec.build(SPECS / "z-image-turbo.yaml", source=str(z_image_dir),
                          overrides=Z_CFG if cfg else TINY_OVERRIDES["z_image"])
    prompts = ["a photo of a cat", "a red car in the snow on a cold day"]
    ours = pipe(prompts, seed=[4, 5], negative_prompt="blurry")
    kwargs = dict(guidance_scale=3.0, cfg_normalization=0.5, cfg_truncation=0.2) if cfg else dict(guidance_scale=0.0)
    ref = reference(ZImagePipeline, z_image_dir)(
        list(prompts), negative_prompt=["blurry"] * 2, height=32, width=48, num_inference_steps=4,
        max_sequence_length=64, generator=generators(4, 5), output_type="np", **kwargs).images
    assert np.abs(ours.array - ref).max() <= TOL


def test_z_image_guidance_scale_is_diffusers_coefficient(z_image_dir):
    """A request's guidance_scale sets the original-formulation scale, as ZImagePipeline's does: 0 runs one pass."""
    pipe = omnispec.build(SPECS / "z-image-turbo.yaml", source=str(z_image_dir), overrides=Z_CFG)
    assert [run["coefficients"] for run in pipe.explain(as_dict=True)["phases"][0]["plan"]] == [{"uncond": 3.0}, {}]
    assert all(run["passes"] == ["cond"] for run in pipe.explain(as_dict=True, guidance_scale=0.0)["phases"][0]["plan"])


# ---- HunyuanVideo-1.5 ------------------------------------------------------------------------------------------

def test_hunyuan_video15_t2v_matches_diffusers(hunyuan_video15_dir):
    """Two prompts (one with quoted glyph text for the ByT5 encoder) decoded one sample at a time, CFG 6."""
    from diffusers import HunyuanVideo15Pipeline

    pipe = omnispec.build(SPECS / "hunyuanvideo-1.5-t2v.yaml", source=str(hunyuan_video15_dir),
                          overrides=TINY_OVERRIDES["hunyuan_video15"])
    prompts = ['a cat holding a sign "HELLO"', "a red car in the snow"]
    ours = pipe(prompts, seed=[6, 7], negative_prompt="blurry")
    ref = reference(HunyuanVideo15Pipeline, hunyuan_video15_dir)
    frames = np.concatenate([ref(p, negative_prompt="blurry", height=16, width=32, num_frames=9, num_inference_steps=2,
                                 generator=generators(s)[0], output_type="np").frames for p, s in zip(prompts, (6, 7))])
    assert ours.array.shape == frames.shape == (2, 9, 16, 32, 3)
    assert np.abs(ours.array - frames).max() <= TOL


def test_hunyuan_video15_i2v_matches_diffusers(hunyuan_video15_i2v_dir, picture):
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    pipe = omnispec.build(SPECS / "hunyuanvideo-1.5-i2v.yaml", source=str(hunyuan_video15_i2v_dir),
                          overrides=TINY_OVERRIDES["hunyuan_video15_i2v"])
    ours = pipe("a cat", seed=8, image=picture, negative_prompt="blurry")
    ref = reference(HunyuanVideo15ImageToVideoPipeline, hunyuan_video15_i2v_dir)(
        image=picture, prompt="a cat", negative_prompt="blurry", num_frames=9, num_inference_steps=2,
        generator=generators(8)[0], output_type="np").frames
    assert ours.array.shape == ref.shape
    assert np.abs(ours.array - ref).max() <= TOL


def _joint_attention_masks(pipe, run) -> list[bool]:
    """Whether each attention call inside the transformer's joint attentions (not the token refiner's) had a mask."""
    from torch.overrides import TorchFunctionMode

    masked, inside = [], []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention and inside:
                masked.append(kwargs.get("attn_mask") is not None)
            return func(*args, **kwargs)

    def enter(*_):
        inside.append(True)

    def leave(*_):
        inside.pop()

    hooks = []
    for block in pipe.components["transformer"].transformer_blocks:
        hooks += [block.attn.register_forward_pre_hook(enter), block.attn.register_forward_hook(leave)]
    try:
        with Record():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return masked


def test_hunyuan_video15_drops_the_text_padding_and_its_mask(hunyuan_video15_dir):
    """One prompt: its padding (and text-to-video's image tokens) dropped, every joint attention without a mask, the
    same video as the pipeline's masked attention over the padded prompt. Two prompts of different lengths in one
    request run a forward each, also without a mask, and equal the pipeline's two calls."""
    from diffusers import HunyuanVideo15Pipeline

    pipe = omnispec.build(SPECS / "hunyuanvideo-1.5-t2v.yaml", source=str(hunyuan_video15_dir),
                          overrides=TINY_OVERRIDES["hunyuan_video15"])
    out = {}
    masked = _joint_attention_masks(pipe, lambda: out.setdefault("x", pipe("a cat on a mat", seed=3,
                                                                           negative_prompt="blurry")))
    assert masked and not any(masked)
    ref = reference(HunyuanVideo15Pipeline, hunyuan_video15_dir)(
        "a cat on a mat", negative_prompt="blurry", height=16, width=32, num_frames=9, num_inference_steps=2,
        generator=generators(3)[0], output_type="np").frames
    assert np.abs(out["x"].array - ref).max() <= TOL
    prompts = ["a cat", "a red car parked in the snow"]
    masked = _joint_attention_masks(pipe, lambda: out.__setitem__("two", pipe(prompts, seed=[1, 2])))
    assert masked and not any(masked)
    ref = reference(HunyuanVideo15Pipeline, hunyuan_video15_dir)
    for i, (prompt, seed) in enumerate(zip(prompts, (1, 2))):
        frames = ref(prompt, height=16, width=32, num_frames=9, num_inference_steps=2, generator=generators(seed)[0],
                     output_type="np").frames
        assert np.abs(out["two"].array[i] - frames[0]).max() <= TOL


# ---- policies ----------------------------------------------------------------------------------------------------

# Each family with a guidance that runs two passes (Z-Image with CFG) and three steps' worth of cache decisions.
POLICY_CASES = {
    "qwen_image": ("qwen-image.yaml", "qwen_image_dir", TINY_OVERRIDES["qwen_image"]),
    "z_image": ("z-image-turbo.yaml", "z_image_dir", Z_CFG),
    "hunyuan_video15": ("hunyuanvideo-1.5-t2v.yaml", "hunyuan_video15_dir",
                        [*TINY_OVERRIDES["hunyuan_video15"], "recipe.defaults.steps=3"]),
}
EXACT_POLICIES = {
    "attention": "policies.attention={default: sdpa_math}",
    "compile": "policies.compile={mode: regional, backend: eager}",
    "offload-model": "policies.offload={strategy: model}",
    "offload-layerwise": "policies.offload={strategy: layerwise}",
}
APPROXIMATE_POLICIES = {
    "taylorseer": "policies.cache={kind: taylorseer, interval: 2, warmup_steps: 1}",
    "first_block": "policies.cache={kind: first_block, threshold: 0.2}",
    "magcache": "policies.cache={kind: magcache, calibrate: true}",
    "step_mask": "policies.cache={kind: step_mask, mask: [true, false, true]}",
    "int8": "policies.quantization={transformer: {method: int8_weight_only}}",
}
REFUSED = {  # (family, policy) -> the reason given at build
    ("hunyuan_video15", "first_block"): "not in its TransformerBlockRegistry",
    ("hunyuan_video15", "magcache"): "not in its TransformerBlockRegistry",
    ("z_image", "first_block"): "its argument is named x",
    ("z_image", "magcache"): "its argument is named x",
}


def policy_run(request, family, *overrides):
    spec, fixture, base = POLICY_CASES[family]
    pipe = omnispec.build(SPECS / spec, source=str(request.getfixturevalue(fixture)), overrides=[*base, *overrides])
    return pipe, pipe(["a cat", "a red car in the snow"], seed=0, negative_prompt="blurry").array


@pytest.fixture(scope="module")
def plain(request):
    return {family: policy_run(request, family)[1] for family in POLICY_CASES}


@pytest.mark.parametrize("policy", list(EXACT_POLICIES))
@pytest.mark.parametrize("family", list(POLICY_CASES))
def test_exact_policies_give_the_plain_output(request, plain, family, policy):
    pipe, out = policy_run(request, family, EXACT_POLICIES[policy])
    assert np.abs(out - plain[family]).max() <= 1e-5
    if policy == "attention":  # every declared role reaches attention modules, and only declared ones are hooked
        target = pipe.family.targets.attention
        roles = target.modules(pipe.components["transformer"].named_modules())
        assert set(roles) == set(target.roles) and all(roles.values())


@pytest.mark.parametrize("policy", list(APPROXIMATE_POLICIES))
@pytest.mark.parametrize("family", list(POLICY_CASES))
def test_approximate_policies_run_or_are_refused_with_the_reason(request, plain, family, policy):
    if (family, policy) in REFUSED:
        with pytest.raises(SpecError, match=REFUSED[family, policy]):
            policy_run(request, family, APPROXIMATE_POLICIES[policy])
        return
    _, out = policy_run(request, family, APPROXIMATE_POLICIES[policy])
    assert out.shape == plain[family].shape and np.abs(out - plain[family]).max() < 0.5


def test_skip_layer_guidance_runs_on_qwen_image_and_is_refused_where_diffusers_hooks_cannot_reach(request):
    term = "recipe.phases.0.guidance.terms=[{kind: skip_layer, scale: 2.0, layers: [1]}]"
    assert np.isfinite(policy_run(request, "qwen_image", term)[1]).all()
    for family in ("z_image", "hunyuan_video15"):
        with pytest.raises(SpecError, match=f"family '{family}' cannot run skip_layer guidance"):
            policy_run(request, family, term)


@pytest.mark.parametrize("family", ["z_image", "hunyuan_video15"])
def test_sequence_parallel_is_refused_without_a_context_parallel_plan(request, family):
    with pytest.raises(SpecError, match=f"family '{family}' cannot run ulysses/ring: .* no diffusers context-parallel"):
        policy_run(request, family, "policies.parallel={ulysses: 2}")


def test_qwen_image_ulysses_pads_prompts_to_split_and_equals_single_process(qwen_image_dir, tmp_path):
    """Prompts of different lengths: positive and negative encodings differ in length, and each is padded (masked)
    to an even length to split over two ranks. (cfg and data degrees need nothing of a family: tested on sd3.)"""
    from test_parallel import launch, single

    sets = [x for o in TINY_OVERRIDES["qwen_image"] for x in ("--set", o)]
    args = [str(SPECS / "qwen-image.yaml"), "--source", str(qwen_image_dir), *sets, "--prompt", "a cat",
            "--prompt", "a red car in the snow on a cold day", "--negative-prompt", "blurry", "--seed", "1"]
    ref = single([*args, "--output", str(tmp_path / "ref.npy")])
    assert ref.returncode == 0, ref.stderr[-2000:]
    results = launch(2, [*args, "--set", "policies.parallel={ulysses: 2}", "--output", str(tmp_path / "par.npy")])
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
    assert np.abs(np.load(tmp_path / "par.npy") - np.load(tmp_path / "ref.npy")).max() <= 1e-4


def test_ring_is_refused_on_qwen_image_whose_padded_prompts_need_a_mask(request):
    with pytest.raises(SpecError, match="ring attention .* takes no attention mask"):
        policy_run(request, "qwen_image", "policies.parallel={ring: 2}")


@pytest.mark.parametrize("family", ["qwen_image", "z_image"])
def test_rollouts_replay_exactly_with_ragged_prompt_encodings(request, family):
    """Two prompts of different lengths with CFG: replay slices and re-joins the padded encodings per micro-batch."""
    spec, fixture, base = POLICY_CASES[family]
    pipe = omnispec.build(SPECS / spec, source=str(request.getfixturevalue(fixture)), overrides=base)
    ro = pipe.rollout(["a cat", "a red car in the snow on a cold day"], group_size=2, seed=1, negative_prompt="blurry",
                      sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 2}})
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)
    ratio = (pipe.log_prob(ro, grad=False, micro_batch=1).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-5


CLI_CASES = {
    "z-image-turbo.yaml": ("z_image_dir", TINY_OVERRIDES["z_image"], False, (1, 32, 48, 3)),
    "hunyuanvideo-1.5-i2v.yaml": ("hunyuan_video15_i2v_dir", TINY_OVERRIDES["hunyuan_video15_i2v"], True,
                                  (1, 9, 16, 12, 3)),  # the portrait photo's bucket
}


@pytest.mark.parametrize("spec", list(CLI_CASES))
def test_cli_runs_the_new_specs(spec, request, photo, tmp_path, capsys):
    from omnispec.cli import main

    fixture, overrides, image, shape = CLI_CASES[spec]
    sets = [x for o in overrides for x in ("--set", o)]
    out = tmp_path / "out.npy"
    code = main(["run", str(SPECS / spec), "--source", str(request.getfixturevalue(fixture)), "--prompt", "a cat",
                 *(["--image", str(photo)] if image else []), *sets, "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    assert np.load(out).shape == shape


# ---- the guidance options these families added ---------------------------------------------------------------------

def test_original_cfg_formulation_and_renorm_compile_into_the_plan():
    from omnispec.spec import GuidanceSpec, compile_plan

    guidance = GuidanceSpec.model_validate({
        "terms": [{"kind": "cfg", "scale": 3.0, "formulation": "original", "window": {"by": "sigma", "start": 0.8}}],
        "renorm": {"over": "sample", "max_ratio": 0.5}})
    plans = compile_plan(guidance, 4, [1.0, 0.9, 0.75, 0.5])
    assert [p.coefficients for p in plans] == [{"uncond": 3.0}, {"uncond": 3.0}, {}, {}]
    assert plans[0].renorm.max_ratio == 0.5 and plans[2].renorm is None  # a cond-only step is left as it is


def test_renorm_matches_the_per_token_and_per_sample_rules():
    from omnispec.runtime.guidance import GuidanceState, combine
    from omnispec.spec import GuidanceSpec, compile_plan

    cond, uncond = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    for renorm in ({"over": "token"}, {"over": "sample", "max_ratio": 0.5}):
        guidance = GuidanceSpec.model_validate({"terms": [{"kind": "true_cfg", "scale": 4.0}], "renorm": renorm})
        out = combine(compile_plan(guidance, 1)[0], {"cond": {"x": cond}, "uncond": {"x": uncond}}, guidance,
                      GuidanceState())["x"]
        comb = uncond + 4.0 * (cond - uncond)
        if renorm["over"] == "token":  # QwenImagePipeline's
            want = comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
        else:  # ZImagePipeline's cfg_normalization, per sample
            want = torch.stack([c * min(1.0, float(0.5 * torch.linalg.vector_norm(p) / torch.linalg.vector_norm(c)))
                                for c, p in zip(comb, cond)])
        assert torch.allclose(out, want, atol=1e-5)
