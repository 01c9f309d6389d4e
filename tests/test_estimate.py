"""``omnispec explain --estimate``: parameter bytes from safetensors headers (no weights loaded), FLOPs counted on the
meta device equal to a real forward's, peak memory by offload policy, a time per step from a device kind's published peaks."""

import time

import numpy as np
import pytest
import torch

import omnispec
from omnispec.cli import main
from omnispec.estimate import estimate
from omnispec.estimate.devices import device_kind
from omnispec.spec.files import safetensors_header
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS

FLUX = [*TINY_OVERRIDES["flux"], "recipe.defaults.height=64", "recipe.defaults.width=64"]


@pytest.fixture(scope="module")
def flux_estimate(flux_dir):
    return estimate(omnispec.load_spec(SPECS / "flux1-dev.yaml", FLUX), source=str(flux_dir), kind="cpu")


@pytest.fixture(scope="module")
def flux_pipe(flux_dir):
    return omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=FLUX)


def _bytes(module):
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def test_header_is_read_without_the_weights(flux_dir):
    header = safetensors_header(flux_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    entry = header.tensors["x_embedder.weight"]
    assert (entry.dtype, entry.shape) == ("F32", (32, 16))


def test_component_bytes_equal_the_loaded_modules(flux_estimate, flux_pipe):
    loaded = {name: _bytes(m) for name, m in flux_pipe.components.items() if isinstance(m, torch.nn.Module)}
    assert {c.name: c.bytes for c in flux_estimate.components} == loaded
    assert all(c.how == "safetensors header" for c in flux_estimate.components)


def test_no_weight_is_loaded(flux_dir, monkeypatch):
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors.torch, "safe_open", refuse, raising=False)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    e = estimate(omnispec.load_spec(SPECS / "flux1-dev.yaml", FLUX), source=str(flux_dir), kind="cpu")
    assert e.forward_flops > 0


def test_quantized_linear_weights_count_one_byte_and_their_scales(flux_dir, flux_pipe):
    quantized = "policies.quantization={transformer: {method: int8_weight_only, exclude: [proj_out]}}"
    spec = omnispec.load_spec(SPECS / "flux1-dev.yaml", [*FLUX, quantized])
    e = estimate(spec, source=str(flux_dir), kind="cpu")
    transformer = flux_pipe.components["transformer"]
    linear = {f"{n}.weight": m.weight for n, m in transformer.named_modules()
              if isinstance(m, torch.nn.Linear) and "proj_out." not in f"{n}."}
    expected = sum(w.numel() + 4 * w.shape[0] for w in linear.values())
    expected += sum(t.numel() * 4 for n, t in transformer.state_dict().items() if n not in linear)
    assert next(c for c in e.components if c.name == "transformer").bytes == expected


def test_flops_counted_on_meta_equal_a_real_forward(flux_estimate, flux_pipe):
    """torch's FlopCounterMode on a real CPU forward counts the matmuls (it has no CPU attention formula): the meta
    count's matmuls equal it, and its attention is 4 B H Lq Lk D per call."""
    from torch.utils.flop_counter import FlopCounterMode

    family = flux_pipe.family
    request = flux_pipe.request("a photo of a cat", seed=0)
    geometry = family.geometry(request, 1.0)
    latents = family.initial_latents(geometry, [torch.Generator().manual_seed(0)])
    cond = family.encode(list(request.prompts), request)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        family.predict(flux_pipe.components["transformer"], latents, torch.tensor(500.0), cond, geometry, embedded=3.5)
    matmuls = sum(op.flops * op.calls for op in flux_estimate.ops if op.op != "sdpa")
    assert matmuls == counter.get_total_flops()
    tokens = 256 + 16  # (64 / 2 / 2)^2 image tokens + max_sequence_length text tokens
    attention = [op for op in flux_estimate.ops if op.op == "sdpa"]
    assert sum(op.calls for op in attention) == 2  # one joint block, one single block
    assert all(op.flops == 4 * 2 * tokens * tokens * 16 for op in attention)


