"""RL on every recipe: Wan2.2's two experts (a window across the boundary, each step replayed through the expert
that made it), bf16 models (float32 states, every scored sample stored as scored), and window-aware acceleration
(cheaper steps outside the window, exact ones inside)."""

import pytest
import torch

import omnispec
from omnispec.runtime.samplers import reused_steps
from omnispec.spec import SpecError
from omnispec.spec.recipe import SDESampler

from conftest import SPECS


def count_forwards(pipe, names):
    """Per denoiser name, the timesteps of each forward (one entry per forward)."""
    seen = {n: [] for n in names}
    handles = [pipe.components[n].register_forward_pre_hook(
        lambda m, a, kw, n=n: seen[n].append(float(kw["timestep"].flatten()[0])), with_kwargs=True) for n in names]
    return seen, handles


# ---- Wan2.2 A14B: two experts on one schedule ---------------------------------------------------------------

@pytest.fixture(scope="module")
def wan22(wan22_dir):
    from omnispec.testing import TINY_OVERRIDES

    return omnispec.build(SPECS / "wan2.2-t2v-a14b.yaml", source=str(wan22_dir), overrides=TINY_OVERRIDES["wan"])


def test_wan22_rollouts_need_euler_steps_on_unipc_sigmas(wan22):
    with pytest.raises(SpecError, match="UniPCMultistepScheduler is a multistep solver.*multistep: euler"):
        wan22.rollout("a cat", sampler={"kind": "sde"})


def test_wan22_window_across_the_boundary_replays_each_step_through_its_expert(wan22):
    from omnispec.runtime.run import Run

    walk = Run(wan22, wan22.request("a cat")).walks[0]
    owners = {i: run.phase.denoiser for run in walk.phases for i in run.indices}
    assert owners == {0: "transformer", 1: "transformer", 2: "transformer_2", 3: "transformer_2"}
    seen, handles = count_forwards(wan22, ["transformer", "transformer_2"])
    try:
        ro = wan22.rollout("a cat", group_size=2, seed=3, sampler={"kind": "sde", "multistep": "euler"})
        assert ro.step_indices[0].tolist() == [0, 1, 2]  # the window spans the boundary (after step 1)
        # the SDE and the Euler steps walk the checkpoint's UniPC sigmas and timesteps
        assert torch.equal(ro.sigmas[0], walk.steps.sigmas[:3].cpu())
        assert seen["transformer"] == walk.steps.timesteps[:2].float().tolist()
        assert seen["transformer_2"] == walk.steps.timesteps[2:].float().tolist()
        for k, step in enumerate(ro.step_indices[0].tolist()):
            for n in seen:
                seen[n].clear()
            replay = wan22.log_prob(ro, steps=[k], grad=False, micro_batch=1, exact=False)
            assert len(seen[owners[step]]) == 2 and not any(seen[n] for n in seen if n != owners[step])
            # one sample per forward sums in another order than the rollout's two (CPU kernels pick by batch size)
            assert torch.allclose(replay.log_probs.cpu(), ro.log_probs[:, [k]], rtol=0, atol=1e-6)
            for n in seen:
                seen[n].clear()
            exact = wan22.log_prob(ro, steps=[k], grad=False, micro_batch=1)  # valued as the rollout's two: exact
            assert len(seen[owners[step]]) == 1 and torch.equal(exact.log_probs.cpu(), ro.log_probs[:, [k]])
            whole = wan22.log_prob(ro, steps=[k], grad=False)  # the rollout's own batch: exact
            assert torch.equal(whole.log_probs.cpu(), ro.log_probs[:, [k]])
    finally:
        for h in handles:
            h.remove()
    whole = wan22.log_prob(ro, grad=False)
    assert ((whole.log_probs.cpu() - ro.log_probs).exp() - 1).abs().max().item() <= 1e-6


def test_a_subset_and_a_micro_batched_replay_with_gradients_are_exact(wan22):
    """The rollout ran 2 samples per forward; one of them replayed alone, or both one per forward with gradients, is
    valued by forwards of two (the subset padded with its own row), so its log-probs are the stored ones exactly.
    ``exact=False`` runs the replay's own row counts, which CPU kernels can sum in another order (the test above)."""
    ro = wan22.rollout("a cat", group_size=2, seed=5, sampler={"kind": "sde", "multistep": "euler"})
    assert ro.forward_batch.tolist() == [2, 2]
    part = ro.select([1])
    assert part.forward_batch.tolist() == [2]
    assert torch.equal(wan22.log_prob(part, grad=False).log_probs.cpu(), part.log_probs)
    loose = wan22.log_prob(part, grad=False, exact=False).log_probs.cpu()
    assert torch.allclose(loose, part.log_probs, rtol=0, atol=1e-5)
    lora = [p for p in wan22.components["transformer"].parameters()][:1]
    lora[0].requires_grad_(True)
    try:
        replay = wan22.log_prob(ro, steps=[0], grad=True, micro_batch=1)
        assert torch.equal(replay.log_probs.detach().cpu(), ro.log_probs[:, [0]])
        replay.log_probs.sum().backward()
        assert lora[0].grad is not None and bool(lora[0].grad.abs().sum() > 0)
    finally:
        lora[0].requires_grad_(False)
        lora[0].grad = None


