"""A replay with gradients picks its micro-batch from the device's free memory and what one sample's forward keeps:
graphs kept where all fit, each micro-batch recomputed in the backward where they don't; the same log-probs and
gradients either way. The device's memory figures are faked here (a CPU has none to read)."""

import pytest
import torch

import omnispec
from omnispec.rl import replay_memory
from omnispec.rl.replay_memory import plan

from conftest import SPECS

GIB = 2**30
SDE = {"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 2}}


def test_every_graph_is_kept_where_all_fit():
    batching = plan(forwards=30, free_bytes=100 * GIB, kept_per_sample=2 * GIB)
    assert not batching.recompute and batching.micro_batch == 12  # 85 GiB usable: 60 kept, 25 GiB of room left


def test_forwards_whose_graphs_do_not_fit_are_recomputed_in_micro_batches():
    batching = plan(forwards=15, free_bytes=40 * GIB, kept_per_sample=3 * GIB)
    assert batching.recompute and batching.micro_batch == 5  # 34 GiB usable, 6 GiB a sample (kept + working)
    assert "recomputed in the backward" in batching.why and "3.00 GiB" in batching.why


def test_a_micro_batch_of_one_where_not_even_two_fit():
    assert plan(forwards=15, free_bytes=10 * GIB, kept_per_sample=9 * GIB).micro_batch == 1


@pytest.fixture(scope="module")
def trained():
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=["runtime.progress=false", "recipe.defaults.steps=3",
                                                             "recipe.phases.0.guidance.terms=[]"])
    ro = pipe.rollout(["seven", "two"], group_size=3, seed=0, sampler=SDE)
    pipe.components["transformer"].requires_grad_(True)
    return pipe, ro, _replayed(pipe, ro)


def _replayed(pipe, ro):
    """A replay with gradients and the gradients of its summed log-probs."""
    module = pipe.components["transformer"]
    module.zero_grad(set_to_none=True)
    replay = pipe.log_prob(ro, grad=True)
    replay.log_probs.sum().backward()
    return replay, [p.grad.clone() for p in module.parameters()]


def _fake_device(monkeypatch, free: int, kept: int) -> None:
    """A device with ``free`` bytes on which each forward with gradients keeps ``kept`` bytes more."""
    allocated = iter(range(0, 10**15, kept))
    monkeypatch.setattr(replay_memory, "free_bytes", lambda device: free)
    monkeypatch.setattr(replay_memory, "allocated", lambda device: next(allocated))


def test_without_memory_figures_a_step_runs_all_its_samples_at_once(trained):
    _, _, (replay, _) = trained
    assert replay.batching.micro_batch is None and not replay.batching.recompute


def test_a_roomy_device_keeps_every_graph(trained, monkeypatch):
    pipe, ro, (plain, grads) = trained
    _fake_device(monkeypatch, free=100 * GIB, kept=GIB)
    replay, got = _replayed(pipe, ro)
    assert not replay.batching.recompute and replay.batching.micro_batch == 11  # 12 forwards, the first measured
    _assert_same(replay, got, plain, grads, ro)


def test_a_tight_device_recomputes_each_micro_batch_in_the_backward(trained, monkeypatch):
    pipe, ro, (plain, grads) = trained
    _fake_device(monkeypatch, free=8 * GIB, kept=GIB)
    replay, got = _replayed(pipe, ro)
    assert replay.batching.recompute and replay.batching.micro_batch == 3
    _assert_same(replay, got, plain, grads, ro)


def _assert_same(replay, got, plain, grads, ro) -> None:
    assert (replay.log_probs.detach() - ro.log_probs).exp().sub(1).abs().max() <= 1e-6
    assert torch.allclose(replay.log_probs.detach(), plain.log_probs.detach(), atol=1e-6)
    for g, want in zip(got, grads):
        assert torch.allclose(g, want, atol=1e-6), (g - want).abs().max()
