"""MixGRPO's sliding window, GRPO-Guard's regulated ratio and DiffusionNFT's loss, each against a reference written
here from the official trainer's arithmetic, on the same inputs (MixGRPO: the progressive training states of
Tulvgengenr/MixGRPO, and MixGRPO-Flash's post-window DPM-Solver++ and compressed schedule of Tencent-Hunyuan/MixGRPO; DiffusionNFT: NVlabs/DiffusionNFT's SD3 trainer; GRPO-Guard: the paper's RatioNorm and
gradient reweighting as the public Flow-Factory trainer computes them, the authors' code not being reachable
here); the denoiser at trainer-made states; and each algorithm's digits example for a few iterations."""

import importlib.util
import math
import sys

import pytest
import torch

import omnispec
from omnispec.rl import Replay
from omnispec.spec import SpecError
from omnispec.spec.recipe import SlidingWindow

from conftest import SPECS

OVERRIDES = ["runtime.progress=false", "recipe.defaults.steps=6", "recipe.phases.0.guidance.terms=[]"]


@pytest.fixture(scope="module")
def pipe():
    from peft import LoraConfig

    pipe = omnispec.build(SPECS / "digits.yaml", overrides=OVERRIDES)
    pipe.components["transformer"].add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]),
                                               adapter_name="policy")
    return pipe


# ---- MixGRPO ------------------------------------------------------------------------------------------------

class ProgressiveStates:
    """MixGRPO's progressive window states, from its training loop: the trainer reads the window, then advances;
    after ``every`` advances the start moves by ``stride``; past ``last`` it rolls back to the first start, or
    stays at ``last``."""

    def __init__(self, length, every, last, stride, roll_back, first=0):
        self.length, self.every, self.last, self.stride, self.roll_back = length, every, last, stride, roll_back
        self.first = self.cur = first
        self.count = 0

    def advance(self):
        self.count += 1
        if self.count >= self.every:
            self.count = 0
            self.cur += self.stride
        if self.cur > self.last:
            if self.roll_back:
                self.cur, self.count = self.first, 0
            else:
                self.cur = self.last


@pytest.mark.parametrize("length, every, last, stride, wrap, first", [
    (4, 25, 14, 4, False, 0), (4, 3, 14, 4, True, 0), (2, 2, 9, 1, True, 1), (3, 1, 7, 2, False, 2)])
def test_sliding_window_starts_where_mixgrpo_trains(length, every, last, stride, wrap, first):
    ref = ProgressiveStates(length, every, last, stride, wrap, first)
    for iteration in range(120):
        ours = SlidingWindow(kind="sliding", length=length, every=every, stride=stride, wrap=wrap, start=first,
                             iteration=iteration)
        assert ours.first_step(last) == ref.cur, iteration
        ref.advance()


def test_a_sliding_window_rollout_steps_and_replays_its_window_only(pipe):
    sampler = {"kind": "sde", "window": {"kind": "sliding", "length": 2, "every": 2}}
    starts = []
    for iteration in (0, 2, 4, 6):  # usable steps 0-4 of 6: starts 0, 2, then 3 (the last that fits)
        sampler["window"]["iteration"] = iteration
        ro = pipe.rollout(["seven"], group_size=2, seed=iteration, sampler=sampler)
        starts.append(ro.step_indices[:, 0].tolist())
        assert ro.window == 2 and torch.equal(ro.step_indices[:, 1] - ro.step_indices[:, 0], torch.ones(2).long())
    assert starts == [[0, 0], [2, 2], [3, 3], [3, 3]]
    replay = pipe.log_prob(ro, grad=False)
    assert torch.equal(replay.log_probs.cpu(), ro.log_probs)
    with pytest.raises(SpecError, match="no room for a 6-step window"):
        pipe.rollout(["seven"], sampler={"kind": "sde", "window": {"kind": "sliding", "length": 6}})


# ---- GRPO-Guard ---------------------------------------------------------------------------------------------