def test_a_subset_under_half_its_rollouts_forward_is_valued_at_its_own_size_and_says_so(wan22, caplog):
    """Padding one sample to a rollout's forward of 3 would take 3x the work: it runs alone, as ``exact=False`` does,
    and the warning says how to get an exact ratio."""
    from omnispec.rl import replay_groups

    ro = wan22.rollout("a cat", group_size=3, seed=5, sampler={"kind": "sde", "multistep": "euler"})
    part = ro.select([2])
    replay_groups._SAID.discard((1, 3))
    alone = wan22.log_prob(part, grad=False).log_probs
    assert torch.equal(alone, wan22.log_prob(part, grad=False, exact=False).log_probs)
    assert "valued by forwards of 1" in caplog.text and "runtime.max_batch" in caplog.text


# ---- bf16 models: states and scored samples stay float32 ----------------------------------------------------

def test_bf16_model_rollout_stores_float32_samples_that_replay_exactly():
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=["runtime.progress=false", "recipe.defaults.steps=4",
                                                            "model.dtype=bfloat16"])
    inputs = []
    handle = pipe.components["transformer"].register_forward_pre_hook(
        lambda m, a, kw: inputs.append(kw["hidden_states"].dtype), with_kwargs=True)
    try:
        ro = pipe.rollout(["three"], group_size=3, seed=2, sampler={"kind": "sde"})
    finally:
        handle.remove()
    assert set(inputs) == {torch.bfloat16}  # the denoiser input is cast per forward
    after = ro.latents[:, 1:]
    assert after.dtype == torch.float32 and not torch.equal(after, after.bfloat16().float())  # not rounded
    for micro in (1, None):
        replay = pipe.log_prob(ro, grad=False, micro_batch=micro)
        assert torch.equal(replay.log_probs.cpu(), ro.log_probs)


# ---- window-aware acceleration ----------------------------------------------------------------------------

def test_outside_window_plan_restarts_after_windows_and_at_phase_starts():
    sampler = SDESampler(kind="sde", outside_window={"compute_every": 2})
    window = torch.tensor([False, False, False, True, True, False, False, False, False, False])
    assert reused_steps(sampler, window) == {1, 6, 8}
    assert reused_steps(sampler, window, phase_starts=[8]) == {1, 6, 9}
    assert reused_steps(sampler, window, begin=2) == {6, 8}
    assert reused_steps(SDESampler(kind="sde"), window) == set()


@pytest.fixture(scope="module")
def digits():
    return omnispec.build(SPECS / "digits.yaml", overrides=["runtime.progress=false", "recipe.defaults.steps=8"])


@pytest.mark.parametrize("window, every, forwards", [((0, 3), 2, 6), ((3, 2), 3, 4)])
def test_outside_window_steps_reuse_predictions_and_window_steps_replay_exactly(digits, window, every, forwards):
    start, length = window
    base = {"kind": "sde", "window": {"kind": "fixed", "start": start, "length": length}}
    seen, handles = count_forwards(digits, ["transformer"])
    try:
        exact = digits.rollout("six", group_size=2, seed=4, sampler=base)
        n_exact = len(seen["transformer"])
        seen["transformer"].clear()
        fast = digits.rollout("six", group_size=2, seed=4, sampler=base | {"outside_window": {"compute_every": every}})
        n_fast = len(seen["transformer"])
    finally:
        for h in handles:
            h.remove()
    assert (n_exact, n_fast) == (8, forwards)
    if start == 0:  # nothing before the window: its states are the exact rollout's
        assert torch.equal(fast.latents, exact.latents) and torch.equal(fast.log_probs, exact.log_probs)
    assert not (fast.array == exact.array).all()  # the outside steps did change
    for micro in (1, None):
        ratio = (digits.log_prob(fast, grad=False, micro_batch=micro).log_probs.cpu() - fast.log_probs).exp()
        assert (ratio - 1).abs().max().item() <= 1e-6
