"""Checkpoint folders, weights files, code references and the environment, when hostile or broken: nothing runs code
the checkpoint names without --trust-code, and each bad one is one ``error:`` line (exit 2), within seconds and
bounded memory, before any weight loads. Every hostile file is built here, in the test."""

import importlib
import importlib.util
import json
import shutil
import struct
import subprocess
import sys
import time

import pytest
import torch
from test_untrusted_inputs import DIGITS, record_of, write_record_png

import omnispec
from omnispec.cli import main
from omnispec.spec import SpecError, load_spec
from omnispec.testing import TINY_OVERRIDES

from conftest import MARKER_CODE, ROOT, SPECS, refused
from preloaded import free_port

FLUX = [a for o in TINY_OVERRIDES["flux"] for a in ("--set", o)]
WAN = [a for o in [*TINY_OVERRIDES["wan"], "recipe.defaults.steps=2"] for a in ("--set", o)]


def _copy(folder, tmp_path, name="ckpt"):
    copy = tmp_path / name
    shutil.copytree(folder, copy)
    return copy


def _set_json(path, **entries):
    path.write_text(json.dumps({**json.loads(path.read_text()), **entries}))


def _flux_run(folder, tmp_path, *more):
    return ["run", "flux1-dev", "--source", str(folder), "--prompt", "x", *FLUX, *more,
            "--output", str(tmp_path / "x.png")]


def _no_weights_load(monkeypatch):
    build = importlib.import_module("omnispec.runtime.build")  # the module (the package exports its function)
    monkeypatch.setattr(build, "load_components", lambda *a, **k: pytest.fail("weights loaded"))


# ---- code a checkpoint's config names --------------------------------------------------------------------------

@pytest.fixture
def hub_kernel(tmp_path, monkeypatch, marker):
    """A kernel the ``kernels`` package would load as ``kernels-community/evil`` (its local override standing for
    the Hub): importing it creates the marker."""
    pytest.importorskip("kernels")
    folder = tmp_path / "kernel"
    (folder / "evil").mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps({"id": "evil", "name": "evil", "version": 1, "license": "MIT",
                                                      "python-depends": [], "backend": {"type": "cpu"}}))
    (folder / "evil" / "__init__.py").write_text(MARKER_CODE + "def flash_attn_varlen_func(*args, **kwargs):\n"
                                                 "    raise RuntimeError('not a kernel')\n")
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/evil={folder}:kernels-community/flash-attn2={folder}")
    return folder


@pytest.mark.parametrize("value", ["kernels-community/evil", "flash_attention_2"])
def test_an_attention_implementation_that_imports_a_hub_kernel_is_refused(flux_dir, tmp_path, capsys, hub_kernel,
                                                                          marker, monkeypatch, value):
    """transformers imports a Hub kernel named as the attention, and falls back to one for flash attention when
    flash-attn is not installed; trust_remote_code=False does not cover either."""
    copy = _copy(flux_dir, tmp_path)
    _set_json(copy / "text_encoder" / "config.json", attn_implementation=value)
    _no_weights_load(monkeypatch)
    fragments = ("text_encoder/config.json", f"attn_implementation: {value!r}", "--trust-code")
    refused(_flux_run(copy, tmp_path), *fragments, capsys=capsys)
    refused(["explain", "flux1-dev", "--source", str(copy), "--estimate", *FLUX], *fragments, capsys=capsys)
    with pytest.raises(SpecError, match="attn_implementation"):
        omnispec.build(SPECS / "flux1-dev.yaml", source=str(copy), overrides=TINY_OVERRIDES["flux"])
    assert not marker.exists()


def test_trust_code_lets_the_checkpoints_attention_kernel_load(flux_dir, tmp_path, capsys, hub_kernel, marker):
    copy = _copy(flux_dir, tmp_path)
    _set_json(copy / "text_encoder" / "config.json", attn_implementation="kernels-community/evil")
    assert main(["-q", "explain", "flux1-dev", "--source", str(copy), "--estimate", "--trust-code", *FLUX]) == 0
    assert marker.exists()


def test_implementations_are_checked_in_sub_configs_and_per_sub_config_mappings():
    from omnispec.spec.loader_fields import code_problems

    config = {"attn_implementation": {"": "sdpa", "vision_config": "kernels-community/x"},
              "text_config": {"experts_implementation": "sonicmoe", "attn_implementation": "eager"},
              "layers": [{"attn_implementation": "paged|eager"}]}
    found = [p.message.split(":")[0] for p in code_problems(config, "model.components.x", "config.json")]
    assert found == ["attn_implementation.vision_config", "text_config.experts_implementation",
                     "layers.0.attn_implementation"]
    assert code_problems({"attn_implementation": "sdpa", "experts_implementation": None}, "", "") == []