def reference_guard_ratio(mean, old_mean, sample, std):
    """The regulated ratio from the Gaussian log-probs as Flow-GRPO's step writes them: ``exp(s (lp - lp_old) +
    mean((mean - old_mean)^2) / (2 s))``."""
    dims = tuple(range(1, mean.ndim))
    s = std.view(-1, *[1] * (mean.ndim - 1))

    def lp(m):
        return (-((sample - m) ** 2) / (2 * s**2) - torch.log(s) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
                ).mean(dim=dims)

    mse = (mean - old_mean).flatten(1).pow(2).mean(dim=1)
    return torch.exp((lp(mean) - lp(old_mean)) * std + mse / (2 * std))


def reference_clipped_loss(ratio, adv, clip):
    return torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)))


def replay_of(means, sample, std):
    """A one-step Replay with these means (gradients flow through them) and its Gaussian log-probs."""
    s = std.view(-1, *[1] * (means.ndim - 1))
    lp = (-((sample - means) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
    return Replay(lp[:, None], {"latents": lp[:, None]}, {"latents": means[:, None]}, {"latents": std[:, None]},
                  {"latents": std[:, None]})


def test_guard_ratio_and_its_gradients_equal_the_reference_on_random_transitions():
    gen = torch.Generator().manual_seed(0)
    old_mean = torch.randn(6, 4, 8, 8, generator=gen)
    std = torch.tensor([0.3, 0.05, 0.2, 0.01, 0.4, 0.1])
    sample = old_mean + std.view(-1, 1, 1, 1) * torch.randn(old_mean.shape, generator=gen)
    delta = 0.02 * torch.randn(old_mean.shape, generator=gen)
    adv = torch.randn(6, generator=gen)
    ours_mean = (old_mean + delta).requires_grad_()
    ref_mean = (old_mean + delta).requires_grad_()
    ratio = omnispec.rl.guard_log_ratio(replay_of(ours_mean, sample, std), replay_of(old_mean, sample, std))[:, 0].exp()
    expected = reference_guard_ratio(ref_mean, old_mean, sample, std)
    assert (ratio - expected).abs().max().item() < 1e-5  # measured 2.4e-7
    # the regulated log-ratio is mean(eps * (mean - old_mean)), with no shift and a scale free of the std
    eps = (sample - old_mean) / std.view(-1, 1, 1, 1)
    assert torch.allclose(ratio.log(), (eps * delta).mean(dim=(1, 2, 3)), atol=1e-5)
    omnispec.rl.clipped_surrogate(ratio, adv, 0.0001).backward()
    reference_clipped_loss(expected, adv, 0.0001).backward()
    assert (ours_mean.grad - ref_mean.grad).abs().max().item() < 1e-8
    assert ours_mean.grad.abs().sum() > 0


def test_guard_ratio_on_replays_of_a_trained_lora_equals_the_reference(pipe):
    ro = pipe.rollout(["seven", "two"], group_size=2, seed=3,
                      sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 3}})
    old = pipe.log_prob(ro, grad=False)
    dit = pipe.components["transformer"]
    lora = [p for n, p in dit.named_parameters() if "lora_B" in n]
    saved = [p.detach().clone() for p in lora]
    try:
        with torch.no_grad():
            for p in lora:
                p.add_(0.05 * torch.randn_like(p))
        new = pipe.log_prob(ro, grad=True)
        ours = omnispec.rl.guard_log_ratio(new, old).exp()
        for k in range(ro.window):
            expected = reference_guard_ratio(new.transition_means["latents"][:, k].detach(),
                                             old.transition_means["latents"][:, k], ro.latents[:, k + 1],
                                             old.transition_stds["latents"][:, k])
            assert (ours[:, k].detach() - expected).abs().max().item() < 1e-5
        assert (ours - 1).abs().max() > 0
        ours.sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)
        sub = old.select([1, 3], [2])
        assert sub.log_probs.shape == (2, 1) and torch.equal(sub.log_probs, old.log_probs[[1, 3]][:, [2]])
    finally:
        with torch.no_grad():
            for p, v in zip(lora, saved):
                p.copy_(v)
                p.grad = None


