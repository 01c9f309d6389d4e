"""The bundled few-step distilled LoRA recipes equal diffusers loading the same LoRA file: a tiny LoRA written here in
each release's key layout (LightX2V's ComfyUI-style Wan keys, one file per Wan2.2 expert, Qwen-Image-Lightning's
lora_down/lora_up with alphas) onto the tiny checkpoints; omnispec runs the distilled spec with its source and LoRA
paths overridden, diffusers the pipeline with ``load_lora_weights`` and the release's scheduler, steps and guidance
(float32, CPU, same seeds)."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import omnispec
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS, generators, reference

TOL = 1e-4
RANK = 2
# LightX2V / ComfyUI names of a Wan block's linears -> diffusers' (the pairs diffusers' Wan converter maps).
WAN_LINEARS = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
               "self_attn.o": "attn1.to_out.0", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
               "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0", "ffn.0": "ffn.net.0.proj",
               "ffn.2": "ffn.net.2"}
WAN_IMAGE_LINEARS = {"cross_attn.k_img": "attn2.add_k_proj", "cross_attn.v_img": "attn2.add_v_proj"}
QWEN_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2")


def lora_pair(module: torch.nn.Linear, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank-2 (down, up) pair for ``module``, large enough to move the output visibly."""
    down = torch.randn(RANK, module.in_features, generator=generator) * 0.3
    up = torch.randn(module.out_features, RANK, generator=generator) * 0.3
    return down, up


def write_lora(path, entries: dict[str, torch.nn.Linear], seed: int, alpha: float | None = None) -> str:
    """``{key prefix: module}`` -> a ``.safetensors`` file of ``prefix.lora_down.weight`` / ``prefix.lora_up.weight``
    (and ``prefix.alpha``) per module."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for prefix, module in entries.items():
        state[f"{prefix}.lora_down.weight"], state[f"{prefix}.lora_up.weight"] = lora_pair(module, generator)
        if alpha is not None:
            state[f"{prefix}.alpha"] = torch.tensor(alpha)
    save_file(state, str(path))
    return str(path)


def wan_lora(path, transformer, seed: int, image: bool = False) -> str:
    """LightX2V's layout: ``diffusion_model.blocks.N.<comfy name>.lora_down/lora_up.weight`` with an alpha each."""
    names = {**WAN_LINEARS, **(WAN_IMAGE_LINEARS if image else {})}
    entries = {f"diffusion_model.blocks.{i}.{comfy}": block.get_submodule(ours)
               for i, block in enumerate(transformer.blocks) for comfy, ours in names.items()}
    return write_lora(path, entries, seed, alpha=float(RANK))


RELEASE_SIGMAS = [1.0, 0.75, 0.5, 0.25]  # LightX2V's timesteps 1000, 750, 500, 250, before the shift


