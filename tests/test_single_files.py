"""Checkpoints as users hold them: one weights file in the authors' layout (FLUX, Wan2.1, Z-Image), GGUF files, and
folders whose components were saved quantized (torchao, bitsandbytes NF4). Every file is written here from a tiny
diffusers model by inverting diffusers' converter, so loading goes through the real converter; each output is
compared with diffusers loading the same file the same way."""

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import omnispec
from omnispec.spec import SpecError, load_spec
from omnispec.testing import TINY_OVERRIDES
from omnispec.testing.single_files import (
    COMFY_PREFIX,
    flux_original,
    wan_original,
    write_gguf,
    write_safetensors,
    z_image_original,
)

import preloaded
from conftest import ROOT, SPECS, int8_weight

TOL = 1e-4
WAN = [*TINY_OVERRIDES["wan"], "recipe.defaults.steps=3"]
WAN_CALL = dict(height=32, width=32, num_frames=5, num_inference_steps=3, max_sequence_length=16, output_type="np")
gguf = pytest.importorskip("gguf")


def gen(seed=0):
    return torch.Generator("cpu").manual_seed(seed)


def wan_reference(root, transformer, prompt="a cat", seed=0, **kwargs):
    from diffusers import WanPipeline

    if transformer is not None:
        kwargs["transformer"] = transformer
    pipe = WanPipeline.from_pretrained(str(root), dtype=torch.float32, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt, generator=gen(seed), **WAN_CALL).frames


def wan_file(root, file, **config):
    from diffusers import GGUFQuantizationConfig, WanTransformer3DModel

    kwargs = {"quantization_config": GGUFQuantizationConfig(compute_dtype=torch.float32)} if \
        str(file).endswith(".gguf") else {}
    return WanTransformer3DModel.from_single_file(str(file), config=str(root), subfolder="transformer",
                                                  dtype=torch.float32, **kwargs, **config)


@pytest.fixture(scope="module")
def wan32(tmp_path_factory, wan_dir):
    """The tiny Wan checkpoint with a transformer 32 wide (2 heads of 16), so its linears are whole GGUF blocks."""
    from diffusers import WanTransformer3DModel

    root = tmp_path_factory.mktemp("wan32") / "ckpt"
    shutil.copytree(wan_dir, root)
    shutil.rmtree(root / "transformer")
    torch.manual_seed(0)
    WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
                          out_channels=16, text_dim=32, freq_dim=256, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                          qk_norm="rms_norm_across_heads", rope_max_seq_len=32).save_pretrained(root / "transformer")
    return root


@pytest.fixture(scope="module")
def wan_state(wan32):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(str(wan32), subfolder="transformer").state_dict()


@pytest.fixture(scope="module")
def wan_files(tmp_path_factory, wan_state):
    """Wan's own layout, plain and with ComfyUI's prefix, and GGUF files at two quant types."""
    folder = tmp_path_factory.mktemp("wan_files")
    files = {"original": write_safetensors(wan_original(wan_state), folder / "wan.safetensors"),
             "comfy": write_safetensors(wan_original(wan_state, COMFY_PREFIX), folder / "wan_comfy.safetensors")}
    for quant in ("Q8_0", "Q4_0"):
        files[quant] = write_gguf(wan_original(wan_state), folder / f"wan-{quant}.gguf", quant, "wan")
    return files


def build_wan(root, file, *more):
    return omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(root),
                          overrides=[*WAN, f"model.components.transformer.file={file}", *more])


# ---- single files in the authors' layouts ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["original", "comfy"])
def test_wan_original_layout_equals_diffusers_loading_the_same_file(wan32, wan_files, layout):
    pipe = build_wan(wan32, wan_files[layout])
    ours = pipe("a cat", seed=0)
    ref = wan_reference(wan32, wan_file(wan32, wan_files[layout]))
    assert np.abs(ours.array - ref).max() <= TOL
    assert ours.array.std() > 0.01


