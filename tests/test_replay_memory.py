"""A replay with gradients picks its micro-batch from the device's free memory and what one sample's forward keeps:
graphs kept where all fit, each micro-batch recomputed in the backward where they don't, the blocks checkpointed where
not even one sample's whole forward fits recomputed; the same log-probs and gradients every way. The device's memory
figures are faked here (a CPU has none to read); what a forward keeps is counted for real."""

import pytest
import torch

import omnispec
from omnispec.rl import replay_memory
from omnispec.rl.replay_memory import SavedBytes, plan

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


def _fake_device(monkeypatch, free: int, kept: int, kept_with_blocks: int | None = None) -> None:
    """A device with ``free`` bytes on which one sample's forward with gradients would keep ``kept`` bytes (what the
    probe counts), and ``kept_with_blocks`` bytes more per forward measured with the blocks checkpointed."""
    allocated = iter(range(0, 10**15, kept_with_blocks or kept))

    class Counted(SavedBytes):
        def counting(self):
            self.bytes = kept
            return super().counting()

    monkeypatch.setattr(replay_memory, "SavedBytes", Counted)
    monkeypatch.setattr(replay_memory, "free_bytes", lambda device: free)
    monkeypatch.setattr(replay_memory, "allocated", lambda device: next(allocated))


def test_without_memory_figures_a_step_runs_all_its_samples_at_once(trained):
    _, _, (replay, _) = trained
    assert replay.batching.micro_batch is None and not replay.batching.recompute


def test_a_roomy_device_keeps_every_graph(trained, monkeypatch):
    pipe, ro, (plain, grads) = trained
    _fake_device(monkeypatch, free=100 * GIB, kept=GIB)
    replay, got = _replayed(pipe, ro)
    assert not replay.batching.recompute and replay.batching.micro_batch == 12  # 12 forwards, planned before any
    assert not replay.batching.blocks
    _assert_same(replay, got, plain, grads, ro)


def test_a_tight_device_recomputes_each_micro_batch_in_the_backward(trained, monkeypatch):
    pipe, ro, (plain, grads) = trained
    _fake_device(monkeypatch, free=8 * GIB, kept=GIB)
    replay, got = _replayed(pipe, ro)
    assert replay.batching.recompute and replay.batching.micro_batch == 3
    _assert_same(replay, got, plain, grads, ro)


def test_where_one_sample_does_not_fit_recomputed_the_denoiser_checkpoints_its_blocks(trained, monkeypatch):
    """One sample's whole graph (40 GiB) can't be recomputed in 40 GiB free: the digits DiT checkpoints its blocks,
    the first forward measures what that keeps (1 GiB), and the rest are planned from it; the switch is off after."""
    pipe, ro, (plain, grads) = trained
    module = pipe.components["transformer"]
    checkpointed = []
    _fake_device(monkeypatch, free=40 * GIB, kept=40 * GIB, kept_with_blocks=GIB)
    original = type(module).enable_gradient_checkpointing

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        inner = self._gradient_checkpointing_func
        self._gradient_checkpointing_func = lambda block, *a: checkpointed.append(block) or inner(block, *a)

    monkeypatch.setattr(type(module), "enable_gradient_checkpointing", spy)
    replay, got = _replayed(pipe, ro)
    assert replay.batching.blocks and not replay.batching.recompute and replay.batching.micro_batch == 11
    assert "checkpoints its blocks" in replay.batching.why and "40.00 GiB" in replay.batching.why
    # three forwards with gradients (step 0: the measured sample, then 5; step 1: 6), each block by block
    assert len(checkpointed) == 3 * len(module.blocks)
    assert not module.gradient_checkpointing and not module.is_gradient_checkpointing
    _assert_same(replay, got, plain, grads, ro)


def test_a_probe_counts_each_saved_storage_once_and_keeps_none():
    """A linear saves its input, ReLU its output, which the next linear saves again: two tensors of 32 x 64 floats,
    and not the weights (they stay anyway). Nothing is kept, so the graph can't be differentiated."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    counter = SavedBytes(torch.device("cpu"), [model])
    x = torch.randn(32, 64)
    with counter.counting():
        out = model(x)
    assert counter.bytes == 2 * 32 * 64 * 4
    with pytest.raises(RuntimeError, match="never differentiated"):
        out.sum().backward()


def _assert_same(replay, got, plain, grads, ro) -> None:
    assert (replay.log_probs.detach() - ro.log_probs).exp().sub(1).abs().max() <= 1e-6
    assert torch.allclose(replay.log_probs.detach(), plain.log_probs.detach(), atol=1e-6)
    for g, want in zip(got, grads):
        assert torch.allclose(g, want, atol=1e-6), (g - want).abs().max()


def test_compiled_blocks_are_probed_and_checkpointed_as_eager_ones(monkeypatch):
    """Under ``compile: regional`` the probe's counting hooks and the blocks' checkpoints wrap the compiled blocks: the
    replay planned with its blocks checkpointed gives the log-probs and gradients of a plain one."""
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=["runtime.progress=false", "recipe.defaults.steps=3",
                                                             "recipe.phases.0.guidance.terms=[]",
                                                             "policies.compile={mode: regional, backend: aot_eager}"])
    ro = pipe.rollout(["seven", "two"], group_size=2, seed=0, sampler=SDE)
    pipe.components["transformer"].requires_grad_(True)
    plain, grads = _replayed(pipe, ro)
    _fake_device(monkeypatch, free=40 * GIB, kept=40 * GIB, kept_with_blocks=GIB)
    replay, got = _replayed(pipe, ro)
    assert replay.batching.blocks and plain.batching.micro_batch is None
    _assert_same(replay, got, plain, grads, ro)


def test_which_denoisers_can_checkpoint_their_blocks_is_asked_through_diffusers_public_call(trained):
    from omnispec.rl.replay_memory import checkpoints_blocks

    pipe, _, _ = trained
    dit, encoder = pipe.components["transformer"], pipe.components["text_encoder"]
    assert checkpoints_blocks(dit) and not dit.is_gradient_checkpointing  # asked, and left as it was
    assert not checkpoints_blocks(encoder)  # a diffusers model whose class does not support it
    assert not checkpoints_blocks(torch.nn.Linear(2, 2))