def test_a_quantizer_that_fetches_hub_kernels_needs_trust_code(flux_dir, tmp_path, capsys, monkeypatch):
    copy = _copy(flux_dir, tmp_path)
    _set_json(copy / "text_encoder" / "config.json", quantization_config={"quant_method": "eetq", "weights": "int8"})
    _no_weights_load(monkeypatch)
    refused(_flux_run(copy, tmp_path), "quantization_config.quant_method: 'eetq'", "--trust-code", capsys=capsys)
    refused(["explain", "flux1-dev", "--source", str(copy)], "'eetq'", capsys=capsys)


def test_a_spec_cannot_choose_an_experts_implementation():
    with pytest.raises(SpecError, match="keyword"):
        load_spec(DIGITS, ["model.components.transformer.config.experts_implementation=sonicmoe"])


# ---- the shape of a saved quantization config --------------------------------------------------------------------

_DEFAULT = {"_type": "Int8WeightOnlyConfig", "_data": {}}


@pytest.mark.parametrize("folder, value, fragment", [
    ("transformer", "torchao", "quantization_config: expected an object naming its quant_method"),
    ("transformer", [1, 2], "quantization_config: expected an object"),
    ("text_encoder", [{"quant_method": "bitsandbytes"}], "quantization_config: expected an object"),
    ("transformer", {"quant_method": 7}, "quantization_config.quant_method: expected the quantizer's name"),
    ("transformer", {"quant_method": "torchao", "quant_type": "int8_weight_only"}, "quantization_config.quant_type"),
    ("transformer", {"quant_method": "torchao", "quant_type": {"default": _DEFAULT, "other": {}}},
     "quantization_config.quant_type: expected {'default'"),
    ("transformer", {"quant_method": "torchao", "quant_type": {"default": {"_type": "load", "_data": "x"}}},
     "quant_type.default._type: 'load' is not a torchao class name"),
    ("transformer", {"quant_method": "torchao", "quant_type": {"default": {
        "_type": "Int8WeightOnlyConfig", "_data": {"granularity": {"_type": "os.system", "_data": "x"}}}}},
     "quant_type.default._data.granularity._type"),
    ("transformer", {"quant_method": "torchao", "quant_type": {"default": {"_type": "torch.dtype", "_data": "load"}}},
     "'load' is not the name of a torch dtype"),
    ("text_encoder", {"quant_method": "bitsandbytes", "load_in_4bit": "yes"}, "load_in_4bit: expected true or false"),
    ("text_encoder", {"quant_method": "bitsandbytes", "modules_to_not_convert": "proj"},
     "modules_to_not_convert: expected a list of module names"),
])
def test_a_malformed_quantization_config_is_one_error_before_any_library_reads_it(flux_dir, tmp_path, capsys,
                                                                                  monkeypatch, folder, value, fragment):
    copy = _copy(flux_dir, tmp_path)
    _set_json(copy / folder / "config.json", quantization_config=value)
    _no_weights_load(monkeypatch)
    for argv in (_flux_run(copy, tmp_path), ["explain", "flux1-dev", "--source", str(copy)],
                 ["explain", "flux1-dev", "--source", str(copy), "--estimate", *FLUX]):
        refused(argv, f"{folder}/config.json", fragment, capsys=capsys)


def test_a_well_formed_torchao_config_passes_the_shape_check():
    from omnispec.spec.loader_fields import quantization_problem

    saved = {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int8WeightOnlyConfig", "_version": 2,
             "_data": {"granularity": {"_type": "PerRow", "_data": {}}, "act_mapping_type": {"_type": "MappingType",
                       "_data": "SYMMETRIC"}, "layout": [{"_type": "PlainLayout", "_data": {}}]}}}}
    assert quantization_problem(saved) is None


# ---- a missing quantizer names its package -------------------------------------------------------------------------

def test_a_missing_quantizer_package_is_named_not_the_video_extra(flux_dir, tmp_path, capsys):
    from omnispec.runtime.components import missing_library

    if importlib.util.find_spec("hqq") is not None:
        pytest.skip("hqq is installed")
    copy = _copy(flux_dir, tmp_path)
    _set_json(copy / "text_encoder" / "config.json", quantization_config={"quant_method": "hqq", "nbits": 4})
    err = refused(_flux_run(copy, tmp_path, "--trust-code"), "it needs hqq", "pip install hqq", capsys=capsys)
    assert "[video]" not in err
    assert "[video]" not in missing_library(ImportError("Optimum is not available"))
    assert "[video]" in missing_library(ModuleNotFoundError("No module named 'av'", name="av"))
    assert "[qwen-edit]" in missing_library(ImportError("it requires the Torchvision library"))


# ---- a torchrun environment left in the shell ------------------------------------------------------------------------

