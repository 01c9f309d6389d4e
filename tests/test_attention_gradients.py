"""Forwards that may be differentiated (with gradients, rollouts, replays) run attention kernels whose backward is
proven: torch's dispatcher never picks cuDNN attention there unless a spec names it, a rollout and its replays run the
same kernels, and ``explain`` says which backend each role runs with and without gradients."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

import omnispec
from omnispec.cli import main
from omnispec.kernels.sdpa import safe_sdpa, training_forwards
from omnispec.policies.attention_kernels import GradientSafeSDPA

from conftest import SPECS

DIGITS = SPECS / "digits.yaml"
QUICK = ["runtime.progress=false", "recipe.defaults.steps=2", "recipe.phases.0.guidance.terms=[]"]
SDE = {"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 1}}


class _Switches(TorchFunctionMode):
    """Records, at every SDPA call, which of torch's SDPA kernels are switched on."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[bool, bool, bool]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            cuda = torch.backends.cuda
            self.seen.add((cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.math_sdp_enabled()))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def pipe():
    return omnispec.build(DIGITS, overrides=[*QUICK, "policies.attention.default=sdpa"])


def _switches_in(call) -> set[tuple[bool, bool, bool]]:
    with _Switches() as seen:
        call()
    return seen.seen


def test_generation_leaves_the_kernel_to_torchs_dispatcher(pipe):
    assert _switches_in(lambda: pipe("seven", seed=0)) == {(True, True, True)}


def test_rollouts_and_their_replays_run_sdpa_with_cudnn_attention_off(pipe):
    ro = pipe.rollout(["seven"], group_size=2, seed=0, sampler=SDE)
    assert _switches_in(lambda: pipe.rollout(["seven"], group_size=2, seed=0, sampler=SDE)) == {(False, True, True)}
    assert _switches_in(lambda: pipe.log_prob(ro, grad=False)) == {(False, True, True)}
    assert _switches_in(lambda: pipe.log_prob(ro, grad=True)) == {(False, True, True)}
    assert torch.equal(pipe.log_prob(ro, grad=True).log_probs.detach(), ro.log_probs)


def test_any_forward_with_gradients_runs_sdpa_with_cudnn_attention_off(pipe):
    denoiser = pipe.components["transformer"]
    x = torch.randn(1, 1, 32, 32)

    def forward():
        with torch.enable_grad():
            denoiser(hidden_states=x, timestep=torch.tensor([500.0]), text_embeds=torch.randn(1, 96))

    assert _switches_in(forward) == {(False, True, True)}
    with torch.no_grad():
        assert _switches_in(forward) == {(False, True, True)}  # enable_grad inside wins
    with torch.no_grad(), training_forwards():
        assert _switches_in(lambda: denoiser(hidden_states=x, timestep=torch.tensor([500.0]),
                                             text_embeds=torch.randn(1, 96))) == {(False, True, True)}


def test_a_named_kernel_runs_as_named_with_gradients_too():
    pipe = omnispec.build(DIGITS, overrides=[*QUICK, "policies.attention.default=sdpa_math"])
    ro = pipe.rollout(["seven"], group_size=2, seed=0, sampler=SDE)
    assert _switches_in(lambda: pipe.log_prob(ro, grad=True)) == {(False, False, True)}


def test_only_a_free_choice_loses_cudnn_attention():
    assert _safe_switches() == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # named: kept
        assert _safe_switches() == [SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]):
        assert _safe_switches() == [SDPBackend.MATH]


def _safe_switches() -> list[SDPBackend]:
    from torch.nn.attention import _cur_sdpa_kernel_backends  # what sdpa_kernel set, to read it back

    with safe_sdpa():
        return sorted(_cur_sdpa_kernel_backends(), key=[SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                         SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION].index)


def test_compiled_code_is_traced_again_with_cudnn_attention_off_for_forwards_that_may_train():
    """Dynamo traces the mode into compiled code and guards on it: a block compiled for generation is compiled anew,
    with the kernels switched in its graph, when a rollout or a training forward calls it."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    def attention(q):
        return F.scaled_dot_product_attention(q, q, q)

    compiled = torch.compile(attention, backend=recording, fullgraph=True)
    q = torch.randn(1, 2, 16, 8)
    compiled(q)
    with GradientSafeSDPA():
        compiled(q)
        compiled(q)
    assert len(graphs) == 2, graphs
    assert not any("sdpa_kernel" in t for t in graphs[0])
    assert any("sdpa_kernel" in t for t in graphs[1]), graphs[1]


def test_a_compiled_rollout_replays_with_a_ratio_of_exactly_one():
    pipe = omnispec.build(DIGITS, overrides=[*QUICK, "policies.compile.mode=regional"])
    pipe("seven", seed=0)  # generation's graphs first: the rollout's must not reuse them
    ro = pipe.rollout(["seven"], group_size=2, seed=0, sampler=SDE)
    pipe.components["transformer"].requires_grad_(True)
    try:
        replay = pipe.log_prob(ro, grad=True)
        replay.log_probs.sum().backward()
    finally:
        pipe.components["transformer"].requires_grad_(False).zero_grad(set_to_none=True)
    assert torch.equal(replay.log_probs.detach(), ro.log_probs)


def test_explain_says_each_roles_backend_with_and_without_gradients(pipe, capsys):
    text = pipe.explain()
    plain, trained = text.split("attention per role with gradients (and in rollouts and replays):")
    assert re.search(r"\n  self +sdpa: torch's dispatcher picks the kernel\n", plain), text
    assert re.match(r"\n  self +sdpa with cuDNN attention off .*rollouts and their replays run it too", trained), text
    assert main(["explain", str(DIGITS), "--set", "policies.compile.mode=regional", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["attention"]["default"].startswith("sdpa (auto under compile")
    assert out["attention_with_gradients"]["default"].startswith("sdpa with cuDNN attention off")