def test_meta_run_sees_the_tensors_a_real_run_makes(flux_estimate, flux_pipe):
    """The peak of live tensors in the meta forward equals the same count over a real CPU forward, and the peak is
    the largest stage's weights plus activations."""
    from omnispec.estimate import Shadow, counting

    family = flux_pipe.family
    request = flux_pipe.request("a photo of a cat", seed=0)
    geometry = family.geometry(request, 1.0)
    latents = family.initial_latents(geometry, [torch.Generator().manual_seed(0)])
    cond = family.encode(list(request.prompts), request)
    with counting(Shadow(), device_type="cpu") as counter:
        x = {s: torch.cat([v]) for s, v in latents.items()}
        family.predict(flux_pipe.components["transformer"], x, torch.full((), 500.0), cond, geometry, embedded=3.5)
    assert flux_estimate.activation_bytes["denoise"] == counter.peak
    assert flux_estimate.peak_bytes == max(flux_estimate.weights_on_device[s] + flux_estimate.activation_bytes[s]
                                           for s in ("encode", "denoise", "decode"))


def test_offload_keeps_less_on_the_device(flux_dir, flux_estimate):
    def peak(strategy):
        spec = omnispec.load_spec(SPECS / "flux1-dev.yaml", [*FLUX, f"policies.offload={{strategy: {strategy}}}"])
        return estimate(spec, source=str(flux_dir), kind="cpu")

    model, layerwise = peak("model"), peak("layerwise")
    weights = {c.name: c.bytes for c in flux_estimate.components}
    assert flux_estimate.weights_on_device["denoise"] == sum(weights.values())
    assert model.weights_on_device == {"encode": weights["text_encoder"] + weights["text_encoder_2"],
                                       "denoise": weights["transformer"], "decode": weights["vae"]}
    transformer = next(c for c in layerwise.components if c.name == "transformer")
    streamed = sum(transformer.blocks.values())
    assert layerwise.weights_on_device["decode"] == sum(weights.values()) - streamed
    assert layerwise.weights_on_device["denoise"] == sum(weights.values()) - streamed + max(transformer.blocks.values())
    # the host memory each strategy keeps the weights in: every moved component, or the streamed blocks
    assert flux_estimate.host_bytes == 0
    assert model.host_bytes == sum(weights.values())  # encoders, the denoiser and the VAE all take turns
    assert layerwise.host_bytes == streamed
    from omnispec.estimate import render_estimate

    assert "host memory for offloaded weights" in render_estimate(model)


def test_the_modulation_table_counts_in_the_denoise_stage(flux_dir, flux_estimate, flux_pipe):
    """``precomputed_modulation``: the table a real run keeps (3 steps, one pass: 3 rows padded to 8, its outputs
    over the four modulation linears and its embeddings) is added to the denoise stage and noted."""
    spec = omnispec.load_spec(SPECS / "flux1-dev.yaml", [*FLUX, "policies.mlp.precomputed_modulation=true"])
    tabled = estimate(spec, source=str(flux_dir), kind="cpu")
    transformer = flux_pipe.components["transformer"]
    names = ("norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear")
    linears = [m for n, m in transformer.named_modules() if n.endswith(names)]
    expected = 8 * 4 * (sum(m.out_features for m in linears) + transformer.inner_dim)  # float32
    extra = tabled.activation_bytes["denoise"] - flux_estimate.activation_bytes["denoise"]
    assert extra == expected
    assert any(note.startswith("modulation table: at most") for note in tabled.notes)


def test_time_per_step_comes_from_a_device_kinds_published_peaks(flux_dir, flux_estimate):
    """A GPU kind is timed from its published figures: the same count gives each kind's time from its peak for the
    dtype, its bandwidth and its launch cost; a compiled forward reaches a larger share of the peak and has no launches to pay."""
    from omnispec.estimate import devices

    e = flux_estimate  # on this machine's CPU, whose thread that dispatches an op also runs it: the two add up
    assert e.step_seconds == pytest.approx(e.compute_seconds + e.memory_seconds + e.overhead_seconds)
    spec = omnispec.load_spec(SPECS / "flux1-dev.yaml", [*FLUX, "model.dtype=bfloat16"])
    h200, a100 = (estimate(spec, source=str(flux_dir), kind=kind) for kind in ("h200", "a100"))
    assert h200.compute_seconds == pytest.approx(h200.forward_flops / (989e12 * devices.EAGER_SHARE))
    assert a100.compute_seconds == pytest.approx(h200.compute_seconds * 989 / 312)
    assert h200.memory_seconds == pytest.approx(h200.moved_bytes / (4.8e12 * devices.BANDWIDTH_SHARE))
    # a GPU's queue overlaps the host's launches with the kernels before them: the slower sets the pace
    assert h200.step_seconds == pytest.approx(max(h200.compute_seconds + h200.memory_seconds, h200.overhead_seconds))
    compiled = estimate(omnispec.load_spec(SPECS / "flux1-dev.yaml", [*FLUX, "model.dtype=bfloat16",
                                                                     "policies.compile.mode=regional"]),
                        source=str(flux_dir), kind="h200")
    assert compiled.compute_seconds == pytest.approx(h200.compute_seconds * devices.EAGER_SHARE / devices.COMPILED_SHARE)
    assert compiled.overhead_seconds == 0.0 and "989 TFLOP/s bfloat16" in compiled.timed_for


