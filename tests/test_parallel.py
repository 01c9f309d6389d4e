"""policies.parallel on CPU: processes launched as torchrun would (env://, gloo), compared with one process."""

import contextlib
import io
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from omnispec.cli import main
from omnispec.testing import TINY_OVERRIDES

import preloaded
from conftest import SPECS, cpu_env


def launch(nproc: int, args: list[str], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """``nproc`` ranks of ``python -m omnispec run ...`` with torchrun's environment, forked from a process that has
    imported the libraries once (``preloaded``)."""
    with tempfile.TemporaryDirectory() as folder:
        return preloaded.run_ranks(nproc, "omnispec", ["run", *args], cpu_env(OMP_NUM_THREADS="1"), Path(folder),
                                   timeout)


def single(args: list[str]) -> subprocess.CompletedProcess:
    """``omnispec run ...`` in this process (the ranks' reference: a process of its own would spend its first
    seconds importing torch and diffusers again), its output and exit status as a finished process's."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", *args])
    return subprocess.CompletedProcess(["omnispec", "run", *args], code, out.getvalue(), err.getvalue())


def sd3_args(sd3_dir, out, *extra):
    sets = [x for o in TINY_OVERRIDES["sd3"] for x in ("--set", o)]
    return [str(SPECS / "sd3.5-medium.yaml"), "--source", str(sd3_dir), *sets,
            "--set", "recipe.phases.0.guidance.terms.1.scale=2.0", "--set", "recipe.phases.0.guidance.terms.1.layers=[1]",
            "--set", "recipe.phases.0.guidance.terms.1.window.end=1.0",
            "--prompt", "a cat", "--prompt", "a red car", "--prompt", "a bowl of fruit", "--seed", "3",
            "--negative-prompt", "blurry", "--output", str(out), *extra]


# cond + uncond + skip-layer = 3 passes a step: cfg 2 splits them unevenly (2 + 1), cfg 3 evenly; the
# last case turns skip-layer off and CFG off after the first half, so late steps run one pass (broadcast).
CASES = {
    "cfg2-uneven": ({"cfg": 2}, []),
    "cfg3": ({"cfg": 3}, []),
    "data2": ({"data": 2}, []),
    "cfg2-single-pass-steps": ({"cfg": 2}, ["--set", "recipe.phases.0.guidance.terms.1.scale=0.0",
                                            "--set", "recipe.phases.0.guidance.terms.0.window={start: 0.0, end: 0.5}"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_run_equals_single_process(sd3_dir, tmp_path, case):
    degrees, extra = CASES[case]
    ref_out = tmp_path / "ref.npy"
    res = single(sd3_args(sd3_dir, ref_out, *extra))
    assert res.returncode == 0, res.stderr
    reference = np.load(ref_out)
    nproc = int(np.prod(list(degrees.values())))
    out = tmp_path / "par.npy"
    flow = "{" + ", ".join(f"{k}: {v}" for k, v in degrees.items()) + "}"
    results = launch(nproc, sd3_args(sd3_dir, out, *extra, "--set", f"policies.parallel={flow}"))
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
    assert str(out) in results[0].stdout and not any(str(out) in r.stdout for r in results[1:])  # rank 0 writes
    assert np.abs(np.load(out) - reference).max() <= 1e-4


def test_wrong_world_size_fails_cleanly_on_every_rank(sd3_dir, tmp_path):
    results = launch(2, sd3_args(sd3_dir, tmp_path / "x.npy", "--set", "policies.parallel={cfg: 4}"), timeout=120)
    for r in results:
        assert r.returncode == 2 and "WORLD_SIZE is 2" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("local_rank", [0, 1])
def test_more_processes_on_a_host_than_cuda_devices_are_refused_on_every_rank(monkeypatch, local_rank):
    """Two ranks on a one-GPU host: each says so before any rendezvous (rank 1 had died in CUDA's "invalid device
    ordinal" and left rank 0 waiting for it)."""
    import torch

    from omnispec.runtime.parallel import context
    from omnispec.spec import SpecError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: pytest.fail("set_device before the check"))
    for name, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(local_rank)}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SpecError, match=r"2 processes on this host but 1 CUDA device.*--nproc-per-node 1.*"
                                        r"runtime.device=cpu"):
        context._ensure_process_group(2, torch.device("cuda"))


def test_degrees_above_one_in_a_single_process_are_refused(sd3_dir, tmp_path):
    res = single(sd3_args(sd3_dir, tmp_path / "x.npy", "--set", "policies.parallel={cfg: 2}"))
    assert res.returncode == 2 and "torchrun --nproc-per-node 2" in res.stderr


def tiny_args(family, spec, ckpt, out, *extra):
    sets = [x for o in TINY_OVERRIDES[family] for x in ("--set", o)]
    return [str(SPECS / spec), "--source", str(ckpt), *sets, "--prompt", "a cat", "--prompt", "a red car",
            "--seed", "1", "--negative-prompt", "blurry", "--output", str(out), *extra]


