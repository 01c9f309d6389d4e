"""Scale-out policies: the spec's rules (one process), VAE tiling and slicing against diffusers' own switches, and
tensor / shard / distributed offload / vae_patch runs on gloo ranks against one process (tests/scale_worker.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import omnispec
from omnispec.spec import SpecError, load_spec
from omnispec.testing import TINY_OVERRIDES

from conftest import ROOT, SPECS, cpu_env
from preloaded import free_port

TOL = 1e-4
REGIONAL = "policies.compile.mode=regional"


# ---- the spec's rules ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("sets, where, says", [
    (["policies.parallel.tensor=2", "policies.offload.strategy=model"], "policies.parallel.tensor", "offload"),
    (["policies.parallel.tensor=2", "policies.quantization={denoiser: {method: int8_weight_only}}"],
     "policies.parallel.tensor", "quantized denoiser"),
    (["policies.parallel.tensor=2", "policies.parallel.shard=2"], "policies.parallel.tensor", "2-D FSDP"),
    (["policies.parallel.shard=2", "policies.offload.strategy=layerwise"], "policies.offload.strategy",
     "distributed: true"),
    (["policies.offload={strategy: layerwise, distributed: true}"], "policies.offload.distributed",
     "policies.parallel.shard"),
    (["policies.parallel.shard=2", "policies.compile.mode=full"], "policies.compile.mode", "regional"),
    # FSDP2's gathered weights land at new addresses each call (benchmarks/gpu_shard_graphs.py)
    (["policies.parallel.shard=2", "policies.compile={mode: regional, cudagraphs: true}"],
     "policies.compile.cudagraphs", "recorded again at every call"),
    (["policies.parallel.vae_patch=2", "policies.parallel.cfg=2"], "policies.parallel.vae_patch",
     "policies.vae.tiling"),
    (["policies.parallel.vae_patch=2", "policies.vae.tiling=true"], "policies.parallel.vae_patch",
     "cfg x tensor x ring x ulysses = 1"),
    (["policies.vae.tiling={tile: 16, overlap: 16}"], "policies.vae.tiling", "smaller than tile"),
])
def test_scale_out_rules_name_the_field_and_the_reason(sets, where, says):
    with pytest.raises(SpecError) as err:
        load_spec(SPECS / "flux1-dev.yaml", overrides=sets)
    assert where in str(err.value) and says in str(err.value)


def test_a_full_graph_of_each_block_is_refused_with_hooked_offload_and_taken_with_distributed_offload():
    """diffusers' layerwise offload onloads from hooks the compiler cannot trace; distributed offload's onload is
    FSDP2's all-gather, which compiles with the block (the compiled cases of ``two_ranks``)."""
    with pytest.raises(SpecError, match=r"policies.compile.fullgraph: layerwise offload .* onloads each block"):
        load_spec(SPECS / "flux1-dev.yaml", overrides=["policies.offload.strategy=layerwise", REGIONAL])
    spec = load_spec(SPECS / "flux1-dev.yaml", overrides=[
        "policies.parallel.shard=2", "policies.offload={strategy: layerwise, distributed: true}", REGIONAL])
    assert spec.policies.compile.fullgraph


def test_world_size_counts_mesh_axes_and_not_vae_patch():
    spec = load_spec(SPECS / "flux1-dev.yaml", overrides=[
        "policies.parallel.shard=2", "policies.parallel.ulysses=2", "policies.parallel.vae_patch=2",
        "policies.vae.tiling=true"])
    assert spec.policies.parallel.world_size == 4


def test_families_without_a_tensor_plan_are_refused_before_loading():
    with pytest.raises(SpecError, match="cannot run tensor parallel: no tensor-parallel plan"):
        omnispec.build(SPECS / "sd3.5-medium.yaml", overrides=["policies.parallel.tensor=2"])


# ---- VAE tiling and slicing equal diffusers' own switches ---------------------------------------------------