def test_guard_and_surrogate_refuse_what_does_not_fit():
    gen = torch.Generator().manual_seed(1)
    mean, std = torch.randn(2, 1, 4, 4, generator=gen), torch.ones(2)
    with pytest.raises(TypeError):
        omnispec.rl.guard_log_ratio(replay_of(mean, mean, std), {"latents": mean})
    other = replay_of(mean, mean, std)
    other.transition_means = {"video": mean[:, None]}
    with pytest.raises(SpecError, match="streams"):
        omnispec.rl.guard_log_ratio(replay_of(mean, mean, std), other)
    with pytest.raises(SpecError, match="clip"):
        omnispec.rl.clipped_surrogate(torch.ones(2), torch.ones(2), (-0.1, 0.2))


# ---- DiffusionNFT -------------------------------------------------------------------------------------------

def reference_nft_loss(x0, xt, t, forward_prediction, old_prediction, advantages, beta, adv_clip_max):
    """DiffusionNFT's policy loss as its SD3 trainer computes it, written again from its arithmetic."""
    dims = tuple(range(1, x0.ndim))
    t = t.view(-1, *([1] * (x0.ndim - 1)))
    r = torch.clamp(torch.clamp(advantages, -adv_clip_max, adv_clip_max) / adv_clip_max / 2.0 + 0.5, 0, 1)
    positive = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    negative = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    losses = []
    for v in (positive, negative):
        x0_hat = xt - t * v
        with torch.no_grad():
            weight = torch.abs(x0_hat.double() - x0.double()).mean(dim=dims, keepdim=True).clip(min=0.00001)
        losses.append(((x0_hat - x0) ** 2 / weight).mean(dim=dims))
    return ((r * losses[0] / beta + (1.0 - r) * losses[1] / beta) * adv_clip_max).mean()


@pytest.mark.parametrize("beta, adv_clip", [(1.0, 5.0), (0.1, 5.0), (0.5, 1.0)])
def test_nft_loss_and_its_gradients_equal_the_reference_on_random_inputs(beta, adv_clip):
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(5, 4, 8, 8, generator=gen)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.2, 0.05])
    xt = omnispec.rl.nft_noised(x0, sigma, noise := torch.randn(x0.shape, generator=gen))
    assert torch.equal(xt, (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise)
    v_old = noise - x0 + 0.3 * torch.randn(x0.shape, generator=gen)
    base = v_old + 0.05 * torch.randn(x0.shape, generator=gen)
    adv = torch.tensor([3.0, -1.0, 0.0, 7.0, -9.0])
    ours_v, ref_v = base.clone().requires_grad_(), base.clone().requires_grad_()
    ours = omnispec.rl.nft_loss(x0, xt, sigma, ours_v, v_old, adv, beta=beta, adv_clip=adv_clip)
    expected = reference_nft_loss(x0, xt, sigma, ref_v, v_old, adv, beta, adv_clip)
    assert abs(ours.loss.item() - expected.item()) <= 1e-6 * abs(expected.item())
    ours.loss.backward()
    expected.backward()
    assert (ours_v.grad - ref_v.grad).abs().max().item() < 1e-7
    # streams add their per-sample losses
    two = omnispec.rl.nft_loss({"a": x0, "b": x0}, {"a": xt, "b": xt}, sigma, {"a": base, "b": base},
                               {"a": v_old, "b": v_old}, adv, beta=beta, adv_clip=adv_clip)
    assert torch.allclose(two.loss, 2 * ours.loss.detach().double())


def test_nft_steps_are_distinct_per_sample_and_checked():
    at = omnispec.rl.nft_steps(4, 6, 3, torch.Generator().manual_seed(0))
    assert at.shape == (4, 3) and all(len(set(row.tolist())) == 3 for row in at) and int(at.max()) < 6
    with pytest.raises(SpecError, match="count"):
        omnispec.rl.nft_steps(4, 6, 7)
    with pytest.raises(SpecError, match="beta"):
        omnispec.rl.nft_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.zeros(1, 1),
                             torch.zeros(1, 1), torch.zeros(1), beta=0)


