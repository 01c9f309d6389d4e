"""Files a user hands omnispec are data: none runs code, each bad one is one clear ``error:`` line (exit 2) before any
weight loads. Every hostile file is built here, in the test."""

import builtins
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import omnispec
from omnispec import records
from omnispec.cli import main
from omnispec.spec import SpecError, load_spec
from omnispec.spec.base import MAX_IMAGE_PIXELS
from omnispec.spec.images import image_condition
from omnispec.testing import TINY_OVERRIDES

from conftest import MARKER_CODE, ROOT, SPECS, refused

DIGITS = SPECS / "digits.yaml"
WEIGHTS = ROOT / "src_models" / "digits" / "weights"
FAST = ["--set", "recipe.defaults.steps=2"]


@pytest.fixture
def digits_copy(tmp_path):
    target = tmp_path / "digits"
    shutil.copytree(WEIGHTS, target)
    return target


@pytest.fixture(scope="module")
def digits_png(tmp_path_factory):
    """A real output of the digits model with its record."""
    folder = tmp_path_factory.mktemp("made")
    pipe = omnispec.build(DIGITS, overrides=["runtime.progress=false", "recipe.defaults.steps=2"])
    (png,) = pipe("seven", seed=1).save(folder / "seven.png")
    return png


def write_record_png(path, record, compressed=False):
    """A PNG carrying ``record`` (a dict) in its ``omnispec`` text chunk, as omnispec writes it (or as zTXt)."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    text = records.to_text(record)
    if compressed:
        info.add_text(records.KEY, text, zip=True)
    else:
        info.add_itxt(records.KEY, text)
    Image.new("L", (32, 32)).save(path, pnginfo=info)
    return path


def record_of(png):
    return records.read(png).data()


# ---- nothing runs from an input ------------------------------------------------------------------------

def test_a_record_cannot_turn_on_a_checkpoints_own_code(digits_png, tmp_path, marker, capsys):
    evil = tmp_path / "evil-model"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "code.Model"}, "model_type": "evil"}))
    (evil / "code.py").write_text(MARKER_CODE)
    data = record_of(digits_png)
    data["spec"]["model"]["components"]["text_encoder"] = {
        "role": "encoder", "class": "transformers.AutoModel", "source": str(evil),
        "config": {"trust_remote_code": True}}
    png = write_record_png(tmp_path / "evil.png", data)
    refused(["run", "--from", str(png), "--output", str(tmp_path / "x.png")], "trust_remote_code",
            "keyword(s) of from_pretrained", capsys=capsys)
    with pytest.raises(SpecError, match="trust_remote_code"):
        omnispec.replay(png)
    assert not marker.exists()


def test_a_tokenizer_with_its_own_code_is_refused_without_a_prompt(digits_copy, tmp_path, marker, capsys,
                                                                   monkeypatch):
    config = digits_copy / "tokenizer" / "tokenizer_config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "tokenizer_class": "EvilTokenizer",
                                  "auto_map": {"AutoTokenizer": [None, "evil_tok.EvilTokenizer"]}}))
    code = MARKER_CODE + "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    for folder in (digits_copy, digits_copy / "tokenizer"):  # transformers looks for it at the checkpoint's root
        (folder / "evil_tok.py").write_text(code)
    monkeypatch.setattr(builtins, "input", lambda *a: pytest.fail("a loader asked on the terminal"))
    refused(["run", "digits", "--source", str(digits_copy), "--prompt", "7", "--output", str(tmp_path / "x.png")],
            "contains custom code", capsys=capsys)
    assert not marker.exists()
    # the user's own --trust-code is what lets it run
    main(["run", "digits", "--source", str(digits_copy), "--prompt", "7", "--trust-code", *FAST,
          "--output", str(tmp_path / "trusted.png")])
    assert marker.exists()


@pytest.mark.parametrize("key", ["trust_remote_code", "revision", "cache_dir", "token", "local_files_only",
                                 "use_safetensors", "device_map", "attn_implementation", "_private"])
def test_loader_keywords_are_not_config_entries(key):
    with pytest.raises(SpecError, match="keyword"):
        load_spec(DIGITS, [f"model.components.transformer.config.{key}=true"])


def test_config_overrides_name_entries_of_the_components_config(capsys, tmp_path):
    refused(["run", "digits", "--prompt", "7", "--set", "model.components.transformer.config.not_an_entry=1",
             "--output", str(tmp_path / "x.png")], "'not_an_entry': not an entry of the component's config.json",
            capsys=capsys)
    with pytest.raises(SpecError, match="a tokenizer has none"):
        load_spec(DIGITS, ["model.components.tokenizer.config.model_max_length=9"])


def test_pickled_weights_are_refused_by_name_before_anything_reads_them(digits_copy, tmp_path, capsys, monkeypatch):
    folder = digits_copy / "transformer"
    state = {"w": torch.zeros(1)}
    torch.save(state, folder / "diffusion_pytorch_model.bin")
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    refused(["run", "digits", "--source", str(digits_copy), "--prompt", "7", "--output", str(tmp_path / "x.png")],
            "diffusion_pytorch_model.bin", "pickled weights only", capsys=capsys)
    with pytest.raises(SpecError, match="pickled weights file"):
        load_spec(DIGITS, ["model.components.transformer.file=model.ckpt"])
    assert load_spec(DIGITS, ["model.components.transformer.file=model.ckpt"], trust_code=True)


def test_a_truncated_safetensors_component_is_one_error(digits_copy, tmp_path, capsys):
    weights = digits_copy / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    refused(["run", "digits", "--source", str(digits_copy), "--prompt", "7", "--output", str(tmp_path / "x.png")],
            "not a valid safetensors file", "outside the file", capsys=capsys)


# ---- records are data with a schema ----------------------------------------------------------------------

@pytest.mark.parametrize("change, fragment", [
    (lambda r: r.pop("request"), "record.request: required key is missing"),
    (lambda r: r["request"].update(steps="abc"), "record.request.steps"),
    (lambda r: r["request"].update(prompts=[1]), "record.request.prompts.0"),
    (lambda r: r.update(sample=7), "sample 7 does not exist"),
    (lambda r: r.update(shell="rm -rf /"), "unknown key 'shell'"),
    (lambda r: r["checkpoint"]["roots"][next(iter(r["checkpoint"]["roots"]))]["config_sha256"].update(
        {"../../etc/passwd": "0" * 64}), "not a file name inside the checkpoint"),
    (lambda r: r.update(omnispec=2), "not an omnispec record of format 1"),
])
def test_a_bad_record_is_refused_before_anything_loads(digits_png, tmp_path, capsys, change, fragment):
    data = record_of(digits_png)
    change(data)
    png = write_record_png(tmp_path / "bad.png", data)
    refused(["run", "--from", str(png), "--output", str(tmp_path / "x.png")], fragment, capsys=capsys)
    refused(["explain", str(png)], fragment, capsys=capsys)
    with pytest.raises(SpecError, match=fragment.split(":")[0]):
        omnispec.replay(png)


def test_a_compressed_record_reads_and_a_text_bomb_is_refused(digits_png, tmp_path, capsys):
    data = record_of(digits_png)
    assert records.read(write_record_png(tmp_path / "z.png", data, compressed=True)).request.prompts == ["seven"]
    bomb = tmp_path / "bomb.png"
    Image.new("L", (8, 8)).save(bomb)
    raw = bomb.read_bytes()
    body = b"omnispec\0\0" + zlib.compress(b" " * (64 << 20), 9)
    chunk = struct.pack(">I", len(body)) + b"zTXt" + body + struct.pack(">I", zlib.crc32(b"zTXt" + body))
    bomb.write_bytes(raw[:33] + chunk + raw[33:])
    refused(["explain", str(bomb)], "inflates past", capsys=capsys)


def test_a_large_record_is_refused_by_its_size_and_memory_stays_bounded(tmp_path):
    big = tmp_path / "big.npy"
    np.save(big, np.zeros(1))
    (tmp_path / "big.npy.json").write_text(json.dumps({"omnispec": 1, "pad": "x" * (16 << 20)}))
    many = tmp_path / "many.npy"
    np.save(many, np.zeros(1))
    (tmp_path / "many.npy.json").write_text(json.dumps({"omnispec": 1, "spec": {}, "request": [0] * 1_000_000}))
    # VmHWM: this process's peak resident memory (getrusage's ru_maxrss would include the forking parent's)
    script = ("import sys\nfrom omnispec import records\nfrom omnispec.spec import SpecError\n"
              "for path in sys.argv[1:]:\n    try:\n        records.read(path)\n    except SpecError as e:\n"
              "        print(e)\nprint(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))\n")
    out = subprocess.run([sys.executable, "-c", script, str(big), str(many)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    lines = out.stdout.splitlines()
    assert "above the 4,194,304-byte limit" in lines[0] and "values" in lines[1], out
    assert int(lines[-1]) * 1024 < 300 << 20  # peak resident memory of the whole process (kB)


def test_the_depth_scan_of_json_is_linear(tmp_path):
    from omnispec.spec.bounded import RECORD, parse_json

    text = '"' + '\\"' * 1_000_000  # an unterminated string of escaped quotes: quadratic for a backtracking pattern
    start = time.perf_counter()
    with pytest.raises(SpecError, match="not valid JSON"):
        parse_json(text, bounds=RECORD)
    assert time.perf_counter() - start < 5


def test_a_record_from_another_version_replays_only_when_allowed(digits_png, tmp_path, capsys):
    data = record_of(digits_png)
    data["versions"]["omnispec"] = "9.9.0"
    png = write_record_png(tmp_path / "old.png", data)
    refused(["run", "--from", str(png), "--output", str(tmp_path / "x.png")],
            f"omnispec 9.9.0 made it, {omnispec.__version__} is installed", "--allow-version-drift", capsys=capsys)
    assert main(["run", "--from", str(png), "--allow-version-drift", "--output", str(tmp_path / "again.png")]) == 0
    again = records.read(tmp_path / "again.png")
    assert again.replay_of is not None and "omnispec 9.9.0 made it" in again.replay_of.drift[0]
    assert omnispec.replay(png, allow_version_drift=True).provenance["replay_of"]["drift"]


# ---- images --------------------------------------------------------------------------------------------

def test_files_that_are_not_images_are_refused(tmp_path, capsys):
    (tmp_path / "text.png").write_text("hello")
    Image.new("RGB", (64, 64), (200, 10, 10)).save(tmp_path / "full.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "full.png").read_bytes()[:80])
    for name, fragment in (("text.png", "not an image in a format"), ("cut.png", "not a readable image"),
                           ("missing.png", "no such image file")):
        with pytest.raises(SpecError, match=fragment):
            image_condition(str(tmp_path / name), 0, "request.image")
    refused(["run", "flux1-kontext-dev", "--prompt", "x", "--image", str(tmp_path / "cut.png"),
             "--output", str(tmp_path / "o.png")], "not a readable image", capsys=capsys)


def test_a_decompression_bomb_is_refused_from_its_header(tmp_path):
    side = 100_000
    body = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    ihdr = struct.pack(">I", 13) + b"IHDR" + body + struct.pack(">I", zlib.crc32(b"IHDR" + body))
    idat_data = zlib.compress(b"\0" * 1000)
    idat = struct.pack(">I", len(idat_data)) + b"IDAT" + idat_data + struct.pack(">I", zlib.crc32(b"IDAT" + idat_data))
    (tmp_path / "bomb.png").write_bytes(b"\x89PNG\r\n\x1a\n" + ihdr + idat + b"\0\0\0\0IEND\xaeB`\x82")
    start = time.perf_counter()
    with pytest.raises(SpecError, match=f"limit of {MAX_IMAGE_PIXELS:,}|more pixels than"):
        image_condition(str(tmp_path / "bomb.png"), 0, "request.image")
    assert time.perf_counter() - start < 2


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "image.png"
    os.mkfifo(fifo)
    found = []
    worker = threading.Thread(target=lambda: found.append(pytest.raises(SpecError, image_condition, str(fifo), 0,
                                                                        "request.image")), daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "reading a FIFO blocked"
    assert "is a FIFO" in str(found[0].value)


WHITE, RED = (255, 255, 255), (255, 0, 0)


@pytest.mark.parametrize("mode, make, expected", [
    ("RGBA", lambda: Image.new("RGBA", (4, 4), (255, 0, 0, 0)), WHITE),  # transparent: over white, not red
    ("RGBA", lambda: Image.new("RGBA", (4, 4), (255, 0, 0, 255)), RED),
    ("LA", lambda: Image.new("LA", (4, 4), (0, 0)), WHITE),
    ("P", lambda: Image.new("RGB", (4, 4), RED).convert("P"), RED),
    ("P+transparency", lambda: _transparent_palette(), WHITE),
    ("L", lambda: Image.new("L", (4, 4), 128), (128, 128, 128)),
    ("1", lambda: Image.new("1", (4, 4), 1), WHITE),
    ("I;16", lambda: Image.fromarray(np.full((4, 4), 65535, np.uint16)), WHITE),
    ("I;16 mid", lambda: Image.fromarray(np.full((4, 4), 32896, np.uint16)), (128, 128, 128)),
    ("I", lambda: Image.fromarray(np.full((4, 4), 65535, np.int32)), WHITE),
    ("CMYK", lambda: Image.new("CMYK", (4, 4), (0, 255, 255, 0)), RED),
    ("YCbCr", lambda: Image.new("RGB", (4, 4), RED).convert("YCbCr"), None),
])
def test_every_image_mode_becomes_rgb(tmp_path, mode, make, expected):
    image = make()
    for given in (image, _saved(image, tmp_path, mode)):
        condition = image_condition(given, 0, "request.image")
        assert condition.image.mode == "RGB"
        if expected is not None:
            assert condition.image.getpixel((0, 0)) == expected, (mode, condition.image.getpixel((0, 0)))


def _transparent_palette():
    image = Image.new("P", (4, 4), 0)
    image.putpalette([255, 0, 0] + [0, 0, 0] * 255)
    image.info["transparency"] = 0
    return image


def _saved(image, tmp_path, mode):
    path = tmp_path / f"{mode.replace(';', '_').replace('+', '_').replace(' ', '_')}.{'tiff' if image.mode in ('CMYK', 'YCbCr', 'I') else 'png'}"
    if image.mode == "YCbCr":
        image.convert("RGB").save(path)
    else:
        image.save(path)
    return str(path)


def test_the_digest_covers_mode_and_palette():
    red = Image.new("P", (4, 4), 0)
    red.putpalette([255, 0, 0] * 256)
    blue = Image.new("P", (4, 4), 0)
    blue.putpalette([0, 0, 255] * 256)
    digests = {image_condition(im, 0, "x").digest for im in (red, blue, red.convert("RGB"))}
    assert len(digests) == 3


@pytest.mark.parametrize("given, fragment", [
    (np.full((8, 8, 3), 2.0, np.float32), "values lie in [0, 1]"),
    (np.full((8, 8, 3), np.nan, np.float32), "NaN or infinite"),
    (np.zeros((8, 8, 3), np.int32), "must be floating point"),
    (np.zeros((8, 8, 4), np.float32), "1 or 3 channels"),
    (np.zeros((8,), np.float32), "is (H, W, C)"),
    (np.zeros((8, 8, 5), np.uint8), "1, 3 or 4 channels"),
    (torch.full((3, 8, 8), -1.0), "values lie in [0, 1]"),
    (torch.zeros((8, 8, 3), dtype=torch.uint8), "must be floating point"),
    (torch.zeros((5, 8, 8)), "1 or 3 channels"),
])
def test_arrays_and_tensors_are_checked(given, fragment):
    with pytest.raises(SpecError, match=fragment.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        image_condition(given, 0, "request.image")


def test_an_8_bit_array_is_the_picture_it_holds():
    pixels = np.zeros((8, 8, 4), np.uint8)  # fully transparent: composited over white as a PIL image would be
    condition = image_condition(pixels, 0, "request.image")
    assert condition.image.mode == "RGB" and condition.image.getpixel((0, 0)) == WHITE


# ---- LoRA files ----------------------------------------------------------------------------------------

FLUX = [a for o in TINY_OVERRIDES["flux"] for a in ("--set", o)]


def flux_run(flux_dir, tmp_path, lora):
    return ["run", "flux1-dev", "--source", str(flux_dir), "--prompt", "a cat", "--lora", lora, *FLUX,
            "--output", str(tmp_path / "x.png")]


def test_a_lora_that_is_not_safetensors_is_refused_by_name(flux_dir, tmp_path, capsys, monkeypatch):
    torch.save({"a": torch.zeros(1)}, tmp_path / "style.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    refused(flux_run(flux_dir, tmp_path, str(tmp_path / "style.bin")), "style.bin", "pickled weights", capsys=capsys)
    folder = tmp_path / "only-pickles"
    folder.mkdir()
    torch.save({"a": torch.zeros(1)}, folder / "pytorch_lora_weights.bin")
    refused(flux_run(flux_dir, tmp_path, str(folder)), "no .safetensors LoRA file", "pytorch_lora_weights.bin",
            capsys=capsys)


def test_a_truncated_or_forged_lora_header_is_refused(flux_dir, tmp_path, capsys):
    from test_lora_files import kohya_lora

    _, name = kohya_lora(tmp_path)
    lora = tmp_path / name
    (tmp_path / "cut.safetensors").write_bytes(lora.read_bytes()[:-64])
    refused(flux_run(flux_dir, tmp_path, str(tmp_path / "cut.safetensors")), "outside the file", capsys=capsys)
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    refused(flux_run(flux_dir, tmp_path, str(tmp_path / "huge.safetensors")), "its header claims", capsys=capsys)


def _peft_lora(tmp_path, name, state):
    save_file(state, tmp_path / name)
    return str(tmp_path / name)


def test_lora_keys_shapes_and_values_are_checked_against_the_model(flux_dir, tmp_path, capsys):
    a, b = torch.randn(4, 32) * 0.1, torch.randn(32, 4) * 0.1
    good = "transformer.transformer_blocks.0.attn.to_q"
    cases = [
        ({"transformer.transformer_blocks.0.attn.nope.lora_A.weight": a,
          "transformer.transformer_blocks.0.attn.nope.lora_B.weight": b}, "names no module"),
        ({f"{good}.lora_A.weight": torch.randn(4, 31), f"{good}.lora_B.weight": b}, "shape (4, 31) does not fit"),
        ({f"{good}.lora_A.weight": a, f"{good}.lora_B.weight": torch.full((32, 4), float("nan"))}, "NaN"),
    ]
    for i, (state, fragment) in enumerate(cases):
        refused(flux_run(flux_dir, tmp_path, _peft_lora(tmp_path, f"l{i}.safetensors", state)), fragment,
                capsys=capsys)


def test_a_hub_lora_fails_fast_offline_and_when_the_hub_is_unreachable(flux_dir, tmp_path, capsys, monkeypatch):
    refused(flux_run(flux_dir, tmp_path, "someone/style"), "not in the local Hub cache", capsys=capsys)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("omnispec.spec.hub.hub_unreachable", lambda: "no route to host")
    start = time.perf_counter()
    refused(flux_run(flux_dir, tmp_path, "someone/style"), "unreachable from here (no route to host)", capsys=capsys)
    assert time.perf_counter() - start < 30


# ---- checkpoint folders and init -------------------------------------------------------------------------

@pytest.mark.parametrize("text, fragment", [
    (b"{not json", "not valid JSON"),
    (b"[" * 1000 + b"]" * 1000, "nested deeper than"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"_class_name": 3}', "_class_name"),
    (b'{"_class_name": "FluxPipeline", "vae": ["diffusers", 7]}', "a component entry is [library, class]"),
])
def test_a_bad_model_index_is_one_error_for_init_and_source(flux_dir, tmp_path, capsys, text, fragment):
    copy = tmp_path / "ckpt"
    shutil.copytree(flux_dir, copy)
    (copy / "model_index.json").write_bytes(text)
    refused(["init", str(copy)], "model_index.json", fragment, capsys=capsys)
    refused(["run", "flux1-dev", "--source", str(copy), "--prompt", "x", "--output", str(tmp_path / "x.png")],
            fragment, capsys=capsys)


def test_a_scheduler_config_with_wrong_types_names_the_file_and_key(flux_dir, tmp_path, capsys):
    copy = tmp_path / "ckpt"
    shutil.copytree(flux_dir, copy)
    config = copy / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_shift": "abc"}))
    refused(["explain", "flux1-dev", "--source", str(copy)], "scheduler_config.json", "base_shift", capsys=capsys)


def test_class_names_are_compared_exactly(flux_dir, tmp_path, capsys):
    copy = tmp_path / "ckpt"
    shutil.copytree(flux_dir, copy)
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({**index, "vae": ["diffusers", "AutoencoderTiny"]}))
    refused(["explain", "flux1-dev", "--source", str(copy)], "diffusers.AutoencoderKL",
            "diffusers.AutoencoderTiny", capsys=capsys)


def test_estimate_refuses_a_three_byte_safetensors_file(flux_dir, tmp_path, capsys):
    copy = tmp_path / "ckpt"
    shutil.copytree(flux_dir, copy)
    (copy / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"abc")
    refused(["explain", "flux1-dev", "--source", str(copy), "--estimate", *FLUX], "not a valid safetensors file",
            "3 bytes", capsys=capsys)


# ---- a failing attention backend falls back --------------------------------------------------------------

class _FailingBackward(torch.autograd.Function):
    """SDPA whose backward fails as cuDNN's did on an H200 (forward fine)."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good()")