def _flux_reference(flux_dir, prompts, size, tiling=None, slicing=False):
    from diffusers import FluxPipeline

    ref = FluxPipeline.from_pretrained(str(flux_dir), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    if tiling:
        ref.vae.enable_tiling()
        ref.vae.tile_sample_min_size, ref.vae.tile_latent_min_size, ref.vae.tile_overlap_factor = tiling
    if slicing:
        ref.vae.enable_slicing()
    gens = [torch.Generator("cpu").manual_seed(7 + i) for i in range(len(prompts))]
    return ref(prompt=prompts, height=size, width=size, num_inference_steps=3, guidance_scale=3.5,
               max_sequence_length=16, generator=gens, output_type="np").images


@pytest.mark.parametrize("tiling, diffusers_tiles", [
    ("{tile: 32, overlap: 8}", (32, 16, 0.25)),  # the tiny VAE downsamples by 2
    ("true", None),  # its own defaults: sample_size 32 of the config
])
def test_flux_vae_tiling_equals_diffusers_enable_tiling(flux_dir, tiling, diffusers_tiles):
    sets = [*TINY_OVERRIDES["flux"], "recipe.defaults.height=64", "recipe.defaults.width=64",
            f"policies.vae.tiling={tiling}"]
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=sets)
    ours = pipe(["a cat"], seed=7)
    if diffusers_tiles is None:
        vae = pipe.components["vae"]
        diffusers_tiles = (vae.tile_sample_min_size, vae.tile_latent_min_size, vae.tile_overlap_factor)
    ref = _flux_reference(flux_dir, ["a cat"], 64, tiling=diffusers_tiles)
    untiled = _flux_reference(flux_dir, ["a cat"], 64)
    assert np.abs(ours.array - ref).max() <= TOL
    assert np.abs(ref - untiled).max() > 1e-3  # the size tiles: the tiled decode is a different computation
    assert "tiled" in pipe.policies.notes["vae"]


def test_flux_vae_slicing_equals_diffusers_enable_slicing(flux_dir):
    sets = [*TINY_OVERRIDES["flux"], "policies.vae.slicing=true"]
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=sets)
    ours = pipe(["a cat", "a dog"], seed=[7, 8])
    ref = _flux_reference(flux_dir, ["a cat", "a dog"], 32, slicing=True)
    assert np.abs(ours.array - ref).max() <= TOL


def test_a_decode_out_of_device_memory_over_several_samples_runs_again_sliced(flux_dir, monkeypatch, caplog):
    """The VAE "runs out of memory" whenever it decodes more than one sample at once: the batch is decoded again one
    sample at a time, equal to diffusers' sliced decode, and the VAE decodes whole again after; one sample that runs
    out has nothing to slice, and the error stands."""
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=TINY_OVERRIDES["flux"])
    vae = pipe.components["vae"]
    real = vae._decode

    def tight(z, *args, **kwargs):
        if z.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.09 GiB")
        return real(z, *args, **kwargs)

    monkeypatch.setattr(vae, "_decode", tight)
    ours = pipe(["a cat", "a dog"], seed=[7, 8])
    ref = _flux_reference(flux_dir, ["a cat", "a dog"], 32, slicing=True)
    assert np.abs(ours.array - ref).max() <= TOL
    assert not vae.use_slicing and "one at a time" in caplog.text
    monkeypatch.setattr(vae, "_decode", lambda z, *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA oom")))
    with pytest.raises(torch.OutOfMemoryError):
        pipe("a cat", seed=7)


def test_wan_vae_tiling_equals_diffusers_enable_tiling(wan_dir):
    from diffusers import WanPipeline

    sets = [*TINY_OVERRIDES["wan"], "recipe.defaults.height=48", "recipe.defaults.width=48",
            "policies.vae.tiling={tile: 32, overlap: 16}"]
    pipe = omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(wan_dir), overrides=sets)
    ours = pipe("a cat", seed=2)
    ref = WanPipeline.from_pretrained(str(wan_dir), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    ref.vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                          tile_sample_stride_width=16)
    spec = pipe.spec.recipe.phases[0].guidance.terms[0]
    expected = ref(prompt="a cat", negative_prompt="", height=48, width=48, num_frames=5, num_inference_steps=4,
                   guidance_scale=spec.scale, max_sequence_length=16, generator=torch.Generator("cpu").manual_seed(2),
                   output_type="np").frames
    assert np.abs(ours.array - expected).max() <= TOL