def test_the_denoiser_predicts_what_the_rollout_stepped_with(pipe):
    """A cps window on the last step only is an ODE rollout that records its clean latents (std 0 there); the
    denoiser's prediction at the stored last-step state gives them back exactly, and it runs at any schedule step."""
    ro = pipe.rollout(["three", "eight"], group_size=2, seed=5,
                      sampler={"kind": "cps", "include_last": True, "window": {"kind": "fixed", "start": 5, "length": 1}})
    d = omnispec.rl.denoiser(pipe, ro)
    assert d.steps == list(range(6))
    last = torch.full((4,), 5)
    with torch.no_grad():
        v = d.predict(ro.latents[:, 0], last)["latents"]
    assert torch.equal(ro.latents[:, 0] - d.sigmas(last).view(-1, 1, 1, 1) * v, ro.latents[:, 1])
    steps = torch.tensor([0, 2, 2, 4])
    x_t = omnispec.rl.nft_noised(ro.latents[:, 1], d.sigmas(steps), torch.randn(ro.latents[:, 1].shape))
    mixed = d.predict(x_t, steps)["latents"]
    assert mixed.requires_grad and mixed.shape == ro.latents[:, 1].shape
    with pytest.raises(SpecError, match="one step per sample"):
        d.predict(x_t, torch.tensor([0, 1]))
    with pytest.raises(SpecError, match="not trainable steps"):
        d.predict(x_t, torch.tensor([0, 1, 2, 6]))
    with pytest.raises(SpecError, match="shape"):
        d.predict(x_t[:, :, :8], steps)


# ---- the digits examples ------------------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="the digits reward needs scikit-learn")
@pytest.mark.parametrize("algorithm", ["mixgrpo", "grpo_guard", "nft"])
def test_each_algorithm_trains_a_few_iterations_of_the_digits_example(algorithm):
    sys.path.insert(0, str(SPECS.parent / "examples"))
    import rl_algorithms_digits

    history = rl_algorithms_digits.train(algorithm, iterations=2, prompts_per_iter=1, group=2, steps=3, window=1,
                                         every=1, nft_steps=1, flash=algorithm == "mixgrpo",
                                         compress=0.5 if algorithm == "mixgrpo" else 1.0, log=lambda s: None)
    assert len(history) == 2 and all(0 <= row["reward"] <= 1 for row in history)
    if algorithm == "nft":
        assert all(math.isfinite(row["nft_loss"]) for row in history)
    else:
        assert all(abs(row["ratio_mean"] - 1) < 0.1 for row in history)
    if algorithm == "mixgrpo":
        assert [row["window"] for row in history] == [[0], [1]]  # the window moved after one iteration


# ---- MixGRPO-Flash: DPM-Solver++ after the window -----------------------------------------------------------