def lightx2v_scheduler():
    """diffusers' Euler at shift 5 over the releases' sigmas (1, 0.9375, 0.8333, 0.625 once shifted). The Wan
    pipelines ask their scheduler for a step count only, so the sigmas are handed to its ``set_timesteps`` here."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    class ReleaseSigmas(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
            assert num_inference_steps == len(RELEASE_SIGMAS)
            super().set_timesteps(sigmas=RELEASE_SIGMAS, device=device)

    return ReleaseSigmas(shift=5.0)


def lora_overrides(slot: str, path: str) -> list[str]:
    return [f"model.adapters.{slot}.path={path}", f"model.adapters.{slot}.weight_name=null"]


@pytest.fixture(scope="module")
def picture():
    return Image.fromarray((np.random.RandomState(2).rand(32, 32, 3) * 255).astype(np.uint8))


def build(spec: str, source, overrides: list[str]):
    return omnispec.build(SPECS / spec, source=str(source), overrides=overrides)


def checkpoint_module(source, subfolder: str = "transformer"):
    """A denoiser of the tiny checkpoint as saved (the LoRA files are written for its linears)."""
    import diffusers

    config = (source / subfolder / "config.json").read_text()
    cls = "QwenImageTransformer2DModel" if "QwenImage" in config else "WanTransformer3DModel"
    return getattr(diffusers, cls).from_pretrained(str(source), subfolder=subfolder)


# ---- Wan2.1 (LightX2V step/CFG distill) -----------------------------------------------------------------------

def test_wan21_t2v_lightx2v_matches_diffusers_load_lora_weights(wan_dir, tmp_path):
    from diffusers import WanPipeline

    spec, tiny = "wan2.1-t2v-14b-lightx2v.yaml", TINY_OVERRIDES["wan"]
    lora = wan_lora(tmp_path / "lightx2v.safetensors", checkpoint_module(wan_dir), seed=1)
    pipe = build(spec, wan_dir, [*tiny, *lora_overrides("lightx2v", lora)])
    ours = pipe("a cat", seed=3)
    ref_pipe = reference(WanPipeline, wan_dir, scheduler=lightx2v_scheduler())
    ref_pipe.load_lora_weights(lora)
    ref = ref_pipe("a cat", height=32, width=32, num_frames=5, num_inference_steps=4, guidance_scale=1.0,
                   max_sequence_length=16, generator=generators(3), output_type="np").frames
    plain = build(spec, wan_dir, [*tiny, "model.adapters={}", "recipe.phases.0.adapter=null"])("a cat", seed=3)
    assert ours.array.shape == ref.shape
    assert np.abs(ours.array - ref).max() <= TOL
    assert np.abs(plain.array - ref).max() > 1e-3  # the LoRA changes the output: the comparison can fail


def test_wan21_i2v_lightx2v_with_image_keys_matches_diffusers(wan_i2v_dir, picture, tmp_path):
    from diffusers import WanImageToVideoPipeline

    spec, tiny = "wan2.1-i2v-14b-480p-lightx2v.yaml", TINY_OVERRIDES["wan_i2v"]
    lora = wan_lora(tmp_path / "lightx2v_i2v.safetensors", checkpoint_module(wan_i2v_dir), seed=2, image=True)
    ours = build(spec, wan_i2v_dir, [*tiny, *lora_overrides("lightx2v", lora)])("a cat", seed=4, image=picture)
    ref_pipe = reference(WanImageToVideoPipeline, wan_i2v_dir, scheduler=lightx2v_scheduler())
    ref_pipe.load_lora_weights(lora)
    ref = ref_pipe(image=picture, prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=4,
                   guidance_scale=1.0, max_sequence_length=512, generator=generators(4), output_type="np").frames
    assert np.abs(ours.array - ref).max() <= TOL


# ---- Wan2.2 (Lightning, one LoRA per expert) ----------------------------------------------------------------------

@pytest.mark.parametrize("spec, fixture, pipeline, tiny", [
    ("wan2.2-t2v-a14b-lightning.yaml", "wan22_dir", "WanPipeline", "wan"),
    ("wan2.2-i2v-a14b-lightning.yaml", "wan22_i2v_dir", "WanImageToVideoPipeline", "wan22_i2v"),
])
def test_wan22_lightning_loads_one_lora_per_expert_as_diffusers(request, picture, tmp_path, spec, fixture, pipeline,
                                                                 tiny):
    source, tiny = request.getfixturevalue(fixture), TINY_OVERRIDES[tiny]
    image = pipeline == "WanImageToVideoPipeline"  # Wan2.2 I2V has no image cross-attention: no k_img / v_img keys
    high = wan_lora(tmp_path / "high_noise_model.safetensors", checkpoint_module(source), seed=5)
    low = wan_lora(tmp_path / "low_noise_model.safetensors", checkpoint_module(source, "transformer_2"), seed=6)
    pipe = build(spec, source, [*tiny, *lora_overrides("lightning_high", high), *lora_overrides("lightning_low", low)])
    inputs = {"image": picture} if image else {}
    ours = pipe("a cat", seed=7, **inputs)
    ref_pipe = reference(pipeline, source, scheduler=lightx2v_scheduler())
    ref_pipe.load_lora_weights(high)
    ref_pipe.load_lora_weights(low, load_into_transformer_2=True)
    ref = ref_pipe(prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=4, guidance_scale=1.0,
                   guidance_scale_2=1.0, max_sequence_length=16, generator=generators(7), output_type="np",
                   **inputs).frames
    assert np.abs(ours.array - ref).max() <= TOL
    # each expert runs its own LoRA: swapping the files changes the output
    swapped = build(spec, source, [*tiny, *lora_overrides("lightning_high", low),
                                   *lora_overrides("lightning_low", high)])
    assert np.abs(swapped("a cat", seed=7, **inputs).array - ref).max() > 1e-3


# ---- Qwen-Image-Lightning --------------------------------------------------------------------------------------

def lightning_scheduler():
    """The release's diffusers scheduler: mu = log(3) at every size, no terminal stretch."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=math.log(3), max_image_seq_len=8192,
                                           max_shift=math.log(3), shift=1.0, shift_terminal=None,
                                           time_shift_type="exponential", use_dynamic_shifting=True)


def test_qwen_image_lightning_matches_diffusers_load_lora_weights(qwen_image_dir, tmp_path):
    from diffusers import QwenImagePipeline

    spec, tiny = "qwen-image-lightning.yaml", [*TINY_OVERRIDES["qwen_image"], "recipe.defaults.steps=8"]
    transformer = checkpoint_module(qwen_image_dir)
    entries = {f"transformer_blocks.{i}.{name}": block.get_submodule(name)
               for i, block in enumerate(transformer.transformer_blocks) for name in QWEN_LINEARS}
    lora = write_lora(tmp_path / "Qwen-Image-Lightning-8steps.safetensors", entries, seed=8, alpha=4.0)
    ours = build(spec, qwen_image_dir, [*tiny, *lora_overrides("lightning", lora)])(["a cat", "a red car"], seed=9)
    ref_pipe = reference(QwenImagePipeline, qwen_image_dir, scheduler=lightning_scheduler())
    ref_pipe.load_lora_weights(lora)
    ref = ref_pipe(["a cat", "a red car"], height=32, width=64, num_inference_steps=8, true_cfg_scale=1.0,
                   generator=generators(9, 10), output_type="np").images
    assert ours.array.shape == ref.shape == (2, 32, 64, 3)
    assert np.abs(ours.array - ref).max() <= TOL