def test_tiling_a_vae_diffusers_cannot_tile_is_refused():
    with pytest.raises(SpecError, match="no VAE here tiles"):
        omnispec.build("digits", overrides=["policies.vae.tiling=true", "runtime.progress=false"])


# ---- ranks on gloo against one process ----------------------------------------------------------------------

def _launch(nproc: int, cases: dict, timeout: float = 900) -> list[dict]:
    env = cpu_env(ROOT / "tests", OMP_NUM_THREADS="1")
    for _ in range(2):  # a port free when chosen can be taken before torchrun binds it: then once more
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                               "--master-port", str(free_port()), str(ROOT / "tests" / "scale_worker.py"),
                               str(SPECS), json.dumps(cases)], capture_output=True, text=True, env=env,
                              timeout=timeout)
        if "address already in use" not in done.stderr.lower():
            break
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[0][len("RESULTS "):])


def _check(ranks: list[dict], name: str) -> dict:
    for rank, results in enumerate(ranks):
        got = results[name]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        assert got["image"] <= TOL and got["latents"] <= TOL, (name, rank, got)
    return ranks[0][name]


@pytest.fixture(scope="module")
def two_ranks(flux_dir, wan_dir, ltx20_dir):
    offload = "policies.offload={strategy: layerwise, distributed: true}"
    cases = {
        "tensor2-flux": ["flux", str(flux_dir), ["policies.parallel.tensor=2"], 2],
        "tensor2-wan": ["wan", str(wan_dir), ["policies.parallel.tensor=2"], 2],
        "tensor2-ltx2": ["ltx2", str(ltx20_dir), ["policies.parallel.tensor=2"], 2],  # video and audio, with STG
        "shard2-flux": ["flux", str(flux_dir), ["policies.parallel.shard=2"], 3],  # uneven: 2 + 1
        "shard2-wan": ["wan", str(wan_dir), ["policies.parallel.shard=2"], 1],  # rank 1 runs a padding copy
        "offload2-flux": ["flux", str(flux_dir), ["policies.parallel.shard=2", offload], 2],
        "offload2-wan": ["wan", str(wan_dir), ["policies.parallel.shard=2", offload], 2],
        "vae_patch2-flux": ["flux", str(flux_dir), ["policies.parallel.cfg=2", "policies.parallel.vae_patch=2"], 2],
        "vae_patch2-wan": ["wan", str(wan_dir), ["policies.parallel.cfg=2", "policies.parallel.vae_patch=2"], 1],
        # last: compiled blocks (their compiled code stays cached in the worker for the cases after them)
        "tensor2-compiled-wan": ["wan", str(wan_dir), ["policies.parallel.tensor=2", REGIONAL], 2],
        "shard2-compiled-flux": ["flux", str(flux_dir), ["policies.parallel.shard=2", REGIONAL], 3],
        "offload2-compiled-flux": ["flux", str(flux_dir), ["policies.parallel.shard=2", offload, REGIONAL], 2],
        "ulysses2-compiled-wan": ["wan", str(wan_dir), ["policies.parallel.ulysses=2", REGIONAL], 1],
        "ring2-compiled-wan": ["wan", str(wan_dir), ["policies.parallel.ring=2", REGIONAL], 1],
    }
    return _launch(2, cases)