@pytest.mark.parametrize("environment, fragment", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR, MASTER_PORT are not set"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE is 'two', not an integer"),
    ({"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "RANK is 5, outside"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "not a TCP port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "free"},
     "the other ranks did not come within 1 s"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "free"},
     "nothing answers at MASTER_ADDR:MASTER_PORT 127.0.0.1:"),
])
def test_a_torchrun_environment_without_its_ranks_fails_within_seconds(tmp_path, capsys, monkeypatch, environment,
                                                                       fragment):
    monkeypatch.setattr("omnispec.runtime.parallel.launch.RENDEZVOUS_SECONDS", 1.0)
    _no_weights_load(monkeypatch)
    for name, value in environment.items():
        monkeypatch.setenv(name, str(free_port()) if value == "free" else value)
    for name in {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} - set(environment):
        monkeypatch.delenv(name, raising=False)
    start = time.perf_counter()
    refused(["run", "digits", "--prompt", "7", "--set", "policies.parallel.cfg=2", "--set", "recipe.defaults.steps=2",
             "--output", str(tmp_path / "x.png")], "policies.parallel", fragment, capsys=capsys)
    assert time.perf_counter() - start < 10
    assert not torch.distributed.is_initialized()


# ---- weights files -----------------------------------------------------------------------------------------------

def _safetensors(path, header):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def _gguf(path, keys=(), tensors=()):
    body = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(keys)) + b"".join(keys) + b"".join(tensors)
    path.write_bytes(body + b"\0" * (-len(body) % 32))
    return path


def _gguf_tensor(name, dims, kind=0):
    return (struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, 0))


def _gguf_array(key, item_type, length, entry=b""):
    return struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, item_type, length) + entry * length


@pytest.mark.parametrize("make, kind", [
    (lambda p: _safetensors(p / "w.safetensors", {"w": {"dtype": "F32", "shape": [0, 1 << 40, 1 << 40],
                                                        "data_offsets": [0, 0]}}), "safetensors"),
    (lambda p: _gguf(p / "w.gguf", tensors=[_gguf_tensor(b"w", (1 << 40, 1 << 40, 0))]), "GGUF"),
])
def test_an_empty_tensor_with_overflowing_strides_is_refused_from_its_header(wan_dir, tmp_path, capsys, monkeypatch,
                                                                             make, kind):
    file = make(tmp_path)
    _no_weights_load(monkeypatch)
    fragments = (f"not a valid {kind} file", "has strides past 64 bits")
    refused(["init", str(file)], *fragments, capsys=capsys)
    refused(["run", "wan2.1-t2v-1.3b", "--source", str(wan_dir), "--set", f"model.components.transformer.file={file}",
             "--prompt", "x", *WAN, "--output", str(tmp_path / "x.mp4")], *fragments, capsys=capsys)


def test_gguf_metadata_arrays_are_bounded_in_count_and_never_held(tmp_path):
    from omnispec.spec.gguf import MAX_ARRAY_ENTRIES, GGUFArray, gguf_header

    small = _gguf(tmp_path / "small.gguf", keys=[_gguf_array(b"tokens", 8, 3, struct.pack("<Q", 2) + b"ab"),
                                                 _gguf_array(b"scores", 6, 1000, b"\0" * 4)])
    assert gguf_header(small).metadata == {"tokens": GGUFArray(8, 3), "scores": GGUFArray(6, 1000)}
    half = MAX_ARRAY_ENTRIES // 2 + 1
    big = _gguf(tmp_path / "big.gguf", keys=[_gguf_array(b"a%d" % i, 0, half, b"\0") for i in range(2)])
    with pytest.raises(SpecError, match=f"entries in the array 'a1', which bring its metadata arrays past the "
                                        f"{MAX_ARRAY_ENTRIES:,}"):
        gguf_header(big)


def test_a_gguf_header_of_huge_arrays_is_refused_within_memory(tmp_path):
    """Sixty arrays of four million entries (240 MB of header) took 2.4 GB to read as Python lists."""
    path = tmp_path / "arrays.gguf"
    with path.open("wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 60))
        for i in range(60):
            f.write(struct.pack("<Q", 6) + b"arr%03d" % i + struct.pack("<IIQ", 9, 0, 4_000_000))
            f.seek(4_000_000, 1)
        f.write(b"\0" * 32)
    script = ("import sys\nfrom omnispec.spec import SpecError\nfrom omnispec.spec.gguf import gguf_header\n"
              "try:\n    gguf_header(sys.argv[1])\nexcept SpecError as e:\n    print(e)\n"
              "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))\n")
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, check=False)
    lines = out.stdout.splitlines()
    assert "4,000,000 entries in the array 'arr000'" in lines[0], out
    assert int(lines[-1]) * 1024 < 200 << 20  # peak resident memory of the whole process (kB)