def test_the_cli_estimate_answers_in_seconds(flux_dir, capsys):
    sets = [a for o in TINY_OVERRIDES["flux"] for a in ("--set", o) if "height" not in o and "width" not in o]
    start = time.perf_counter()
    assert main(["explain", "flux1-dev", "--source", str(flux_dir), "--estimate", "--device-kind", "h200",
                 *sets]) == 0  # at 1024x1024: 65,536 image tokens
    assert time.perf_counter() - start < 30
    out = capsys.readouterr()
    assert "on NVIDIA H200" in out.out and "loaded" not in out.err
    assert main(["explain", "flux1-dev", "--estimate", "--device-kind", "tpu"]) == 2


@pytest.mark.parametrize("spec, fixture, overrides", [
    ("wan2.1-t2v-1.3b.yaml", "wan_dir", TINY_OVERRIDES["wan"]),
    ("sd3.5-medium.yaml", "sd3_dir", TINY_OVERRIDES["sd3"]),
    ("ltx2-t2v.yaml", "ltx2_dir", TINY_OVERRIDES["ltx2"]),
    ("digits.yaml", None, ["runtime.progress=false"]),
    # tasks whose requests need more than an image: grey stand-ins of the default size (a mask, a video)
    ("flux1-fill-dev.yaml", "flux_fill_dir", [*TINY_OVERRIDES["flux"], "recipe.defaults.height=32",
                                              "recipe.defaults.width=32"]),
    ("wan2.1-vace-1.3b-v2v.yaml", "wan_vace_dir", [*TINY_OVERRIDES["wan"], "recipe.defaults.frames=9"]),
])
def test_each_family_is_counted_on_meta(spec, fixture, overrides, request):
    source = str(request.getfixturevalue(fixture)) if fixture else None
    e = estimate(omnispec.load_spec(SPECS / spec, overrides), source=source, kind="cpu")
    assert e.forward_flops > 0 and e.activation_bytes["denoise"] > 0, e.notes
    assert e.step_flops == e.forward_flops * e.passes / e.rows_per_forward


def test_cli_explain_estimate_prints_and_dumps_json(flux_dir, capsys):
    sets = [a for o in FLUX for a in ("--set", o)]
    assert main(["explain", str(SPECS / "flux1-dev.yaml"), "--source", str(flux_dir), "--estimate", *sets]) == 0
    text = capsys.readouterr().out
    here = device_kind(None).name  # this machine's: the CPU, or a known GPU where CUDA is
    assert f"estimate for {here}" in text and "peak device memory" in text and "time per step" in text
    assert main(["explain", str(SPECS / "flux1-dev.yaml"), "--source", str(flux_dir), "--estimate", "--json",
                 *sets]) == 0
    import json

    info = json.loads(capsys.readouterr().out)
    assert info["estimate"]["forward_flops"] > 0 and np.isfinite(info["estimate"]["step_seconds"])


def test_estimate_needs_a_checkpoint_on_disk(capsys):
    assert main(["explain", "flux1-dev", "--estimate"]) == 2
    assert "--source" in capsys.readouterr().err


def test_the_cpu_kind_is_measured_once_per_thread_count():
    """A CPU's cost of an op and matmul rate are measured here (no published figure predicts eager torch on it), once
    for each thread count torch runs with."""
    import torch

    from omnispec.estimate import calibrate

    threads = torch.get_num_threads()
    first = calibrate.cpu_kind(1)
    assert first is calibrate.cpu_kind(1)  # measured once
    assert 1e-7 < first.launch_seconds < 1e-3 and 1e-4 < first.tflops["float32"] < 100
    assert not first.overlaps and first.host_link is None and "at 1 torch thread(s)" in first.basis
    assert calibrate.cpu_kind(2) is not first and "at 2 torch thread(s)" in calibrate.cpu_kind(2).basis
    assert torch.get_num_threads() == threads  # measured at the count asked for, then put back