def reference_dpm_pp(sample, model_outputs, sigmas, step_index, lower_order, solver_type, final):
    """MixGRPO's post-window DPM-Solver++ step (its deterministic branch), written again from its arithmetic:
    ``model_outputs`` are the clean-sample estimates so far, ``lower_order`` how many updates its state has seen."""
    def alpha_sigma(s):
        return 1 - s, s

    alpha_t, sigma_t = alpha_sigma(sigmas[step_index + 1])
    alpha_s0, sigma_s0 = alpha_sigma(sigmas[step_index])
    h = (torch.log(alpha_t) - torch.log(sigma_t)) - (torch.log(alpha_s0) - torch.log(sigma_s0))
    if lower_order < 1 or final:
        return (sigma_t / sigma_s0) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * model_outputs[-1]
    alpha_s1, sigma_s1 = alpha_sigma(sigmas[step_index - 1])
    h_0 = (torch.log(alpha_s0) - torch.log(sigma_s0)) - (torch.log(alpha_s1) - torch.log(sigma_s1))
    m0, m1 = model_outputs[-1], model_outputs[-2]
    D0, D1 = m0, (1.0 / (h_0 / h)) * (m0 - m1)
    if solver_type == "midpoint":
        return ((sigma_t / sigma_s0) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * D0
                - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * D1)
    return ((sigma_t / sigma_s0) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * D0
            + (alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * D1)


@pytest.mark.parametrize("solver_type", ["heun", "midpoint"])
def test_dpm_solver_pp_step_equals_mixgrpo_flash_on_random_inputs(solver_type):
    from omnispec.runtime.samplers.stochastic import dpm_solver_pp

    gen = torch.Generator().manual_seed(4)
    shift = 3.0
    t = torch.linspace(1, 0, 9)
    sigmas = shift * t / (1 + (shift - 1) * t)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    worst = 0.0
    for i in range(1, 8):
        x0s = [torch.randn(x.shape, generator=gen) for _ in range(2)]
        final = i == 7
        ours = dpm_solver_pp(x, x0s, sigmas, i, solver_type, first_order=final)
        expected = reference_dpm_pp(x, x0s, sigmas, i, 1, solver_type, final)
        worst = max(worst, (ours - expected).abs().max().item())
    assert worst < 1e-6  # measured 0.0
    first = dpm_solver_pp(x, x0s[-1:], sigmas, 3, solver_type)
    assert torch.equal(first, reference_dpm_pp(x, x0s[-1:], sigmas, 3, 0, solver_type, False))


def test_dpm_solver_pp_after_the_window_keeps_the_window_and_its_replay(pipe):
    base = {"kind": "sde", "window": {"kind": "fixed", "start": 1, "length": 2}}
    euler = pipe.rollout(["seven"], group_size=2, seed=0, sampler=base)
    flash = pipe.rollout(["seven"], group_size=2, seed=0, sampler={**base, "outside_window": {"solver": "dpmsolver++"}})
    assert torch.equal(euler.latents, flash.latents) and torch.equal(euler.log_probs, flash.log_probs)
    assert abs(euler.array - flash.array).max() > 1e-3  # the steps after the window differ
    assert torch.equal(pipe.log_prob(flash, grad=False).log_probs.cpu(), flash.log_probs)
    with pytest.raises(SpecError, match="compute_every: 1"):
        pipe.rollout(["seven"], sampler={**base, "outside_window": {"solver": "dpmsolver++", "compute_every": 2}})


# ---- MixGRPO-Flash: fewer, larger ODE steps after the window ------------------------------------------------

def reference_compressed_sigmas(steps, last, shift, ratio):
    """MixGRPO-Flash's schedule after its window, written again from its arithmetic: its grid is the SD3 shift of
    ``linspace(1, 0, steps + 1)``; after the last stochastic step ``last`` it keeps ``int(max(n * ratio, 1))`` of the
    ``n`` points from there, evenly spaced in the unshifted time and shifted again (float32 throughout)."""
    def time_shift(t):
        return shift * t / (1 + (shift - 1) * t)

    grid = time_shift(torch.linspace(1, 0, steps + 1))
    kept = int(max((grid.size(0) - 1 - last) * ratio, 1))
    start = torch.linspace(1, 0, grid.size(0))[last + 1].item()
    return torch.cat([grid[:last + 1], time_shift(torch.linspace(start, 0, kept))])


def flash_schedule(steps, shift):
    """omnispec's flow_match schedule on MixGRPO's grid: explicit unshifted points ``linspace(1, 0, steps + 1)``
    without the terminal, the same static shift."""
    from omnispec.spec import FlowMatchSchedule

    times = [float(t) for t in torch.linspace(1, 0, steps + 1)[:-1]]
    return FlowMatchSchedule(kind="flow_match", sigmas=times, shift=shift)


def compressed_steps(schedule, steps, last, ratio, seq_len=0):
    from omnispec.runtime.schedule import FLOW_MATCH
    from omnispec.spec.recipe import OutsideWindow

    count = OutsideWindow(compress=ratio).points_after(steps - last)
    return FLOW_MATCH.compressed(schedule, steps, seq_len, last + 1, count, torch.device("cpu"))


@pytest.mark.parametrize("steps, last, shift, ratio", [
    (25, 3, 3.0, 0.4), (25, 12, 3.0, 0.2), (16, 5, 1.0, 0.4), (10, 2, 5.0, 0.5), (25, 0, 3.0, 0.2)])
def test_compressed_schedule_equals_mixgrpo_flash(steps, last, shift, ratio):
    ours = compressed_steps(flash_schedule(steps, shift), steps, last, ratio)
    expected = reference_compressed_sigmas(steps, last, shift, ratio)
    assert ours.sigmas.shape == expected.shape
    assert (ours.sigmas - expected).abs().max().item() < 1e-6  # 1 float32 ulp at most: omnispec shifts in float64
    uncompressed = flash_schedule(steps, shift)
    from omnispec.spec import flow_match_sigmas
    full = torch.tensor(flow_match_sigmas(uncompressed, steps), dtype=torch.float32)
    assert torch.equal(ours.sigmas[:last + 2], full[:last + 2])  # up to where the window lands: the walk's own
    assert torch.equal(ours.timesteps, ours.sigmas[:-1] * 1000)


def test_a_compressed_schedule_still_ends_at_zero_where_mixgrpo_flash_stops_short():
    """With one point kept (the window near the end), MixGRPO-Flash's schedule ends at the noise level the window
    reached; omnispec keeps two points, so the walk still lands on sigma 0."""
    expected = reference_compressed_sigmas(25, 20, 3.0, 0.2)
    assert len(expected) == 22 and expected[-1] > 0.1
    ours = compressed_steps(flash_schedule(25, 3.0), 25, 20, 0.2).sigmas
    assert len(ours) == 23 and ours[-1] == 0 and (ours[:22] - expected).abs().max().item() < 1e-6


@pytest.mark.parametrize("schedule", [
    {"shift": 3.0}, {"shift": "dynamic"}, {"shift": "empirical"},
    {"shift": "dynamic", "base_shift": 0.95, "max_shift": 2.05, "base_seq_len": 1024, "shift_terminal": 0.1}])
def test_each_schedules_time_warp_walks_its_own_grid(schedule):
    """Kept whole (every point), a compressed walk is the schedule's own: the warp is the schedule's shift and
    terminal stretch on its evenly spaced grid."""
    from omnispec.spec import FlowMatchSchedule, flow_match_sigmas
    from omnispec.spec.schedule import flow_match_compressed

    flow = FlowMatchSchedule(kind="flow_match", **schedule)
    own = flow_match_sigmas(flow, 12, 2048)
    for point in (1, 4, 9):
        whole = flow_match_compressed(flow, 12, 2048, point, 13 - point)
        assert whole[:point + 1] == own[:point + 1] and max(abs(a - b) for a, b in zip(whole, own)) < 1e-12
        shorter = flow_match_compressed(flow, 12, 2048, point, 3)
        assert shorter[:point + 1] == own[:point + 1] and shorter[-1] == 0.0 and len(shorter) == point + 3
        assert own[point] > shorter[point + 1] > 0.0


def reference_flash_walk(velocity, z, sigmas, stochastic, eta, noises, solver_type):
    """MixGRPO-Flash's rollout loop, written again from its arithmetic: Flow-GRPO's SDE at the stochastic steps and
    Euler at the others up to the window's last step, each feeding the solver's history of clean-sample estimates;
    then multistep DPM-Solver++ (``reference_dpm_pp``) on the compressed schedule ``sigmas``."""
    last = max(i for i, s in enumerate(stochastic) if s)
    history, lower = [], 0
    for i in range(len(sigmas) - 1):
        sigma, v = sigmas[i], velocity(z, sigmas[i])
        history = (history + [z - sigma * v])[-2:]
        if i > last:
            z = reference_dpm_pp(z, history, sigmas, i, lower, solver_type, i == len(sigmas) - 2)
        elif stochastic[i]:
            dt = sigmas[i + 1] - sigma
            std_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma))) * eta
            mean = z * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
            z = mean + std_t * torch.sqrt(-dt) * noises.pop(0)
        else:
            z = z + (sigmas[i + 1] - sigma) * v
        lower = min(lower + 1, 2)
    return z