@pytest.mark.parametrize("scale", ["weight_scale", "input_scale", "comfy_quant", "weight_scale_2"])
def test_a_comfyui_file_with_per_layer_scales_is_refused_not_loaded_without_them(wan_dir, tmp_path, capsys,
                                                                                 monkeypatch, scale):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from omnispec.testing.single_files import COMFY_PREFIX, wan_original

    state = wan_original(WanTransformer3DModel.from_pretrained(str(wan_dir), subfolder="transformer").state_dict(),
                         COMFY_PREFIX)
    for key in [k for k in state if k.endswith(".weight") and state[k].ndim == 2]:
        state[key] = (state[key] / 2).to(torch.float8_e4m3fn)
        state[key.removesuffix("weight") + scale] = torch.tensor(2.0)
    file = tmp_path / "comfy.safetensors"
    save_file(state, file)
    monkeypatch.setattr("omnispec.runtime.single_file.load", lambda *a, **k: pytest.fail("the file was loaded"))
    fragments = ("ComfyUI 'scaled fp8' file or another quantized layout", f".{scale} and")
    refused(["run", "wan2.1-t2v-1.3b", "--source", str(wan_dir), "--set", f"model.components.transformer.file={file}",
             "--prompt", "x", *WAN, "--output", str(tmp_path / "x.mp4")], *fragments, capsys=capsys)
    refused(["init", str(file)], *fragments, capsys=capsys)


# ---- references to the Hub ------------------------------------------------------------------------------------

@pytest.mark.parametrize("ref", ["owner/name/../../x.safetensors", "owner/name/sub/../x.gguf",
                                 "owner/name/./x.safetensors", "owner/name//x.safetensors", "sub\\..\\x.safetensors"])
def test_a_file_reference_with_dot_segments_is_refused_at_load(wan_dir, tmp_path, capsys, ref):
    with pytest.raises(SpecError, match="not a path inside a repository or folder"):
        load_spec(SPECS / "wan2.1-t2v-1.3b.yaml", [f"model.components.transformer.file={ref}"])
    for argv in (["run", "wan2.1-t2v-1.3b", "--source", str(wan_dir), "--prompt", "x",
                  "--output", str(tmp_path / "x.mp4")], ["explain", "wan2.1-t2v-1.3b", "--estimate"]):
        refused([*argv, "--set", f"model.components.transformer.file={ref}"], "model.components.transformer.file",
                "not a path inside a repository or folder", capsys=capsys)


@pytest.mark.parametrize("ref", ["own..er/name", "a/b c", "own--er/name", "owner/name-"])
def test_a_hub_id_the_hub_would_refuse_is_one_error(tmp_path, capsys, ref):
    out = ["--output", str(tmp_path / "x.png")]
    refused(["run", "digits", "--source", ref, "--prompt", "7", *out], "neither a local directory nor a Hub id",
            capsys=capsys)
    refused(["run", "digits", "--prompt", "7", "--lora", ref, *out], "not a Hub id", capsys=capsys)
    refused(["init", ref], "neither a checkpoint folder nor a Hub id", capsys=capsys)


def test_a_lora_weight_name_leaving_its_repository_is_refused(tmp_path, capsys):
    refused(["run", "digits", "--prompt", "7", "--lora", "owner/name:../x.safetensors", "--output",
             str(tmp_path / "x.png")], "LoRA 'owner/name'", "not a path inside a repository", capsys=capsys)


# ---- compile backends -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits_png(tmp_path_factory):
    """A real output of the digits model with its record."""
    pipe = omnispec.build(DIGITS, overrides=["runtime.progress=false", "recipe.defaults.steps=2"])
    (png,) = pipe("seven", seed=1).save(tmp_path_factory.mktemp("made") / "seven.png")
    return png


def test_an_unknown_compile_backend_is_refused_before_any_weight_loads(digits_png, tmp_path, capsys, monkeypatch):
    _no_weights_load(monkeypatch)
    fragment = "policies.compile.backend: torch knows no compile backend 'nonexistent'"
    refused(["run", "digits", "--prompt", "7", "--set", "policies.compile.mode=regional", "--set",
             "policies.compile.backend=nonexistent", "--output", str(tmp_path / "x.png")], fragment, capsys=capsys)
    data = record_of(digits_png)
    data["spec"].setdefault("policies", {})["compile"] = {"mode": "regional", "backend": "nonexistent"}
    png = write_record_png(tmp_path / "compiled.png", data)
    refused(["run", "--from", str(png), "--output", str(tmp_path / "again.png")], fragment, capsys=capsys)
    with pytest.raises(SpecError, match="policies.compile.backend"):
        load_spec(DIGITS, ["policies.compile.backend=not a name"])