def test_wan_single_file_through_the_cli(wan32, wan_files, tmp_path):
    """``omnispec run`` with the file set on the command line: the same output as ``build``."""
    out = tmp_path / "cat.mp4"
    done = preloaded.python_m([sys.executable, "-m", "omnispec", "run", str(SPECS / "wan2.1-t2v-1.3b.yaml"), "--source",
                               str(wan32), *[a for o in WAN for a in ("--set", o)], "--set",
                               f"model.components.transformer.file={wan_files['original']}", "--prompt", "a cat",
                               "--seed", "0", "--output", str(out), "-q"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    record = omnispec.records.read(out)
    assert record.spec["model"]["components"]["transformer"]["file"] == str(wan_files["original"])


def test_z_image_original_layout_equals_diffusers(z_image_dir, tmp_path):
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    state = ZImageTransformer2DModel.from_pretrained(str(z_image_dir), subfolder="transformer").state_dict()
    file = write_safetensors(z_image_original(state, COMFY_PREFIX), tmp_path / "z_image.safetensors")
    pipe = omnispec.build(SPECS / "z-image-turbo.yaml", source=str(z_image_dir),
                          overrides=[*TINY_OVERRIDES["z_image"], f"model.components.transformer.file={file}"])
    ours = pipe("a photo of a cat", seed=4)
    transformer = ZImageTransformer2DModel.from_single_file(str(file), config=str(z_image_dir),
                                                            subfolder="transformer", dtype=torch.float32)
    ref = ZImagePipeline.from_pretrained(str(z_image_dir), transformer=transformer, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    expected = ref("a photo of a cat", height=32, width=48, num_inference_steps=4, max_sequence_length=64,
                   guidance_scale=0.0, generator=gen(4), output_type="np").images
    assert np.abs(ours.array - expected).max() <= TOL


def test_flux_original_layout_equals_diffusers(flux_dir, tmp_path):
    """Black Forest Labs' layout through diffusers' FLUX converter, which fixes the width at 3072 (24 heads of 128):
    one double and one single block at that width (520M parameters, a 1 GB file), so in bfloat16. The loaded
    weights equal diffusers' bit for bit; the images agree within four bfloat16 steps at their scale (4/256, mean
    below one), the rounding of the two loops' different (equally valid) operation orders in bfloat16."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    root = tmp_path / "flux_wide"
    shutil.copytree(flux_dir, root)
    shutil.rmtree(root / "transformer")
    with torch.device("meta"):
        model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=32,
                                       pooled_projection_dim=32, axes_dims_rope=(16, 56, 56), guidance_embeds=True)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 + (1.0 if p.ndim == 1 and "norm" in name else 0.0))
    model.save_config(root / "transformer")
    file = write_safetensors(flux_original(model.state_dict()), tmp_path / "flux1-dev.safetensors")
    del model
    overrides = [o for o in TINY_OVERRIDES["flux"] if not o.startswith(("model.dtype", "recipe.defaults"))]
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(root), overrides=[
        *overrides, "model.dtype=bfloat16", "recipe.defaults.steps=2", "recipe.defaults.height=16",
        "recipe.defaults.width=16", "recipe.defaults.max_sequence_length=16", f"model.components.transformer.file={file}"])
    ours = pipe("a cat", seed=0)
    loaded = pipe.components["transformer"].state_dict()
    transformer = FluxTransformer2DModel.from_single_file(str(file), config=str(root), subfolder="transformer",
                                                          dtype=torch.bfloat16)
    assert set(loaded) == set(transformer.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in transformer.state_dict().items())
    del pipe, loaded
    ref = FluxPipeline.from_pretrained(str(root), transformer=transformer, dtype=torch.bfloat16)
    ref.set_progress_bar_config(disable=True)
    expected = ref("a cat", height=16, width=16, num_inference_steps=2, max_sequence_length=16, guidance_scale=3.5,
                   generator=gen(0), output_type="np").images.astype(np.float32)
    diff = np.abs(ours.array - expected)
    assert diff.max() <= 4 / 256 and diff.mean() <= 1 / 256


# ---- GGUF ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_gguf_equals_diffusers_loading_the_same_file(wan32, wan_files, quant):
    from diffusers.quantizers.gguf.utils import GGUFParameter

    pipe = build_wan(wan32, wan_files[quant])
    packed = [n for n, p in pipe.components["transformer"].named_parameters() if isinstance(p, GGUFParameter)]
    assert len(packed) >= 12  # the blocks' linears stay packed in memory
    ours = pipe("a cat", seed=0)
    ref = wan_reference(wan32, wan_file(wan32, wan_files[quant]))
    assert np.abs(ours.array - ref).max() <= TOL
    plain = wan_reference(wan32, None)  # the unquantized model: the quantization really changed the weights
    assert np.abs(ours.array - plain).max() > 1e-4


def test_gguf_type_table_is_ggml_s():
    from omnispec.spec.gguf import GGML_TYPES

    for kind, (name, block, size) in GGML_TYPES.items():
        assert gguf.GGMLQuantizationType(kind).name == name
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)] == (block, size)


def test_gguf_header_read_as_gguf_py_reads_it(wan_files):
    from omnispec.spec.gguf import gguf_header

    header = gguf_header(wan_files["Q4_0"])
    reader = gguf.GGUFReader(str(wan_files["Q4_0"]))
    assert header.architecture == "wan"
    assert {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), int(t.data_offset))
            for t in reader.tensors} == {k: (t.dtype, t.shape, t.begin) for k, t in header.tensors.items()}
    assert header.type_counts()["Q4_0"] >= 12


def _forged(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _gguf_bytes(n_tensors=1, n_keys=0, name=b"w", dims=(32, 2), kind=8, offset=0, data=68, extra=b""):
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_keys) + extra
    info = struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims)) + b"".join(
        struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset)
    body = head + info
    return body + b"\0" * (-len(body) % 32) + b"\1" * data


@pytest.mark.parametrize("data, problem", [
    (b"PK\3\4" + b"\0" * 60, "not b'GGUF'"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1 << 62, 0), "more than the 100,000 allowed"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 40), "more than the 1,048,576 allowed"),
    (b"GGUF" + struct.pack("<IQQ", 9, 0, 0), "version 9"),
    (_gguf_bytes(data=10), "past the file's end"),
    (_gguf_bytes(kind=99), "unknown ggml type 99"),
    (_gguf_bytes(dims=(30, 2)), "innermost dimension is 30"),
    (_gguf_bytes(offset=5), "not a multiple of the alignment"),
    (_gguf_bytes(n_keys=1, extra=struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9) + struct.pack("<IQ", 6, 1 << 40)),
     "entries in the array"),
    (b"GGU", "not b'GGUF'"),
])
def test_a_forged_gguf_file_is_one_clear_error(tmp_path, data, problem):
    from omnispec.spec.gguf import gguf_header

    path = _forged(tmp_path / "x.gguf", data)
    with pytest.raises(SpecError) as err:
        gguf_header(path)
    assert problem in str(err.value) and "not a valid GGUF file" in str(err.value)


def test_a_forged_gguf_through_the_cli_is_one_error_line(wan32, tmp_path):
    bad = _forged(tmp_path / "bad.gguf", b"GGUF" + struct.pack("<IQQ", 3, 1 << 62, 0))
    done = preloaded.python_m([sys.executable, "-m", "omnispec", "run", str(SPECS / "wan2.1-t2v-1.3b.yaml"), "--source",
                               str(wan32), "--set", f"model.components.transformer.file={bad}", "--prompt", "x",
                               "--output", str(tmp_path / "x.mp4")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error:") and "not a valid GGUF file" in lines[-1]
    assert "Traceback" not in done.stderr


def test_gguf_refuses_a_quantization_policy_and_tensor_parallel(wan32):
    spec = {"extends": "wan2.1-t2v-1.3b"}
    with pytest.raises(SpecError, match="already quantized"):
        load_spec(spec, ["model.components.transformer.file=/x/wan.gguf",
                         "policies.quantization.transformer.method=int8_weight_only"])
    with pytest.raises(SpecError, match="GGUF file"):
        load_spec(spec, ["model.components.transformer.file=/x/wan.gguf", "policies.parallel.tensor=2"])
    with pytest.raises(SpecError, match=r"\.safetensors or \.gguf"):
        load_spec(spec, ["model.components.transformer.file=/x/wan.onnx"])


def test_gguf_with_a_lora_and_the_estimate(wan32, wan_files, tmp_path):
    """peft wraps diffusers' GGUFLinear, so a LoRA trains and runs on a GGUF base; the estimate counts the packed
    bytes the header gives."""
    from omnispec.estimate import estimate

    pipe = build_wan(wan32, wan_files["Q8_0"])
    base = pipe("a cat", seed=0).array
    from peft import LoraConfig

    transformer = pipe.components["transformer"]
    transformer.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_v"], init_lora_weights=False))
    assert np.abs(pipe("a cat", seed=0).array - base).max() > 1e-4
    spec = load_spec(SPECS / "wan2.1-t2v-1.3b.yaml", [*WAN, f"model.components.transformer.file={wan_files['Q8_0']}"])
    found = estimate(spec, source=str(wan32), kind="cpu")
    row = next(c for c in found.components if c.name == "transformer")
    from omnispec.spec.gguf import gguf_header

    assert row.stored_bytes == sum(t.end - t.begin for t in gguf_header(wan_files["Q8_0"]).tensors.values())


# ---- checked before weights load ----------------------------------------------------------------------------

def test_a_file_of_another_family_is_refused_naming_both(flux_dir, wan_files):
    with pytest.raises(SpecError, match=r"wan-t2v file \(by its keys and shapes\), not a flux model's"):
        omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir),
                       overrides=[*TINY_OVERRIDES["flux"], f"model.components.transformer.file={wan_files['original']}"])


def test_a_file_of_another_size_or_incomplete_is_refused_before_loading(wan_dir, wan_state, tmp_path):
    """The tiny Wan config is 24 wide; a 32-wide file is refused naming a weight and both shapes; a file missing a
    weight is refused naming it (diffusers would fail inside the loader on a meta tensor)."""
    wide = write_safetensors(wan_original(wan_state), tmp_path / "wide.safetensors")
    with pytest.raises(SpecError, match=r"does not fit the config: \S+ is \[32.*\] in the file and \[24.*\]"):
        build_wan(wan_dir, wide)
    from diffusers import WanTransformer3DModel

    state = WanTransformer3DModel.from_pretrained(str(wan_dir), subfolder="transformer").state_dict()
    original = wan_original(state)
    del original["blocks.1.ffn.2.weight"]
    short = write_safetensors(original, tmp_path / "short.safetensors")
    with pytest.raises(SpecError, match=r"lacks 1 weight\(s\) .*blocks\.1\.ffn\.net\.2\.weight"):
        build_wan(wan_dir, short)


def test_a_comfyui_scaled_fp8_file_is_refused(wan32, wan_state, tmp_path):
    """Its weights are stored divided by per-layer ``scale_weight`` tensors that diffusers' converter drops."""
    original = wan_original(wan_state)
    original["blocks.0.self_attn.q.scale_weight"] = torch.ones(1)
    original["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    file = write_safetensors(original, tmp_path / "scaled.safetensors")
    with pytest.raises(SpecError, match="ComfyUI 'scaled fp8' file"):
        build_wan(wan32, file)


def test_a_pickled_or_missing_file_is_refused(wan_dir, tmp_path):
    with pytest.raises(SpecError, match="pickled weights file"):
        build_wan(wan_dir, tmp_path / "wan.ckpt")
    with pytest.raises(SpecError, match="no such weights file"):
        build_wan(wan_dir, tmp_path / "absent.safetensors")


def test_a_spec_file_names_its_weights_file_relative_to_itself(wan32, wan_files, tmp_path):
    shutil.copy(wan_files["original"], tmp_path / "weights.safetensors")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(f"extends: {SPECS / 'wan2.1-t2v-1.3b.yaml'}\nmodel:\n  components:\n    transformer:\n"
                         "      file: ./weights.safetensors\n")
    spec = load_spec(spec_file)
    assert spec.model.components["transformer"].file == str(tmp_path / "weights.safetensors")


def test_a_hub_file_reference_offline_and_uncached_is_one_clear_error(wan32):
    with pytest.raises(SpecError, match="not in the local cache, and HF_HUB_OFFLINE is set"):
        build_wan(wan32, "city96/Wan2.1-T2V-14B-gguf/wan2.1-t2v-14b-Q4_0.gguf")


# ---- init FILE --------------------------------------------------------------------------------------------

def test_init_drafts_a_spec_from_one_file_that_runs(wan32, wan_files, tmp_path):
    out = tmp_path / "drafted.yaml"
    done = preloaded.python_m([sys.executable, "-m", "omnispec", "init", str(wan_files["Q4_0"]), "--source", str(wan32),
                               "-o", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "from the bundled spec 'wan2.1-t2v-1.3b'" in text and "Q4_0" in text
    spec = load_spec(out)
    assert spec.model.components["transformer"].file == str(wan_files["Q4_0"])
    assert spec.model.source == str(wan32)
    pipe = omnispec.build(out, overrides=WAN)
    assert pipe("a cat", seed=0).array.shape == (1, 5, 32, 32, 3)


def test_init_names_what_a_file_it_cannot_place_is(tmp_path):
    file = write_safetensors({"some.weight": torch.zeros(2, 2)}, tmp_path / "other.safetensors")
    done = preloaded.python_m([sys.executable, "-m", "omnispec", "init", str(file)], capture_output=True, text=True,
                              cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error:") and "no model diffusers recognises" in done.stderr


# ---- pre-quantized folders ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wan_torchao(tmp_path_factory, wan32):
    """The 32-wide tiny Wan with its transformer saved int8 weight-only by torchao (safetensors, as diffusers writes
    it with torchao >= 0.16), in float32 (torchao warns that it supports bfloat16; float32 loads and runs)."""
    pytest.importorskip("torchao")
    from diffusers import TorchAoConfig, WanTransformer3DModel
    from torchao.quantization import Int8WeightOnlyConfig

    root = tmp_path_factory.mktemp("wan_ao") / "ckpt"
    shutil.copytree(wan32, root)
    shutil.rmtree(root / "transformer")
    model = WanTransformer3DModel.from_pretrained(str(wan32), subfolder="transformer", dtype=torch.float32,
                                                  quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    model.save_pretrained(root / "transformer")
    assert not list((root / "transformer").glob("*.bin"))
    return root


def test_a_torchao_serialized_component_loads_as_it_is(wan_torchao):
    from diffusers import WanTransformer3DModel

    pipe = omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(wan_torchao), overrides=WAN)
    weight = pipe.components["transformer"].blocks[0].attn1.to_q.weight
    assert int8_weight(weight)
    ours = pipe("a cat", seed=0)
    transformer = WanTransformer3DModel.from_pretrained(str(wan_torchao), subfolder="transformer",
                                                        dtype=torch.float32)
    assert np.abs(ours.array - wan_reference(wan_torchao, transformer)).max() <= TOL
    assert "torchao Int8WeightOnlyConfig (PerRow)" in pipe.explain()


def test_a_pre_quantized_component_refuses_quantizing_again_and_says_what_it_is(wan_torchao):
    with pytest.raises(SpecError, match=r"already quantized by its checkpoint \(torchao Int8WeightOnlyConfig"):
        omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(wan_torchao),
                       overrides=[*WAN, "policies.quantization.denoiser.method=int8_weight_only"])
    done = preloaded.python_m([sys.executable, "-m", "omnispec", "explain", str(SPECS / "wan2.1-t2v-1.3b.yaml"),
                               "--source", str(wan_torchao)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "transformer: pre-quantized by its checkpoint: torchao Int8WeightOnlyConfig (PerRow)" in done.stdout


def test_an_nf4_text_encoder_loads_as_it_is(wan_dir, tmp_path):
    """bitsandbytes NF4 through transformers (whose quantizer runs on CPU; diffusers' refuses without a GPU, so a
    diffusers NF4 component is a GPU test): the saved 4-bit encoder loads as it is and the output equals diffusers'
    pipeline given the same encoder. The text path is 64 wide: bitsandbytes' CPU kernels quantize rows in blocks
    of 64 values."""
    pytest.importorskip("bitsandbytes")
    from diffusers import WanTransformer3DModel
    from transformers import BitsAndBytesConfig, UMT5Config, UMT5EncoderModel

    root = tmp_path / "ckpt"
    shutil.copytree(wan_dir, root)
    for sub in ("text_encoder", "transformer"):
        shutil.rmtree(root / sub)
    torch.manual_seed(0)
    config = UMT5Config.from_pretrained(str(wan_dir), subfolder="text_encoder")
    config.update(dict(d_model=64, d_ff=128, d_kv=32, num_heads=2))
    UMT5EncoderModel(config).save_pretrained(tmp_path / "plain")
    WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
                          out_channels=16, text_dim=64, freq_dim=256, ffn_dim=64, num_layers=1, cross_attn_norm=True,
                          qk_norm="rms_norm_across_heads", rope_max_seq_len=32).save_pretrained(root / "transformer")
    encoder = UMT5EncoderModel.from_pretrained(str(tmp_path / "plain"), device_map="cpu", quantization_config=(
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)))
    encoder.save_pretrained(root / "text_encoder")
    saved = json.loads((root / "text_encoder" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "bitsandbytes" and saved["bnb_4bit_quant_type"] == "nf4"
    pipe = omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(root), overrides=WAN)
    assert "bitsandbytes nf4 4-bit" in pipe.explain()
    ours = pipe("a cat", seed=0)
    reloaded = UMT5EncoderModel.from_pretrained(str(root), subfolder="text_encoder", device_map="cpu")
    assert np.abs(ours.array - wan_reference(root, None, text_encoder=reloaded)).max() <= TOL


# ---- quantized weights with the device policies (a GPU: offload and compile act on CUDA) -------------------------

COMPILED_GGUF = pytest.mark.xfail(reason="compiled GGUF vs eager on the H200 (2026-12-01): within 2e-3 in one run, "
                                   "0.049 apart in another; not yet explained (the offloaded runs are exact)")


@pytest.mark.gpu
@pytest.mark.parametrize("weights, policy", [
    ("Q8_0", "policies.offload.strategy=model"), ("Q8_0", "policies.offload.strategy=group"),
    pytest.param("Q8_0", "policies.compile.mode=regional", marks=COMPILED_GGUF),
    ("torchao", "policies.offload.strategy=model"), ("torchao", "policies.offload.strategy=group"),
    ("torchao", "policies.compile.mode=regional")])
def test_quantized_weights_compose_with_offload_and_compile(request, wan32, wan_files, weights, policy):
    """Offload moves the packed GGUF tensors and torchao's tensors as they are (the output is the resident run's,
    exactly); compiled, inductor fuses the dequantisation, which moves outputs by float rounding only."""
    if weights == "torchao":
        torchao = pytest.importorskip("torchao")
        if tuple(int(x) for x in torchao.__version__.split(".")[:2]) < (0, 18):
            pytest.skip("torchao before 0.18 saves int8 weights as tensors it cannot serialise to safetensors")
    root = request.getfixturevalue("wan_torchao") if weights == "torchao" else wan32
    file = [] if weights == "torchao" else [f"model.components.transformer.file={wan_files[weights]}"]
    common = [*WAN, *file, "runtime.device=cuda"]
    spec = SPECS / "wan2.1-t2v-1.3b.yaml"
    resident = omnispec.build(spec, source=str(root), overrides=common)("a cat", seed=0).array
    moved = omnispec.build(spec, source=str(root), overrides=[*common, policy])("a cat", seed=0).array
    assert np.abs(moved - resident).max() <= (2e-3 if "compile" in policy else TOL)