@pytest.fixture
def failing_backend(monkeypatch):
    """'xformers' replaced by a kernel whose backward fails, usable everywhere with torch's SDPA kernels (the
    packages of the other replacement kernels are not installed here)."""
    from omnispec.policies import attention, attention_fallback, attention_kernels

    monkeypatch.setitem(attention_kernels._REPLACEMENTS, "xformers",
                        lambda q, k, v, scale: _FailingBackward.apply(q, k, v))
    def usable(backend, *args):
        return None if backend in ("sdpa", *attention_kernels.SDPA_KERNELS, "xformers") else "not installed"

    monkeypatch.setattr(attention, "usable", usable)
    monkeypatch.setattr("omnispec.policies.apply.usable", usable)
    monkeypatch.setattr(attention_fallback, "FAILED", {})
    monkeypatch.setattr(attention, "AUTO_CHOICES", {})
    return attention


def _trained_replay(pipe):
    """A rollout and its replay with gradients into a LoRA of the denoiser; the LoRA's gradients."""
    from omnispec.rl import set_lora

    module = pipe.components["transformer"]
    targets = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith("to_q")]
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name in targets:
        layer = module.get_submodule(name)
        state[f"{name}.lora_A.weight"] = torch.randn(2, layer.in_features, generator=gen) * 0.1
        state[f"{name}.lora_B.weight"] = torch.randn(layer.out_features, 2, generator=gen) * 0.1
    set_lora(pipe, "policy", state)
    for p in module.parameters():
        p.requires_grad_(False)
    lora = [p for n, p in module.named_parameters() if "lora_" in n]
    for p in lora:
        p.requires_grad_(True)
    ro = pipe.rollout(["seven"], group_size=2, seed=0, sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0,
                                                                                            "length": 1}})
    replay = pipe.log_prob(ro, grad=True)
    replay.log_probs.sum().backward()
    return ro, replay, [p.grad.clone() for p in lora]


