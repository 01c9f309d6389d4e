"""LoRA files as users have them (diffusers-saved, kohya/ComfyUI, XLabs) load into an adapter slot and into
``omnispec run --lora``, and the output equals diffusers' ``load_lora_weights`` on the tiny FLUX checkpoint."""
import sys

import numpy as np
import pytest
import torch

import omnispec
from omnispec.testing import TINY_OVERRIDES

import preloaded
from conftest import ROOT, SPECS

TOL = 1e-4
HIDDEN = 32  # the tiny FLUX transformer's width (2 heads x 16)
RANK = 4


def _random(*shape, scale=0.3):
    return torch.randn(*shape) * scale


def diffusers_lora(flux_dir, folder):
    """A LoRA saved by ``FluxPipeline.save_lora_weights``: ``transformer.``-prefixed keys, its rank and alpha in the
    file's metadata."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict

    torch.manual_seed(1)
    transformer = FluxTransformer2DModel.from_pretrained(flux_dir, subfolder="transformer")
    config = LoraConfig(r=RANK, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_out"],
                        init_lora_weights=False)
    transformer.add_adapter(config)
    FluxPipeline.save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(transformer),
                                   transformer_lora_adapter_metadata=config.to_dict())
    return folder, "pytorch_lora_weights.safetensors"


def kohya_lora(folder):
    """sd-scripts / ComfyUI names (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``) with ``alpha``:
    a fused qkv, projections, an MLP and a single block's output."""
    from safetensors.torch import save_file

    torch.manual_seed(2)
    state = {}
    for name, (fan_in, fan_out) in {"double_blocks_0_img_attn_qkv": (HIDDEN, 3 * HIDDEN),
                                    "double_blocks_0_img_attn_proj": (HIDDEN, HIDDEN),
                                    "double_blocks_0_txt_attn_qkv": (HIDDEN, 3 * HIDDEN),
                                    "double_blocks_0_txt_mlp_0": (HIDDEN, 4 * HIDDEN),
                                    "single_blocks_0_linear2": (5 * HIDDEN, HIDDEN)}.items():
        state[f"lora_unet_{name}.lora_down.weight"] = _random(RANK, fan_in)
        state[f"lora_unet_{name}.lora_up.weight"] = _random(fan_out, RANK)
        state[f"lora_unet_{name}.alpha"] = torch.tensor(2.0)
    save_file(state, folder / "kohya.safetensors")
    return folder, "kohya.safetensors"


def xlabs_lora(folder):
    """XLabs' names (``double_blocks.0.processor.qkv_lora1.down.weight``): fused qkv and projections of the image
    and text streams."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    state = {}
    for name, fan_out in {"qkv_lora1": 3 * HIDDEN, "proj_lora1": HIDDEN, "qkv_lora2": 3 * HIDDEN,
                          "proj_lora2": HIDDEN}.items():
        state[f"double_blocks.0.processor.{name}.down.weight"] = _random(RANK, HIDDEN)
        state[f"double_blocks.0.processor.{name}.up.weight"] = _random(fan_out, RANK)
    save_file(state, folder / "xlabs.safetensors")
    return folder, "xlabs.safetensors"


def reference(flux_dir, folder, weight_name, scale, seed):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(flux_dir), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(folder), weight_name=weight_name, adapter_name="user")
    pipe.set_adapters(["user"], [scale])
    return pipe("a photo of a cat", height=32, width=32, num_inference_steps=3, guidance_scale=3.5,
                max_sequence_length=16, generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images


def base(flux_dir, seed):
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=TINY_OVERRIDES["flux"])
    return pipe("a photo of a cat", seed=seed).array


@pytest.mark.parametrize("layout", ["diffusers", "kohya", "xlabs"])
def test_lora_layouts_equal_diffusers_load_lora_weights(flux_dir, tmp_path, layout):
    folder, weight_name = {"diffusers": lambda: diffusers_lora(flux_dir, tmp_path), "kohya": lambda: kohya_lora(tmp_path),
                           "xlabs": lambda: xlabs_lora(tmp_path)}[layout]()
    slot = f'{{path: "{folder}", weight_name: {weight_name}, scale: 0.8, always: true}}'
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir),
                          overrides=[*TINY_OVERRIDES["flux"], f"model.adapters.user={slot}"])
    ours = pipe("a photo of a cat", seed=4).array
    ref = reference(flux_dir, folder, weight_name, 0.8, 4)
    assert np.abs(ours - ref).max() <= TOL
    assert np.abs(ours - base(flux_dir, 4)).max() > 1e-3  # the LoRA changed the image


def test_lora_slot_of_a_phase_is_on_only_in_that_phase(flux_dir, tmp_path):
    """A slot named by a phase (not ``always``) is off in the others: here the only phase names none."""
    folder, weight_name = kohya_lora(tmp_path)
    slot = f'{{path: "{folder}", weight_name: {weight_name}}}'
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir),
                          overrides=[*TINY_OVERRIDES["flux"], f"model.adapters.unused={slot}"])
    assert np.abs(pipe("a photo of a cat", seed=4).array - base(flux_dir, 4)).max() == 0


def test_cli_lora_option_loads_a_file_with_weight_name_and_scale(flux_dir, tmp_path):
    from PIL import Image

    folder, weight_name = xlabs_lora(tmp_path)
    out = tmp_path / "cat.png"
    args = [sys.executable, "-m", "omnispec", "run", str(SPECS / "flux1-dev.yaml"), "--source", str(flux_dir),
            "--prompt", "a photo of a cat", "--seed", "4", "--output", str(out), "-q",
            "--lora", f"{folder}:{weight_name}@0.8"]
    for override in TINY_OVERRIDES["flux"]:
        args += ["--set", override]
    res = preloaded.python_m(args, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    ref = reference(flux_dir, folder, weight_name, 0.8, 4)
    ours = np.asarray(Image.open(out), dtype=np.float32) / 255
    assert np.abs(ours - ref[0]).max() <= 1 / 255 + 1e-6  # the PNG's rounding
    from omnispec import records

    made_by = records.read(out)
    assert made_by.spec["model"]["adapters"]["lora_0"] == {"path": str(folder), "weight_name": weight_name,
                                                             "scale": 0.8, "always": True}


def test_cli_lora_values_are_checked_before_loading(tmp_path):
    from omnispec.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "digits", "--prompt", "7", "--output", str(tmp_path / "x.png"), "--lora", "a@b"])
    assert exc.value.code == 2
    assert main(["run", "digits", "--prompt", "7", "--output", str(tmp_path / "x.png"), "--lora",
                 str(tmp_path / "missing.safetensors")]) == 2


def test_a_lora_on_fused_feed_forwards_still_applies(flux_dir, tmp_path):
    """``policies.mlp.fused_gelu`` leaves LoRA-wrapped projections (this file's MLP and single-block output) to their
    own forward: were the fused operators handed the base weights, the LoRA would silently drop out."""
    folder, weight_name = kohya_lora(tmp_path)
    slot = f'{{path: "{folder}", weight_name: {weight_name}, scale: 0.8, always: true}}'
    overrides = [*TINY_OVERRIDES["flux"], f"model.adapters.user={slot}", "policies.mlp.fused_gelu=true"]
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=overrides)
    assert pipe.explain(as_dict=True)["applied"]["mlp"].startswith("transformer: bias + GELU in the matmul")
    ours = pipe("a photo of a cat", seed=4).array
    assert np.abs(ours - reference(flux_dir, folder, weight_name, 0.8, 4)).max() <= TOL