SEQUENCE_CASES = {
    "wan-ulysses2": ("wan", "wan2.1-t2v-1.3b.yaml", "wan_dir", {"ulysses": 2}, []),
    "flux-ulysses2": ("flux", "flux1-dev.yaml", "flux_dir", {"ulysses": 2}, []),
    "flux-ring2": ("flux", "flux1-dev.yaml", "flux_dir", {"ring": 2}, []),
    "wan-ring2-ulysses2": ("wan", "wan2.1-t2v-1.3b.yaml", "wan_dir", {"ring": 2, "ulysses": 2}, []),
    # Wan2.2 TI2V's per-token timesteps split with the sequence
    "wan_ti2v-ulysses2": ("wan", "wan2.2-ti2v-5b.yaml", "wan_ti2v_dir", {"ulysses": 2}, []),
    "flux-cfg2-ulysses2": ("flux", "flux1-dev.yaml", "flux_dir", {"cfg": 2, "ulysses": 2},
                           ["--set", "recipe.phases.0.guidance.terms=[{kind: true_cfg, scale: 2.0}]"]),
    # CFG-parallel spreads LTX-2's whole plan (cond, uncond, STG, modality) and gathers video and audio
    "ltx2-cfg2": ("ltx2", "ltx2-t2v.yaml", "ltx2_dir", {"cfg": 2},
                  ["--set", "recipe.phases.0.guidance.terms.1.layers=[1]"]),
    # a family added through docs/adding-a-family.md: its true CFG with norm-preserving rescale, split over ranks
    "qwen_image-cfg2": ("qwen_image", "qwen-image.yaml", "qwen_image_dir", {"cfg": 2}, []),
    # inpainting: FLUX Fill's masked-image channels split with the noise tokens; Qwen-Image's keep-unmasked blend
    # after each step gathered over CFG ranks (IMAGE and MASK: a 64x32 picture and its mask, written per test)
    "flux_fill-ulysses2": ("flux", "flux1-fill-dev.yaml", "flux_fill_dir", {"ulysses": 2},
                           ["--image", "IMAGE", "--mask", "MASK", "--strength", "0.8"]),
    "qwen_image_inpaint-cfg2": ("qwen_image", "qwen-image-inpaint.yaml", "qwen_image_dir", {"cfg": 2},
                                ["--image", "IMAGE", "--mask", "MASK"]),
}


def inpainting_files(folder, extra):
    """``extra`` with IMAGE and MASK replaced by a 64x32 picture and a mask of its size written to ``folder``."""
    from PIL import Image

    paths = {"IMAGE": folder / "picture.png", "MASK": folder / "mask.png"}
    if "IMAGE" in extra:
        Image.fromarray((np.random.RandomState(3).rand(32, 64, 3) * 255).astype(np.uint8)).save(paths["IMAGE"])
        held = np.zeros((32, 64), np.uint8)
        held[:, 32:] = 255
        Image.fromarray(held, "L").save(paths["MASK"])
    return [str(paths.get(a, a)) for a in extra]


@pytest.mark.parametrize("case", list(SEQUENCE_CASES))
def test_sequence_parallel_equals_single_process(request, tmp_path, case):
    family, spec, ckpt_fixture, degrees, extra = SEQUENCE_CASES[case]
    ckpt = request.getfixturevalue(ckpt_fixture)
    extra = inpainting_files(tmp_path, extra)
    ref = single(tiny_args(family, spec, ckpt, tmp_path / "ref.npy", *extra))
    assert ref.returncode == 0, ref.stderr
    flow = "{" + ", ".join(f"{k}: {v}" for k, v in degrees.items()) + "}"
    results = launch(int(np.prod(list(degrees.values()))),
                     tiny_args(family, spec, ckpt, tmp_path / "par.npy", *extra, "--set", f"policies.parallel={flow}"))
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
    assert np.abs(np.load(tmp_path / "par.npy") - np.load(tmp_path / "ref.npy")).max() <= 1e-4
    if family == "ltx2":  # the audio stream beside the frames: 16-bit PCM, so equal within one level
        for sample in (0, 1):  # one sound track per prompt
            par, ref_audio = (_pcm(tmp_path / f"{name}-{sample}.wav") for name in ("par", "ref"))
            assert par.shape == ref_audio.shape and par.size and np.abs(par - ref_audio).max() <= 1


def _pcm(path):
    import wave

    with wave.open(str(path), "rb") as f:
        return np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").astype(np.int32)


def test_families_without_a_context_parallel_plan_are_refused(sd3_dir, tmp_path):
    res = single(sd3_args(sd3_dir, tmp_path / "x.npy", "--set", "policies.parallel={ulysses: 2}"))
    assert res.returncode == 2 and "family 'sd3' cannot run ulysses/ring: no context-parallel plan" in res.stderr