def test_a_backend_failing_its_backward_falls_back_with_one_warning(failing_backend, caplog):
    overrides = ["runtime.progress=false", "recipe.defaults.steps=2", "recipe.phases.0.guidance.terms=[]"]
    plain = omnispec.build(DIGITS, overrides=overrides)
    _, _, expected = _trained_replay(plain)
    pipe = omnispec.build(DIGITS, overrides=[*overrides, "policies.attention.default=xformers"])
    with caplog.at_level("WARNING", logger="omnispec"):
        ro, replay, grads = _trained_replay(pipe)
    warnings = [r for r in caplog.records if "failed for a call" in r.getMessage()]
    assert len(warnings) == 1 and "mha_graph" in warnings[0].getMessage()
    assert torch.equal((replay.log_probs.detach() - ro.log_probs).exp(), torch.ones_like(ro.log_probs))
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-6)


def test_auto_checks_candidates_forward_and_backward_where_a_forward_may_train(failing_backend, monkeypatch):
    monkeypatch.setattr(failing_backend, "_time_backend", _fast_xformers(failing_backend._time_backend))
    args = ("self", ["sdpa", "xformers"], 1, 2, 16, 8, torch.float32, torch.device("cpu"))
    assert failing_backend.choose(*args, train=True) == "sdpa"  # xformers' backward fails in the trial
    assert failing_backend.choose(*args, train=False) == "xformers"  # generation's own choice, forward only


