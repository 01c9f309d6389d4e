"""RL conventions against the official trainers: each official step (Flow-GRPO's SDE and CPS, DanceGRPO's SDE)
is written here again from its published formulas and compared with omnispec's on identical float32 inputs;
Flow-GRPO's KL term, its sigma = 1 guard on one-step schedules, the default window without the last step,
DanceGRPO's x0 decode, and SD3.5's checkpoint sigmas."""

import math

import pytest
import torch

import omnispec
from omnispec.rl import Replay, kl
from omnispec.runtime.samplers import StochasticStepper, stochastic_step
from omnispec.spec import SpecError
from omnispec.spec.recipe import CPSSampler, DanceSDESampler, SDESampler

from conftest import SPECS

TOL = 1e-6
# Steps of a 10-step schedule: sigma = 1, mid, second-to-last, last.
STEPS = [0, 5, 8, 9]


def sd35_sigmas(n: int = 10) -> torch.Tensor:
    """The sigmas Flow-GRPO steps for SD3.5-medium: the checkpoint's FlowMatchEulerDiscreteScheduler (shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(n)
    return scheduler.sigmas.to(torch.float32)


def per_row(sigmas: torch.Tensor, steps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.tensor(steps)
    return sigmas[idx].view(-1, 1, 1, 1), sigmas[idx + 1].view(-1, 1, 1, 1)


def inputs(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, 16, 8, 8, generator=gen) for _ in range(3))  # type: ignore[return-value]


# ---- the official steps, from their formulas (float32; per-row sigmas, so one batch may mix steps) ----------

def ref_flow_grpo_sde(v, x, sigma, sigma_next, sigma_max: float, eta: float, noise=None, sample=None):
    """Flow-GRPO, sde_type "sde": std_dev_t = eta sqrt(sigma / (1 - sigma)), sigma = 1 replaced by sigma_max (the
    schedule's second sigma); drift-corrected mean; x' = mean + std_dev_t sqrt(-dt) eps; full Gaussian log-prob
    averaged over the non-batch dimensions. Returns (sample, log_prob, mean, std_dev_t)."""
    v, x = v.float(), x.float()
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, torch.tensor(sigma_max), sigma))) * eta
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    scale = std_dev_t * torch.sqrt(-dt)
    if sample is None:
        sample = mean + scale * noise
    lp = -((sample - mean) ** 2) / (2 * scale**2) - torch.log(scale) - torch.log(torch.sqrt(2 * torch.tensor(math.pi)))
    return sample, lp.mean(dim=(1, 2, 3)), mean, std_dev_t


def ref_flow_grpo_cps(v, x, sigma, sigma_next, eta: float, noise=None, sample=None):
    """Flow-GRPO / Flow-CPS, sde_type "cps": std = sigma' sin(eta pi / 2); x0 = x - sigma v, x1 = x + (1 - sigma) v;
    mean = (1 - sigma') x0 + sqrt(sigma'^2 - std^2) x1; log-prob -(x' - mean)^2 with all constants removed."""
    v, x = v.float(), x.float()
    std = sigma_next * math.sin(eta * math.pi / 2)
    x0, x1 = x - sigma * v, x + v * (1 - sigma)
    mean = x0 * (1 - sigma_next) + x1 * torch.sqrt(sigma_next**2 - std**2)
    if sample is None:
        sample = mean + std * noise
    return sample, (-((sample - mean) ** 2)).mean(dim=(1, 2, 3)), mean, std


def ref_dance_sde(v, x, sigmas: torch.Tensor, index: int, eta: float, noise=None, sample=None):
    """DanceGRPO's flux_step for one step ``index`` of the whole batch: mean = x + dsigma v, then the score term
    -eta^2/2 * score * dsigma with score = -(x - (1 - sigma) x0) / sigma^2; std = eta sqrt(sigma - sigma') as a
    Python float; full Gaussian log-prob averaged over the non-batch dimensions."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    mean = x + dsigma * v
    x0 = x - sigma * v
    std = eta * math.sqrt(sigma - sigmas[index + 1])
    score = -(x - x0 * (1 - sigma)) / sigma**2
    mean = mean + (-0.5 * eta**2 * score) * dsigma
    if sample is None:
        sample = mean + noise * std
    lp = -((sample - mean) ** 2) / (2 * std**2) - math.log(std) - torch.log(torch.sqrt(2 * torch.tensor(math.pi)))
    return sample, lp.mean(dim=(1, 2, 3)), mean, std


def close(ours: torch.Tensor, ref: torch.Tensor | float, what: str) -> None:
    ref = torch.as_tensor(ref, dtype=torch.float32).expand_as(ours) if not isinstance(ref, torch.Tensor) or \
        ref.shape != ours.shape else ref
    torch.testing.assert_close(ours, ref.to(ours.dtype), rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


# ---- per-step equality ---------------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [[0], [5], [8], [9], [0, 5, 8, 9, 9, 0]], ids=["sigma1", "mid", "second_last",
                                                                               "last", "mixed"])
def test_sde_step_equals_flow_grpo(steps):
    sigmas = sd35_sigmas()
    sigma, nxt = per_row(sigmas, steps)
    x, v, noise = inputs(len(steps))
    sampler = SDESampler(kind="sde", noise_level=0.7)
    ours = stochastic_step(sampler, x, v, sigma, nxt, sigmas[1], noise=noise)
    sample, lp, mean, std_dev_t = ref_flow_grpo_sde(v, x, sigma, nxt, sigmas[1].item(), 0.7, noise=noise)
    close(ours.sample, sample, "sample")
    close(ours.mean, mean, "mean")
    close(ours.log_prob, lp, "log_prob")
    close(ours.std_t, std_dev_t.flatten(), "std_t")
    close(ours.std, (std_dev_t * torch.sqrt(sigma - nxt)).flatten(), "std")
    replay = stochastic_step(sampler, x, v, sigma, nxt, sigmas[1], sample=ours.sample)
    _, lp_given, _, _ = ref_flow_grpo_sde(v, x, sigma, nxt, sigmas[1].item(), 0.7, sample=sample)
    close(replay.log_prob, lp_given, "replayed log_prob")


@pytest.mark.parametrize("steps", [[0], [5], [8], [9], [0, 5, 8, 9, 9, 0]], ids=["sigma1", "mid", "second_last",
                                                                               "last", "mixed"])
def test_cps_step_equals_flow_grpo_and_flow_cps(steps):
    sigmas = sd35_sigmas()
    sigma, nxt = per_row(sigmas, steps)
    x, v, noise = inputs(len(steps), seed=1)
    ours = stochastic_step(CPSSampler(kind="cps", noise_level=0.8), x, v, sigma, nxt, sigmas[1], noise=noise)
    sample, lp, mean, std = ref_flow_grpo_cps(v, x, sigma, nxt, 0.8, noise=noise)
    close(ours.sample, sample, "sample")
    close(ours.mean, mean, "mean")
    close(ours.log_prob, lp, "log_prob")
    close(ours.std, std.flatten(), "std")
    close(ours.std_t, std.flatten(), "std_t")  # CPS's std_dev_t is the transition std


@pytest.mark.parametrize("steps", [[0], [5], [8], [9], [0, 5, 8, 9, 9, 0]], ids=["sigma1", "mid", "second_last",
                                                                               "last", "mixed"])
def test_dance_sde_step_equals_dance_grpo(steps):
    sigmas = sd35_sigmas()
    sigma, nxt = per_row(sigmas, steps)
    x, v, noise = inputs(len(steps), seed=2)
    ours = stochastic_step(DanceSDESampler(kind="dance_sde", eta=0.3), x, v, sigma, nxt, sigmas[1], noise=noise)
    for row, index in enumerate(steps):  # DanceGRPO steps one sigma index per call
        one = slice(row, row + 1)
        sample, lp, mean, std = ref_dance_sde(v[one], x[one], sigmas, index, 0.3, noise=noise[one])
        close(ours.sample[one], sample, f"sample, step {index}")
        close(ours.mean[one], mean, f"mean, step {index}")
        close(ours.log_prob[one], lp, f"log_prob, step {index}")
        close(ours.std[one], std, f"std, step {index}")
    close(ours.std_t, 0.3, "std_t")


def test_cps_gaussian_log_prob_is_an_explicit_option():
    sigmas = sd35_sigmas()
    sigma, nxt = per_row(sigmas, [3, 8])
    x, v, noise = inputs(2, seed=3)
    flow = stochastic_step(CPSSampler(kind="cps"), x, v, sigma, nxt, sigmas[1], noise=noise)
    full = stochastic_step(CPSSampler(kind="cps", log_prob="gaussian"), x, v, sigma, nxt, sigmas[1], noise=noise)
    expected = torch.distributions.Normal(full.mean, full.std.view(-1, 1, 1, 1)).log_prob(full.sample).mean((1, 2, 3))
    close(full.log_prob, expected, "gaussian log_prob")
    # the Gaussian's log-density is the constant-free form over 2 std^2, plus constants
    close(full.log_prob, flow.log_prob / (2 * full.std**2) - torch.log(full.std) - 0.5 * math.log(2 * math.pi),
          "gaussian vs squared error")
    with pytest.raises(ValueError, match="std 0"):
        CPSSampler(kind="cps", log_prob="gaussian", include_last=True)


def test_stepper_draws_and_scores_with_the_official_arithmetic():
    sigmas = sd35_sigmas()
    x, v, _ = inputs(3, seed=4)
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    mask = torch.ones(3, 10, dtype=torch.bool)
    stepper = StochasticStepper(SDESampler(kind="sde"), sigmas, mask, gens)
    for i in STEPS:
        out = stepper.step({"latents": x}, {"latents": v}, i)
        sigma, nxt = per_row(sigmas, [i] * 3)
        _, lp, mean, std_dev_t = ref_flow_grpo_sde(v, x, sigma, nxt, sigmas[1].item(), 0.7, sample=out.next["latents"])
        close(out.log_prob, lp, f"log_prob, step {i}")
        close(out.mean["latents"], mean, f"mean, step {i}")
        close(out.std_t["latents"], std_dev_t.flatten(), f"std_t, step {i}")
        scored = stepper.score({"latents": x}, {"latents": v}, i, out.next)
        assert torch.equal(scored.log_prob, out.log_prob)


def test_two_streams_score_separately_and_sum():
    sigmas = sd35_sigmas()
    gen = torch.Generator().manual_seed(5)
    x = {"video": torch.randn(2, 4, 3, 3, generator=gen), "audio": torch.randn(2, 8, 5, generator=gen)}
    v = {s: torch.randn(t.shape, generator=gen) for s, t in x.items()}
    stepper = StochasticStepper(SDESampler(kind="sde"), sigmas, torch.ones(2, 10, dtype=torch.bool),
                                [torch.Generator().manual_seed(s) for s in range(2)])
    out = stepper.step(x, v, 4)
    assert set(out.stream_log_probs) == {"video", "audio"}
    assert torch.equal(out.log_prob, out.stream_log_probs["video"] + out.stream_log_probs["audio"])
    for s in x:
        one = StochasticStepper(SDESampler(kind="sde"), sigmas, torch.zeros(0, 0, dtype=torch.bool), [])
        alone = one.score({s: x[s]}, {s: v[s]}, 4, {s: out.next[s]})
        assert torch.equal(alone.log_prob, out.stream_log_probs[s])


# ---- KL ------------------------------------------------------------------------------------------------

def test_kl_equals_flow_grpos_kl_term():
    sigmas = sd35_sigmas()
    x, v, noise = inputs(4, seed=6)
    v_ref = v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(7))
    steps = [0, 3, 5, 8]
    sigma, nxt = per_row(sigmas, steps)
    sampler = SDESampler(kind="sde")
    new = stochastic_step(sampler, x, v, sigma, nxt, sigmas[1], noise=noise)
    ref = stochastic_step(sampler, x, v_ref, sigma, nxt, sigmas[1], sample=new.sample)

    def replay(t):
        return Replay(t.log_prob[:, None], {"latents": t.log_prob[:, None]}, {"latents": t.mean[:, None]},
                      {"latents": t.std[:, None]}, {"latents": t.std_t[:, None]})

    ours = kl(replay(new), replay(ref))
    assert ours.shape == (4, 1)
    # Flow-GRPO: ((mean - mean_ref)^2).mean over C, H, W / (2 std_dev_t^2), std_dev_t without sqrt(-dt)
    _, _, mean, std_dev_t = ref_flow_grpo_sde(v, x, sigma, nxt, sigmas[1].item(), 0.7, noise=noise)
    _, _, mean_ref, _ = ref_flow_grpo_sde(v_ref, x, sigma, nxt, sigmas[1].item(), 0.7, noise=noise)
    theirs = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
    close(ours[:, 0], theirs.flatten(), "kl per sample")
    close(ours.mean(), theirs.mean(), "kl_loss")
    plain = kl(replay(new), replay(ref), normalize=False)  # Flow-CPS: no division
    close(plain[:, 0], ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)), "unnormalised kl")
    with pytest.raises(TypeError, match="reference"):
        kl(replay(new), {"latents": mean_ref})


# ---- schedules and windows on real pipelines ------------------------------------------------------------

@pytest.fixture(scope="module")
def digits():
    return omnispec.build(SPECS / "digits.yaml", overrides=["runtime.progress=false", "recipe.defaults.steps=6",
                                                            "recipe.phases.0.guidance.terms=[]"])


def test_one_step_schedule_uses_flow_grpos_guard(digits):
    with pytest.raises(SpecError, match="include_last"):
        digits.rollout("one", sampler={"kind": "sde"}, steps=1)
    ro = digits.rollout("one", group_size=2, sampler={"kind": "sde", "include_last": True}, steps=1)
    assert ro.step_indices.tolist() == [[0], [0]]
    assert torch.isfinite(ro.log_probs).all() and torch.isfinite(ro.latents).all()
    replay = digits.log_prob(ro, grad=False)
    # guard = sigmas[1] = 0: std_dev_t = eta sqrt(1 / (1 - 0)) = eta, the transition std eta sqrt(1)
    assert torch.allclose(replay.std_t["latents"], torch.full((2, 1), 0.7))
    assert torch.allclose(replay.transition_stds["latents"], torch.full((2, 1), 0.7))
    assert torch.equal(replay.log_probs.cpu(), ro.log_probs)


def test_default_window_leaves_the_last_step_deterministic(digits):
    default = digits.rollout("two", group_size=2, seed=3, sampler={"kind": "sde"})
    assert default.window == 5 and default.step_indices[0].tolist() == [0, 1, 2, 3, 4]
    every = digits.rollout("two", group_size=2, seed=3, sampler={"kind": "sde", "include_last": True})
    assert every.window == 6 and every.step_indices[0, -1].item() == 5
    assert torch.equal(every.latents[:, :6], default.latents)  # same noise up to the last step
    # the default's last step is Euler to sigma = 0; decoding the x0 estimate gives the same image
    x0 = digits.rollout("two", group_size=2, seed=3, sampler={"kind": "sde", "decode": "x0"})
    assert (x0.array == default.array).all()


def test_x0_decode_of_a_stochastic_last_step_is_the_euler_result(digits):
    noisy = digits.rollout("nine", group_size=2, seed=5, sampler={"kind": "dance_sde", "include_last": True})
    clean = digits.rollout("nine", group_size=2, seed=5, sampler={"kind": "dance_sde", "include_last": True,
                                                                  "decode": "x0"})
    assert torch.equal(noisy.latents, clean.latents) and torch.equal(noisy.log_probs, clean.log_probs)
    euler = digits.rollout("nine", group_size=2, seed=5, sampler={"kind": "dance_sde"})  # last step Euler
    assert torch.equal(euler.latents, clean.latents[:, :-1])
    assert abs(clean.array - euler.array).max() < 1e-5  # DanceGRPO: x - sigma v of the last step is the image
    assert abs(noisy.array - euler.array).max() > 1e-3  # the noisy final state is not


def test_sd35_rollout_steps_the_checkpoint_scheduler_sigmas(sd3_dir):
    from omnispec.runtime.run import Run
    from omnispec.testing import TINY_OVERRIDES

    sd3 = omnispec.build(SPECS / "sd3.5-medium.yaml", source=str(sd3_dir), overrides=TINY_OVERRIDES["sd3"])
    expected = sd35_sigmas(10)  # what Flow-GRPO's SD3 pipeline steps (retrieve_timesteps on the checkpoint's)
    flow_grpo_table = [1.0, 0.960129, 0.913349, 0.857692, 0.790368, 0.707278, 0.602151, 0.464876, 0.278049, 0.008929]
    assert torch.allclose(expected[:-1], torch.tensor(flow_grpo_table), atol=1e-6)
    walk = Run(sd3, sd3.request("a cat", steps=10)).walks[0]
    assert torch.equal(walk.steps.sigmas.cpu(), expected)
    assert torch.equal(walk.steps.timesteps.cpu().float(), expected[:-1] * 1000)
    ro = sd3.rollout("a cat", group_size=2, steps=10, sampler={"kind": "sde"})
    assert torch.equal(ro.sigmas[0], expected[:9]) and torch.equal(ro.timesteps[0], expected[:9] * 1000)
    ratio = (sd3.log_prob(ro, grad=False, micro_batch=1).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-6