@pytest.mark.parametrize("solver_type", ["heun", "midpoint"])
def test_a_flash_walk_equals_mixgrpo_flash_on_the_same_inputs(solver_type):
    from omnispec.runtime.samplers import StochasticStepper
    from omnispec.spec.recipe import SDESampler

    steps, last, shift = 12, 4, 3.0
    walk = compressed_steps(flash_schedule(steps, shift), steps, last, 0.4)
    sampler = SDESampler(kind="sde", noise_level=0.7, outside_window={"solver": "dpmsolver++",
                                                                      "solver_type": solver_type, "compress": 0.4})
    mask = torch.zeros(2, len(walk), dtype=torch.bool)
    mask[:, 2:last + 1] = True
    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)) / 4

    def velocity(x, sigma):  # a fixed smooth field, the same for both walks
        return torch.tanh(torch.einsum("bchw,cd->bdhw", x, weight)) * (1 + sigma) - x

    x0 = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(2))
    draws = [torch.Generator().manual_seed(7 + b) for b in range(2)]
    noises = [torch.stack([torch.randn(4, 6, 6, generator=g) for g in draws]) for _ in range(2, last + 1)]
    stepper = StochasticStepper(sampler, walk.sigmas, mask, [torch.Generator().manual_seed(7 + b) for b in range(2)])
    x = {"latents": x0}
    for i in range(len(walk)):
        x = stepper.step(x, {"latents": velocity(x["latents"], walk.sigmas[i])}, i).next
    expected = reference_flash_walk(velocity, x0, walk.sigmas, mask[0].tolist(), 0.7, noises, solver_type)
    assert (x["latents"] - expected).abs().max().item() < 1e-5  # measured 0.0 (states of magnitude up to 7)


