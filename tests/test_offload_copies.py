"""Model offload through persistent host copies (CPU): each plain weight keeps one host copy for the pipeline's
life, moving out copies into it and moving in copies out of it. On CUDA that copy is page-locked, so no move
allocates host memory and moves in don't block the host; here the device is the CPU too, so the two copies are
told apart by their storage (``_Placement(..., copies=True)``, which is the default off the CPU)."""

import numpy as np
import pytest
import torch

import omnispec
from omnispec.policies.offload.model import HOOK_NAME, _Placement, _to
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS


def _host_ptrs(placement: _Placement) -> dict:
    return {key: t.data_ptr() for key, t in placement.host.items()}


def test_moves_go_through_one_kept_host_copy_per_tensor():
    torch.manual_seed(0)
    enc = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    enc.append(torch.nn.Linear(4, 4))
    enc[2].weight = enc[0].weight  # tied: one Parameter in two places
    den = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    before = enc(x)
    placement = _Placement({"encoders": [enc], "denoisers": [den]}, torch.device("cpu"), copies=True)

    placement.bring("encoders")
    host = _host_ptrs(placement)
    assert len(host) == 8  # 2 + 1 linear tensors (the tied weight once), 5 BatchNorm tensors; den not yet
    on_device = enc[0].weight.data_ptr()
    assert on_device != host[(id(enc[0]), "param", "weight")]  # a real copy went in
    assert enc[2].weight is enc[0].weight
    assert torch.equal(enc(x), before)

    with torch.no_grad():  # a change made while on the device (a weight sync, a LoRA fuse) ...
        enc[0].bias.add_(1.0)
    changed = enc(x)
    placement.bring("denoisers")
    # ... is copied back into the kept host copy: the same storage as before, no new host tensor
    assert enc[0].weight.data_ptr() == host[(id(enc[0]), "param", "weight")]
    assert enc[0].bias.data_ptr() == host[(id(enc[0]), "param", "bias")]
    assert torch.equal(enc(x), changed)

    for _ in range(3):  # round trips reuse the same host storage every time
        placement.bring("encoders")
        assert torch.equal(enc(x), changed)
        placement.bring("denoisers")
    assert {k: v for k, v in _host_ptrs(placement).items() if k in host} == host
    assert enc[2].weight is enc[0].weight


def test_a_tensor_replaced_on_the_device_gets_a_new_host_copy():
    module = torch.nn.Linear(4, 4)
    placement = _Placement({"encoders": [module], "denoisers": []}, torch.device("cpu"), copies=True)
    placement.bring("encoders")
    module.weight.data = torch.ones(2, 4)  # another shape while on the device
    placement.bring("denoisers")
    assert module.weight.shape == (2, 4) and torch.equal(module.weight, torch.ones(2, 4))
    placement.bring("encoders")
    assert torch.equal(module.weight, torch.ones(2, 4))


@pytest.mark.timeout(120)
def test_model_offload_through_host_copies_gives_the_plain_output(flux_dir):
    # on the CPU target on every machine (a GPU machine's auto device would make copies from the start)
    overrides = [*TINY_OVERRIDES["flux"], "policies.attention.default=sdpa", "runtime.device=cpu"]
    plain = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=overrides)
    expected = {p: plain(p, seed=0).array for p in ("a cat", "a dog")}
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir),
                          overrides=[*overrides, "policies.offload={strategy: model}"])
    transformer = pipe.components["transformer"]
    placement = transformer._diffusers_hook.get_hook(HOOK_NAME).placement
    assert placement.copies is False  # the CPU target: nothing to move, Module.to as before
    placement.copies = True  # exercise the accelerator path on the CPU
    ptrs = None
    for prompt in ("a cat", "a dog", "a cat"):  # a new prompt each time: encoders and denoiser take turns
        assert np.abs(pipe(prompt, seed=0).array - expected[prompt]).max() <= 1e-6
        now = _host_ptrs(placement)
        if ptrs is not None:
            assert now == ptrs  # the same host storage on every request
        ptrs = now
    # the request ended decoding, so the denoiser is out again, in its kept host copy
    assert placement.current == "decoders"
    to_q = transformer.transformer_blocks[0].attn.to_q
    assert to_q.weight.data_ptr() == placement.host[(id(to_q), "param", "weight")].data_ptr()


def test_model_offload_passes_a_callee_s_lists_as_themselves():
    """Wan's VAE decodes chunk by chunk through the feat_cache list it hands its decoder; the hook that brings the
    VAE in must pass that very list on (a copy lost every chunk's cache: the H200 run decoded 2 frames for 5)."""
    cache = [None, torch.zeros(2)]
    kwargs = {"feat_cache": cache, "x": torch.ones(1)}
    moved = _to(kwargs, torch.device("cpu"))
    assert moved["feat_cache"] is cache
    moved["feat_cache"][0] = torch.ones(1)
    assert cache[0] is not None


def test_a_tensor_unchanged_on_the_device_is_not_copied_back():
    """Moving a group out copies back only what changed while it was in (the host copy holds the rest)."""
    module = torch.nn.Linear(64, 64)
    placement = _Placement({"encoders": [module], "denoisers": []}, torch.device("cpu"), copies=True)
    for _ in range(3):
        placement.bring("encoders")
        placement.bring("denoisers")
    assert placement.copied_back == 0
    placement.bring("encoders")
    with torch.no_grad():
        module.bias.add_(1.0)  # a weight sync or a fused LoRA changes it on the device
    placement.bring("denoisers")
    assert placement.copied_back == 64 * 4  # the bias alone
    placement.bring("encoders")
    assert torch.equal(module.bias.detach(), placement.host[(id(module), "param", "bias")])