@pytest.mark.parametrize("name", ["tensor2-flux", "tensor2-wan", "tensor2-ltx2"])
def test_tensor_2_equals_one_process_and_splits_the_blocks(two_ranks, name):
    got = _check(two_ranks, name)
    assert got["bytes"]["cpu"] < got["whole"]["cpu"]  # embedders and modulation stay whole on every rank


@pytest.mark.parametrize("name", ["shard2-flux", "shard2-wan", "offload2-flux", "offload2-wan"])
def test_shard_2_equals_one_process_and_holds_half_the_weights(two_ranks, name):
    got = _check(two_ranks, name)
    parameters_only = got["whole"]["cpu"]
    assert got["bytes"]["cpu"] <= 0.55 * parameters_only  # half, plus the replicated buffers (RoPE tables)


@pytest.mark.parametrize("name", ["tensor2-compiled-wan", "shard2-compiled-flux", "offload2-compiled-flux",
                                  "ulysses2-compiled-wan", "ring2-compiled-wan"])
def test_compiled_blocks_under_the_parallel_axes_equal_one_process(two_ranks, name):
    """``compile: regional`` is what tensor and shard take (``full`` is refused), each block a full graph. Wan's
    split q/k norms all-reduce inside its compiled blocks; the blocks FSDP2 shards get a class of its own, which
    diffusers' ``compile_repeated_blocks`` looks for by name and would not find (it raised, naming the block
    classes); with distributed offload FSDP2's hooks also bring each block's shard from host memory. Under ulysses
    and ring diffusers splits Wan's sequence in a hook on its first block, which dynamo cannot trace (that block
    compiles with graph breaks; a full graph failed at the first call)."""
    got = _check(two_ranks, name)
    assert got["compiled_blocks"] == 2  # each of the tiny model's two blocks


@pytest.mark.parametrize("name", ["vae_patch2-flux", "vae_patch2-wan"])
def test_vae_patch_2_equals_one_process_tiled_decode(two_ranks, name):
    _check(two_ranks, name)


def test_shard_2_with_ulysses_2_on_four_ranks_equals_one_process(flux_dir, wan_dir):
    ranks = _launch(4, {
        "flux": ["flux", str(flux_dir), ["policies.parallel.shard=2", "policies.parallel.ulysses=2"], 2],
        "wan": ["wan", str(wan_dir), ["policies.parallel.shard=2", "policies.parallel.ulysses=2"], 3],
    })
    for name in ("flux", "wan"):
        _check(ranks, name)


@pytest.mark.parametrize("name, family, sets", [
    ("tensor2-flux", "flux", ["policies.parallel.tensor=2"]),
    ("tensor2-wan", "wan", ["policies.parallel.tensor=2"]),
    ("shard2-flux", "flux", ["policies.parallel.shard=2"]),
    ("shard2-wan", "wan", ["policies.parallel.shard=2"]),
    ("offload2-wan", "wan", ["policies.parallel.shard=2", "policies.offload={strategy: layerwise, distributed: true}"]),
])
def test_estimate_per_rank_bytes_match_the_measured_ranks(two_ranks, flux_dir, wan_dir, name, family, sets):
    """The estimate counts parameters from the checkpoint's headers; a rank also holds whole buffers (RoPE
    tables), so what it measures is the estimate or up to 5% more."""
    from omnispec.estimate import estimate

    spec_file = {"flux": "flux1-dev.yaml", "wan": "wan2.1-t2v-1.3b.yaml"}[family]
    source = {"flux": flux_dir, "wan": wan_dir}[family]
    spec = load_spec(SPECS / spec_file, overrides=[*TINY_OVERRIDES[family], *sets])
    result = estimate(spec, source=str(source), kind="h200")
    counted = result.host_bytes_per_rank if "offload" in name else result.denoiser_bytes_per_rank
    measured = min(rank[name]["bytes"]["cpu"] for rank in two_ranks)
    assert counted <= measured <= 1.05 * counted, (counted, measured)
    assert len(result.mesh) == 2