@pytest.mark.parametrize("solver", ["euler", "dpmsolver++"])
def test_a_compressed_rollout_keeps_its_window_and_replays_it_exactly(pipe, solver):
    base = {"kind": "sde", "window": {"kind": "fixed", "start": 1, "length": 2}}
    calls = []
    hook = pipe.components["transformer"].register_forward_hook(lambda *args: calls.append(1))
    try:
        full = pipe.rollout(["seven"], group_size=2, seed=0, sampler={**base, "outside_window": {"solver": solver}})
        forwards = len(calls)
        flash = pipe.rollout(["seven"], group_size=2, seed=0,
                             sampler={**base, "outside_window": {"solver": solver, "compress": 0.5}})
    finally:
        hook.remove()
    assert (forwards, len(calls) - forwards) == (6, 4)  # 6 steps; after the window (steps 1-2) 3 become 1
    assert torch.equal(full.latents, flash.latents) and torch.equal(full.log_probs, flash.log_probs)
    assert abs(full.array - flash.array).max() > 1e-3
    replay = pipe.log_prob(flash, grad=False)
    assert torch.equal((replay.log_probs.cpu() - flash.log_probs).exp(), torch.ones_like(flash.log_probs))


@pytest.mark.parametrize("outside, message", [
    ({"compress": 0}, "compress"), ({"compress": 1.5}, "compress"), ({"compress": "half"}, "compress"),
    ({"compress": 0.5, "compute_every": 2}, "compute_every: 1")])
def test_a_bad_compression_is_one_spec_error(pipe, outside, message):
    with pytest.raises(SpecError, match=message):
        pipe.rollout(["seven"], sampler={"kind": "sde", "window": {"kind": "fixed", "length": 1},
                                         "outside_window": outside})


def test_compression_is_refused_where_nothing_honours_it(pipe):
    from omnispec.runtime.plan import plan_request
    from omnispec.runtime.schedule import SCHEDULER
    from omnispec.spec import SchedulerSchedule

    with pytest.raises(SpecError, match="flow_match schedules"):
        SCHEDULER.compressed(SchedulerSchedule(kind="scheduler"), 6, 0, 2, 2, torch.device("cpu"))
    phase_sampler = "recipe.phases.0.sampler={kind: sde, outside_window: {compress: 0.5}}"
    spec = omnispec.load_spec(SPECS / "digits.yaml", [*OVERRIDES, phase_sampler])
    plan = plan_request(spec, pipe.family, pipe.components, pipe.device, pipe.request(["seven"], [0]))
    with pytest.raises(SpecError, match="recipe.phases.0.sampler.outside_window.compress: .*roll out"):
        plan.stepper(plan.walks[0], pipe.device)