def test_auto_keeps_one_choice_per_attention_shape_whatever_the_batch(failing_backend, monkeypatch):
    """A replay in micro-batches calls attention at other batches than its rollout did: a kernel timed anew for
    them could round otherwise (a batch-1 replay with gradients was 5e-5 off its rollout on an H200)."""
    trials = []

    def timed(backend, q, repeats=5):
        trials.append(q.shape[0])
        return 0.0 if backend == "xformers" else 1.0

    monkeypatch.setattr(failing_backend, "_time_backend", timed)
    rollout = ("self", ["sdpa", "xformers"], 8, 2, 16, 8, torch.float32, torch.device("cpu"))
    assert failing_backend.choose(*rollout, train=True) == "xformers"
    replay = ("self", ["sdpa", "xformers"], 1, 2, 16, 8, torch.float32, torch.device("cpu"))
    assert failing_backend.choose(*replay, train=True) == "xformers"
    assert trials == [8, 8]  # timed once, by the rollout's call


def test_generation_keeps_its_own_auto_choice_and_a_rollout_shares_its_replays(failing_backend, monkeypatch):
    """A rollout runs the kernels its replay with gradients will run: chosen forward and backward, shared by both
    (their log-probs equal), apart from what generation chose by its forward alone ('xformers' wins only there)."""
    from omnispec.policies import attention

    def timed(backend, q, repeats=5):
        return 0.0 if backend == "xformers" and not q.requires_grad else 1.0

    monkeypatch.setattr(attention, "_time_backend", timed)
    overrides = ["runtime.progress=false", "recipe.defaults.steps=2", "recipe.phases.0.guidance.terms=[]"]
    pipe = omnispec.build(DIGITS, overrides=overrides)
    pipe("seven", seed=0)
    ro, replay, grads = _trained_replay(pipe)
    assert {k[-1]: v for k, v in attention.AUTO_CHOICES.items()} == {False: "xformers", True: "sdpa"}
    assert torch.equal(replay.log_probs.detach(), ro.log_probs)
    assert all(g.abs().sum() > 0 for g in grads)


def _fast_xformers(timed):
    def fake(backend, q, repeats=5):
        seconds = timed(backend, q, repeats=1)  # runs (and raises) for real
        return 0.0 if backend == "xformers" else seconds + 1.0

    return fake


# ---- review of #22: bounds, paths, records, images, the terminal -----------------------------------------------

def _flux_copy(flux_dir, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(flux_dir, copy)
    return copy


def _edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_scheduler_asking_for_a_trillion_timesteps_is_refused_by_its_key(flux_dir, tmp_path, capsys):
    copy = _flux_copy(flux_dir, tmp_path)
    _edit_json(copy / "scheduler" / "scheduler_config.json", num_train_timesteps=10**12)
    for argv in (["explain", "flux1-dev", "--source", str(copy)],
                 ["run", "flux1-dev", "--source", str(copy), "--prompt", "x", *FLUX, "--output", str(tmp_path / "x.png")]):
        refused(argv, "scheduler_config.json", "num_train_timesteps", "less than or equal to 100000", capsys=capsys)


def test_a_nan_boundary_in_model_index_is_refused(flux_dir, tmp_path, capsys):
    copy = _flux_copy(flux_dir, tmp_path)
    index = copy / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "boundary_ratio": float("nan")}))  # writes NaN
    refused(["explain", "flux1-dev", "--source", str(copy)], "model_index.json", "boundary_ratio", capsys=capsys)


def _changed_record_png(digits_png, tmp_path, change, name="changed.png"):
    data = record_of(digits_png)
    change(data)
    return write_record_png(tmp_path / name, data)


def test_a_record_naming_an_endless_proc_file_as_its_lora_is_hashed_within_its_size(digits_png, tmp_path, capsys):
    png = _changed_record_png(digits_png, tmp_path, lambda r: r["checkpoint"].update(adapters={"lora_0": {
        "kind": "local", "path": "/proc/self/pagemap", "sha256": "0" * 64}}))
    found = []
    worker = threading.Thread(target=lambda: found.append(records.replay_problems(records.read(png), None)),
                              daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "hashing /proc/self/pagemap did not end"
    assert "has changed since" in str(found[0][0])


def test_a_request_is_at_most_1024_prompts(digits_png, tmp_path, capsys):
    from omnispec.spec.request import resolve_request

    png = _changed_record_png(digits_png, tmp_path, lambda r: r["request"].update(prompts=["7"] * 2000,
                                                                                  seeds=list(range(2000))))
    refused(["run", "--from", str(png), "--output", str(tmp_path / "x.png")], "record.request.prompts",
            "at most 1024", capsys=capsys)
    with pytest.raises(SpecError, match="1,025 prompts, above the limit of 1,024"):
        resolve_request(load_spec(DIGITS), ["7"] * 1025)


def test_recorded_requested_sizes_are_height_and_width_only(digits_png, tmp_path, capsys):
    for key in ("prompt", "seed", "planning"):
        png = _changed_record_png(digits_png, tmp_path, lambda r: r["request"].update(requested={key: 3}))
        refused(["run", "--from", str(png), "--output", str(tmp_path / "x.png")],
                f"record.request.requested.{key}: unknown key", capsys=capsys)
        with pytest.raises(SpecError, match="unknown key"):
            omnispec.replay(png)


@pytest.mark.parametrize("change, fragment", [
    (lambda r: r.update(sample="0"), "record.sample"),
    (lambda r: r["request"].update(seeds=["1"]), "record.request.seeds.0"),
    (lambda r: r["request"].update(steps=2.0), "record.request.steps"),
])
def test_a_record_is_validated_strictly(digits_png, tmp_path, capsys, change, fragment):
    png = _changed_record_png(digits_png, tmp_path, change)
    refused(["run", "--from", str(png), "--output", str(tmp_path / "x.png")], fragment, capsys=capsys)


LONG = "/tmp/" + "n" * 5000  # longer than NAME_MAX: Python 3.11's Path.exists raises for it


@pytest.mark.parametrize("change", [
    lambda r: next(iter(r["checkpoint"]["roots"].values())).update(path=LONG),
    lambda r: r["request"].update(images=[{"frame": 0, "digest": "0" * 32, "path": LONG}]),
    lambda r: r["checkpoint"].update(adapters={"lora_0": {"kind": "local", "path": LONG, "sha256": "0" * 64}}),
])
def test_a_record_naming_a_path_too_long_is_refused(digits_png, tmp_path, capsys, change):
    png = _changed_record_png(digits_png, tmp_path, change)
    refused(["run", "--from", str(png), "--output", str(tmp_path / "x.png")], capsys=capsys)


def test_paths_too_long_on_the_command_line_are_one_error(tmp_path, capsys):
    out = ["--output", str(tmp_path / "x.png")]
    refused(["run", "digits", "--source", LONG, "--prompt", "7", *out], "neither a local directory nor a Hub id",
            capsys=capsys)
    refused(["explain", "digits", "--source", LONG], capsys=capsys)
    refused(["init", LONG], "neither a checkpoint folder nor a Hub id", capsys=capsys)
    refused(["run", "digits", "--prompt", "7", "--lora", LONG, *out], "no such file or folder", capsys=capsys)
    refused(["run", "digits", "--prompt", "7", "--lora", LONG + "@0.5", *out], capsys=capsys)


def test_a_spec_that_is_a_loop_of_links_is_one_error(tmp_path, capsys):
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    for argv in (["validate", str(loop)], ["explain", str(loop)],
                 ["run", str(loop), "--prompt", "x", "--output", str(tmp_path / "x.png")]):
        refused(argv, "loop.yaml", "Symlink loop", capsys=capsys)
    image = tmp_path / "loop.png"
    image.symlink_to(image)
    refused(["explain", str(image)], "loop.png", "symbolic links", capsys=capsys)


def test_control_characters_from_a_record_never_reach_the_terminal(digits_png, tmp_path, capsys):
    png = _changed_record_png(digits_png, tmp_path, lambda r: r.update(device="cpu\x1b[2J\x1b]0;owned\x07"))
    capsys.readouterr()
    assert main(["explain", str(png)]) == 0
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown and "cpu\\x1b[2J" in shown
    png = _changed_record_png(digits_png, tmp_path, lambda r: r["versions"].update(omnispec="9.9\nrm -rf /\x1b[31m"))
    err = refused(["run", "--from", str(png), "--output", str(tmp_path / "x.png")], "9.9\\nrm -rf /\\x1b[31m",
                  capsys=capsys)
    assert err.count("\n") == 1 and "\x1b" not in err


def test_a_png_reads_its_own_record_never_a_json_beside_it(digits_png, tmp_path):
    copy = tmp_path / "d.png"
    shutil.copy(digits_png, copy)
    data = record_of(digits_png)
    data["request"]["prompts"] = ["3"]
    (tmp_path / "d.png.json").write_text(json.dumps(data))
    assert records.read(copy).request.prompts == ["seven"]
    (tmp_path / "d.png.json").unlink()
    os.mkfifo(tmp_path / "d.png.json")
    assert records.read(copy).request.prompts == ["seven"]


def test_a_reference_never_names_a_dunder_module(tmp_path, capsys):
    for ref in ("omnispec.__main__:main", "omnispec:__init__", "diffusers.__main__:X"):
        with pytest.raises(SpecError, match="never names a dunder"):
            load_spec(DIGITS, [f"model.components.transformer.class={ref}"])
    with pytest.raises(SpecError, match="never names a dunder"):
        load_spec(DIGITS, ["model.family=omnispec.__main__:Family"])


def test_a_lora_scale_is_bounded(tmp_path, capsys):
    with pytest.raises(SpecError, match="model.adapters.a.scale"):
        load_spec(DIGITS, ['model.adapters.a={"path": "x.safetensors", "scale": 1e308}'])
    for value in ("x@1e308", "x@nan", "x@inf"):
        refused_by_argparse(["run", "digits", "--prompt", "7", "--lora", value, "--output", "x.png"],
                            "the scale after '@' lies within +-1000", capsys=capsys)


def refused_by_argparse(argv, *fragments, capsys):
    """argparse's own refusal of ``ARGV``: one ``error:`` line and exit 2, no usage block."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "usage:" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_argparse_errors_are_one_error_line(capsys):
    refused_by_argparse(["run", "digits", "--prompt", "7", "--lora", "", "--output", "x.png"],
                        "expected PATH_OR_ID", capsys=capsys)
    refused_by_argparse(["run", "digits", "--steps", "many", "--output", "x.png"], "--steps", "invalid int",
                        capsys=capsys)
    refused_by_argparse(["frobnicate"], "invalid choice", capsys=capsys)
    with pytest.raises(SystemExit) as stopped:
        main(["run", "--help"])
    assert stopped.value.code == 0 and "usage: omnispec run" in capsys.readouterr().out


def test_init_compares_classes_exactly(flux_dir, tmp_path, capsys):
    copy = _flux_copy(flux_dir, tmp_path)
    _edit_json(copy / "model_index.json", vae=["diffusers", "AutoencoderTiny"])
    capsys.readouterr()
    assert main(["init", str(copy)]) == 0
    assert "class: diffusers.AutoencoderTiny" in capsys.readouterr().out


def test_the_pixel_limit_is_4096_squared_and_such_an_image_converts_within_memory(tmp_path):
    assert MAX_IMAGE_PIXELS == 4096 * 4096
    Image.fromarray(np.zeros((4096, 4096, 4), np.uint8)).save(tmp_path / "rgba.png")
    Image.fromarray(np.zeros((4096, 4096), np.uint16)).save(tmp_path / "grey16.png")
    script = ("import sys\nfrom omnispec.spec.images import image_condition\n"
              "for path in sys.argv[1:]:\n    image_condition(path, 0, 'x')\n"
              "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "rgba.png"), str(tmp_path / "grey16.png")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) * 1024 < 1 << 30  # peak resident memory (kB), well under 1.5 GB


@pytest.mark.parametrize("given, fragment", [
    (np.broadcast_to(np.zeros((1, 1, 1, 3), np.float32), (2000, 512, 512, 3)), "2000 images of 512x512"),
    (np.zeros((0, 8, 8, 3), np.float32), "batch is empty"),
    (torch.zeros(0, 3, 8, 8), "batch is empty"),
    (torch.zeros(1, 3, 1, 1).expand(300, 3, 512, 512), "300 images of 512x512"),
    (torch.zeros(3, 8, 8, device="meta"), "meta device"),
    (torch.zeros(3, 8, 8).to_sparse(), "sparse_coo"),
])
def test_an_image_batch_counts_toward_the_pixel_limit_and_holds_an_image(given, fragment):
    start = time.perf_counter()
    with pytest.raises(SpecError, match=fragment):
        image_condition(given, 0, "request.image")
    assert time.perf_counter() - start < 2


def test_exotic_and_wide_image_modes_convert_or_are_refused_clearly():
    grey = lambda condition: condition.image.getpixel((0, 0))  # noqa: E731
    assert grey(image_condition(Image.new("La", (4, 4)), 0, "x")) == WHITE  # transparent: over white
    assert grey(image_condition(Image.fromarray(np.full((4, 4), 0.5, np.float32), "F"), 0, "x")) == (128,) * 3
    assert grey(image_condition(Image.fromarray(np.full((4, 4), 300.0, np.float32), "F"), 0, "x")) == WHITE
    assert grey(image_condition(Image.fromarray(np.full((4, 4), 100, np.int32)), 0, "x")) == (100,) * 3
    for values in (np.full((4, 4), 1 << 20, np.int32), np.full((4, 4), -5, np.int32)):
        with pytest.raises(SpecError, match="8-bit .0..255. and 16-bit .0..65535. ranges"):
            image_condition(Image.fromarray(values), 0, "x")
    with pytest.raises(SpecError, match="NaN or infinite"):
        image_condition(Image.fromarray(np.full((4, 4), np.nan, np.float32), "F"), 0, "x")


@pytest.mark.parametrize("args, kwargs, error, fragment", [
    (("a\0b.png",), {}, SpecError, "NUL"),
    ((5,), {}, TypeError, "path: expected a file path"),
    ((b"x.png",), {}, TypeError, "path: expected a file path"),
    (("x.png",), {"allow_version_drift": "yes"}, TypeError, "allow_version_drift: expected True or False"),
    (("x.png",), {"trust_code": 1}, TypeError, "trust_code: expected True or False"),
])
def test_replay_arguments_are_checked(args, kwargs, error, fragment):
    with pytest.raises(error, match=fragment) as caught:
        omnispec.replay(*args, **kwargs)
    assert isinstance(caught.value, SpecError)


# ---- review of #22: files the libraries read themselves, model construction, weights, LoRA ------------------------

def _digits_run(folder, tmp_path):
    return ["run", "digits", "--source", str(folder), "--prompt", "7", *FAST, "--output", str(tmp_path / "x.png")]


@pytest.fixture
def few_modules(monkeypatch):
    """A module limit the digits model passes and a config of 100,000 layers does not, quickly."""
    monkeypatch.setattr("omnispec.runtime.components.MAX_MODULES", 2_000)


def test_a_config_describing_a_hundred_thousand_layers_is_refused_while_built(digits_copy, tmp_path, capsys,
                                                                            few_modules):
    _edit_json(digits_copy / "transformer" / "config.json", depth=100_000)
    start = time.perf_counter()
    refused(_digits_run(digits_copy, tmp_path), "transformer/config.json", "more than 2,000 modules", capsys=capsys)
    refused(["explain", "digits", "--source", str(digits_copy), "--estimate"], "more than 2,000 modules",
            capsys=capsys)
    assert time.perf_counter() - start < 30


def test_a_record_whose_component_config_describes_a_huge_model_is_refused(digits_png, tmp_path, capsys,
                                                                           few_modules):
    png = _changed_record_png(digits_png, tmp_path, lambda r: r["spec"]["model"]["components"]["transformer"].update(
        config={"depth": 100_000}))
    refused(["run", "--from", str(png), "--output", str(tmp_path / "x.png")], "with the spec's config entries",
            "more than 2,000 modules", capsys=capsys)


@pytest.mark.parametrize("folder, name", [
    ("transformer", "config.json"),
    ("text_encoder", "config.json"),
    ("tokenizer", "tokenizer_config.json"),
    ("tokenizer", "special_tokens_map.json"),
    ("tokenizer", "tokenizer.json"),
])
def test_json_the_loaders_read_themselves_is_bounded_first(digits_copy, tmp_path, capsys, folder, name):
    (digits_copy / folder / name).write_text("[" * 100_000 + "]" * 100_000)
    refused(_digits_run(digits_copy, tmp_path), f"{folder}/{name}", "nested deeper than", capsys=capsys)


def test_a_config_json_that_is_a_fifo_is_refused_unopened(digits_copy, tmp_path, capsys):
    config = digits_copy / "text_encoder" / "config.json"
    config.unlink()
    os.mkfifo(config)
    refused(_digits_run(digits_copy, tmp_path), "config.json is a FIFO", capsys=capsys)


@pytest.mark.parametrize("index, fragment", [
    ("[" * 100_000, "nested deeper than"),
    ('{"weight_map": [1, 2]}', "weight_map is not a mapping"),
    ('{"weight_map": {"w": "../../elsewhere.safetensors"}}', "weight_map is not a mapping"),
])
def test_a_bad_weights_index_is_refused_by_name(flux_dir, tmp_path, capsys, index, fragment):
    copy = _flux_copy(flux_dir, tmp_path)
    (copy / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(index)
    refused(["run", "flux1-dev", "--source", str(copy), "--prompt", "x", *FLUX, "--output", str(tmp_path / "x.png")],
            "diffusion_pytorch_model.safetensors.index.json", fragment, capsys=capsys)


def _safetensors(path, header, data=b""):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("make, fragment", [
    (lambda p: p.write_bytes(struct.pack("<Q", 5) + b"\xef\xbb\xbf{}" + b""), "does not start with '{'"),
    (lambda p: _safetensors(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
     "4 bytes after the last tensor"),
    (lambda p: _safetensors(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12),
     "leave a gap"),
    (lambda p: _safetensors(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
     "overlap"),
    (lambda p: _safetensors(p, {"a": {"dtype": "F4", "shape": [4, 32], "data_offsets": [0, 0]}}),
     "0 bytes for shape [4, 32] of F4 (64 expected)"),
    (lambda p: _safetensors(p, {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, b"\0"),
     "12 bits, not a whole number of bytes"),
])
def test_safetensors_headers_are_read_as_strictly_as_the_library_reads_them(tmp_path, make, fragment):
    from safetensors import safe_open

    from omnispec.spec.files import safetensors_header

    path = tmp_path / "w.safetensors"
    make(path)
    with pytest.raises(SpecError, match=re.escape(fragment)):
        safetensors_header(path)
    with pytest.raises(Exception):  # noqa: B017 - what the library says of the same file
        with safe_open(str(path), "pt") as f:
            [f.get_tensor(k) for k in f.keys()]


def test_a_text_encoder_with_trailing_bytes_is_refused_before_transformers_reads_it(flux_dir, tmp_path, capsys):
    copy = _flux_copy(flux_dir, tmp_path)
    weights = copy / "text_encoder" / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"\0" * 16)
    refused(["run", "flux1-dev", "--source", str(copy), "--prompt", "x", *FLUX, "--output", str(tmp_path / "x.png")],
            "text_encoder/model.safetensors", "16 bytes after the last tensor", capsys=capsys)


def _rewrite_weights(path, change):
    from safetensors.torch import load_file

    state = load_file(path)
    change(state)
    save_file(state, path)


@pytest.mark.parametrize("change, fragment", [
    (lambda s: s.pop("proj_out.weight"), "lacks 1 weight(s) the model has: proj_out.weight"),
    (lambda s: s.update(extra=torch.zeros(2)), "holds 1 weight(s) the model has no place for: extra"),
    (lambda s: s["proj_out.weight"].fill_(float("nan")), "proj_out.weight hold NaN or infinite values"),
])
def test_weights_that_do_not_make_the_model_are_refused(digits_copy, tmp_path, capsys, change, fragment):
    _rewrite_weights(digits_copy / "transformer" / "diffusion_pytorch_model.safetensors", change)
    refused(_digits_run(digits_copy, tmp_path), "component 'transformer'", fragment, capsys=capsys)


def test_a_transformers_component_without_its_weights_is_refused_not_randomly_initialised(flux_dir, tmp_path,
                                                                                           capsys):
    copy = _flux_copy(flux_dir, tmp_path)
    save_file({}, copy / "text_encoder" / "model.safetensors")
    refused(["run", "flux1-dev", "--source", str(copy), "--prompt", "x", *FLUX, "--output", str(tmp_path / "x.png")],
            "component 'text_encoder'", "lacks", capsys=capsys)
    assert not (tmp_path / "x.png").exists()


def test_estimate_builds_an_auto_class_from_its_config(flux_dir, capsys):
    capsys.readouterr()
    environment = dict(os.environ)
    try:
        assert main(["-q", "explain", "flux1-dev", "--source", str(flux_dir), *FLUX, "--estimate",
                     "--set", "model.components.text_encoder.class=transformers.AutoModel",
                     "--set", "model.check_checkpoint=false"]) == 0
    finally:  # -q sets the libraries' verbosity and progress bars for the process: the later tests' processes inherit
        os.environ.clear()
        os.environ.update(environment)
    assert "text_encoder" in capsys.readouterr().out


def _lora_case(name):
    from test_lora_files import HIDDEN, RANK

    good = "transformer.transformer_blocks.0.attn.to_q"
    a, b = torch.randn(RANK, HIDDEN) * 0.1, torch.randn(HIDDEN, RANK) * 0.1
    return {
        "unmatched": ({"hello.weight": a, "world": b}, "hello.weight: not a LoRA weight"),
        "good plus bogus": ({f"{good}.lora_A.weight": a, f"{good}.lora_B.weight": b, "transformer.bogus.key": b.clone()},
                            "transformer.bogus.key: not a LoRA weight"),
        "text encoder only": ({"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.randn(RANK, 8),
                               "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.randn(8, RANK)},
                              "no LoRA weights for this model"),
        "int64": ({f"{good}.lora_A.weight": a.long(), f"{good}.lora_B.weight": b.long()},
                  "holds int64 values; LoRA weights are floating point"),
        "fp8 nan": ({f"{good}.lora_A.weight": a.to(torch.float8_e4m3fn),
                     f"{good}.lora_B.weight": torch.full((HIDDEN, RANK), float("nan")).to(torch.float8_e4m3fn)},
                    "holds NaN or infinite values"),
        "kohya bad shape": ({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.randn(RANK, HIDDEN),
                             "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.randn(3 * HIDDEN - 1, RANK),
                             "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(2.0)},
                            "cannot read LoRA"),
    }[name]


@pytest.mark.parametrize("name", ["unmatched", "good plus bogus", "text encoder only", "int64", "fp8 nan",
                                  "kohya bad shape"])
def test_a_lora_whose_keys_or_values_are_not_lora_weights_is_refused(flux_dir, tmp_path, capsys, name):
    state, fragment = _lora_case(name)
    refused(flux_run(flux_dir, tmp_path, _peft_lora(tmp_path, "l.safetensors", state)), fragment, capsys=capsys)
