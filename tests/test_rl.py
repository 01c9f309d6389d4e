"""RL: SDE samplers, rollouts, exact replay, windows, weight sync, on the embedded digits model."""

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

import omnispec
from omnispec.rl import reference, scale_lora, set_lora, update_weights
from omnispec.runtime.samplers import stochastic_step, window_mask
from omnispec.spec import SpecError
from omnispec.spec.recipe import CPSSampler, DanceSDESampler, SDESampler

from conftest import SPECS

SAMPLERS = [{"kind": "sde", "noise_level": 0.7}, {"kind": "cps", "noise_level": 0.8}, {"kind": "dance_sde", "eta": 0.3}]


@pytest.fixture(scope="module")
def pipe():
    return omnispec.build(SPECS / "digits.yaml", overrides=["runtime.progress=false", "recipe.defaults.steps=8"])


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: s["kind"])
def test_replay_ratio_is_one_at_every_step_with_another_micro_batch(pipe, sampler):
    ro = pipe.rollout(["seven", "two"], group_size=3, seed=4, sampler=sampler)
    assert ro.latents.dtype == torch.float32 and ro.latents.shape[:2] == (6, ro.window + 1)
    assert ro.log_probs.shape == ro.sigmas.shape == ro.timesteps.shape == (6, ro.window)
    for micro in (1, 4, None):  # valued as the rollout's forwards of 6 ran (``exact``): the ratio is 1 exactly
        replay = pipe.log_prob(ro, grad=True, micro_batch=micro)
        assert replay.log_probs.requires_grad is False or replay.log_probs.grad_fn is not None
        ratio = torch.exp(replay.log_probs.detach().cpu() - ro.log_probs)
        assert (ratio - 1).abs().max().item() == 0.0


def test_shards_of_other_sizes_concatenated_replay_exactly(pipe):
    """A pool's rollout is its workers' shards, each stepped at its own size: each sample keeps its shard's forward
    size, and the replay values each shard's samples as that shard's forwards ran."""
    from omnispec.rl.pool import concat_rollouts

    sde = {"kind": "sde", "noise_level": 0.7}
    parts = [pipe.rollout(["seven"], group_size=3, seed=4, sampler=sde),
             pipe.rollout(["two"], group_size=1, seed=4, sampler=sde, sample_offset=3)]
    whole = concat_rollouts(parts)
    assert whole.forward_batch.tolist() == [3, 3, 3, 1]
    replay = pipe.log_prob(whole, grad=True, micro_batch=2)
    assert torch.equal(replay.log_probs.detach().cpu(), whole.log_probs)


def test_replay_has_gradients_for_trainable_weights(pipe):
    from peft import LoraConfig

    dit = pipe.components["transformer"]
    dit.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]), adapter_name="probe")
    try:
        ro = pipe.rollout("three", group_size=2, sampler=SAMPLERS[0])
        pipe.log_prob(ro, steps=[0]).log_probs.sum().backward()
        grads = [p.grad for n, p in dit.named_parameters() if "lora" in n and p.requires_grad]
        assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)
    finally:
        dit.delete_adapters("probe")


@pytest.mark.parametrize("cls, params", [(SDESampler, {"noise_level": 1e-7}), (CPSSampler, {"noise_level": 1e-7}),
                                         (DanceSDESampler, {"eta": 1e-7})])
def test_vanishing_noise_recovers_the_euler_step(cls, params):
    sampler = cls(kind=cls.model_fields["kind"].annotation.__args__[0], **params)
    x, v = torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 4)
    sigma, nxt = torch.full((2, 1, 1, 1), 0.6), torch.full((2, 1, 1, 1), 0.45)
    step = stochastic_step(sampler, x, v, sigma, nxt, torch.tensor(0.9), noise=torch.zeros_like(x))
    assert torch.allclose(step.mean, x + (nxt - sigma) * v, atol=1e-5)


def test_log_prob_is_the_gaussian_density_averaged_over_pixels():
    sampler = SDESampler(kind="sde", noise_level=0.7)
    x, v, noise = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    sigma, nxt = torch.full((3, 1, 1, 1), 0.5), torch.full((3, 1, 1, 1), 0.4)
    step = stochastic_step(sampler, x, v, sigma, nxt, torch.tensor(0.9), noise=noise)
    expected = torch.distributions.Normal(step.mean, step.std.view(-1, 1, 1, 1)).log_prob(step.sample).mean((1, 2, 3))
    assert torch.allclose(step.log_prob, expected, atol=1e-5)
    std_t = math.sqrt(0.5 / 0.5) * 0.7
    assert step.std_t[0].item() == pytest.approx(std_t, rel=1e-6)
    assert step.std[0].item() == pytest.approx(std_t * math.sqrt(0.1), rel=1e-5)


def test_flow_grpo_guard_at_sigma_one():
    step = stochastic_step(SDESampler(kind="sde"), torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2),
                           torch.ones(1, 1, 1, 1), torch.full((1, 1, 1, 1), 0.9), torch.tensor(0.9),
                           noise=torch.randn(1, 1, 2, 2))
    assert torch.isfinite(step.log_prob).all() and torch.isfinite(step.sample).all()


def test_windows_by_scope():
    groups = torch.tensor([0, 0, 1, 1])
    fixed = window_mask(SDESampler(kind="sde", window={"kind": "fixed", "start": 2, "length": 3}), 8, groups, 0)
    assert fixed.sum(1).tolist() == [3] * 4 and fixed[:, 2:5].all()
    per_group = window_mask(SDESampler(kind="sde", window={"kind": "random", "length": 2, "high": 6, "scope": "group"}),
                            8, groups, 0)
    assert torch.equal(per_group[0], per_group[1]) and torch.equal(per_group[2], per_group[3])
    per_sample = [window_mask(SDESampler(kind="sde", window={"kind": "random", "length": 2, "high": 6,
                                                             "scope": "sample"}), 8, torch.arange(16), s)
                  for s in range(2)]
    assert len({tuple(r.nonzero().flatten().tolist()) for r in per_sample[0]}) > 1
    assert not torch.equal(per_sample[0], per_sample[1])  # a new draw per rollout seed
    for cls in (SDESampler, CPSSampler, DanceSDESampler):  # the last step stays deterministic by default
        kind = cls.model_fields["kind"].annotation.__args__[0]
        assert window_mask(cls(kind=kind), 8, groups, 0).sum(1).tolist() == [7] * 4
        assert window_mask(cls(kind=kind, include_last=True), 8, groups, 0).all()
    with pytest.raises(SpecError, match="window"):
        window_mask(SDESampler(kind="sde", window={"kind": "fixed", "start": 6, "length": 4}), 8, groups, 0)
    with pytest.raises(SpecError, match="include_last"):
        window_mask(SDESampler(kind="sde", window={"kind": "fixed", "start": 5, "length": 3}), 8, groups, 0)
    assert window_mask(SDESampler(kind="sde", include_last=True, window={"kind": "fixed", "start": 5, "length": 3}),
                       8, groups, 0)[:, 5:].all()


def test_steps_outside_the_window_store_nothing_and_are_deterministic(pipe):
    sampler = {"kind": "sde", "window": {"kind": "fixed", "start": 3, "length": 2}}
    a = pipe.rollout("five", group_size=2, seed=1, sampler=sampler)
    assert a.window == 2 and a.step_indices.tolist() == [[3, 4], [3, 4]]
    # the states before the window are the ODE's: same initial noise -> same first stored state
    b = pipe.rollout("five", group_size=2, seed=1, sampler={"kind": "sde", "noise_level": 0.1,
                                                             "window": {"kind": "fixed", "start": 3, "length": 2}})
    assert torch.equal(a.latents[:, 0], b.latents[:, 0])


def test_group_noise_shared_or_distinct(pipe):
    sampler = {"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 2}}
    shared = pipe.rollout("one", group_size=3, seed=2, sampler=sampler, shared_noise=True)
    assert torch.equal(shared.latents[0, 0], shared.latents[1, 0])
    assert not torch.equal(shared.latents[0, 1], shared.latents[1, 1])  # SDE noise still differs
    distinct = pipe.rollout("one", group_size=3, seed=2, sampler=sampler)
    assert not torch.equal(distinct.latents[0, 0], distinct.latents[1, 0])


def test_batched_rollout_equals_separate_rollouts(pipe):
    both = pipe.rollout(["one", "eight"], group_size=2, seed=10, sampler=SAMPLERS[0])
    first = pipe.rollout(["one"], group_size=2, seed=10, sampler=SAMPLERS[0])
    assert torch.allclose(both.latents[:2], first.latents, atol=1e-5)
    assert torch.allclose(both.log_probs[:2], first.log_probs, atol=1e-5)
    assert both.group_ids.tolist() == [0, 0, 1, 1]


def test_guidance_plan_applies_during_rollout(pipe):
    rows = {"n": 0}
    h = pipe.components["transformer"].register_forward_pre_hook(
        lambda m, a, kw: rows.__setitem__("n", rows["n"] + kw["hidden_states"].shape[0]), with_kwargs=True)
    try:
        pipe.rollout("four", group_size=2, sampler=SAMPLERS[0])
    finally:
        h.remove()
    assert rows["n"] == 8 * 2 * 2  # 8 steps x (cond + uncond) x 2 samples


def test_repeated_prompts_are_encoded_once(pipe):
    calls = {"n": 0}
    h = pipe.components["text_encoder"].register_forward_pre_hook(lambda m, a: calls.__setitem__("n", calls["n"] + 1))
    try:
        pipe.rollout(["the digit 6", "the digit 6", "the digit 9"], group_size=4, sampler=SAMPLERS[0])
        first = calls["n"]
        pipe.rollout(["the digit 6", "the digit 6", "the digit 9"], group_size=4, sampler=SAMPLERS[0])
        second = calls["n"]
        pipe.rollout(["the digit 6", "the digit 5"], group_size=2, sampler=SAMPLERS[0])
    finally:
        h.remove()
    assert first in (1, 2)  # the unique positives in one batch (+ the negative prompt unless cached)
    assert second == first  # the same prompts again: nothing re-encoded
    assert calls["n"] == second + 1  # a new prompt set: one batched encode, negative cached


def test_sde_rollouts_refuse_multistep_schedulers(wan_dir):
    from omnispec.testing import TINY_OVERRIDES

    wan = omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(wan_dir), overrides=TINY_OVERRIDES["wan"])
    with pytest.raises(SpecError, match="UniPCMultistepScheduler is a multistep solver"):
        wan.rollout("a cat", sampler={"kind": "sde"}, steps=2)


def test_weight_sync_full_weights_and_versions(pipe):
    dit = pipe.components["transformer"]
    name, param = "proj_out.bias", dict(dit.named_parameters())["proj_out.bias"]
    saved, version = param.detach().clone(), pipe.weight_version
    before = pipe("seven", seed=0, steps=2).array
    try:
        assert update_weights(pipe, [(name, saved + 0.5)]) == 1
        assert pipe.weight_version == version + 1
        assert not np.allclose(pipe("seven", seed=0, steps=2).array, before)
        with pytest.raises(SpecError, match="no parameter"):
            update_weights(pipe, [("nope", saved)])
    finally:
        update_weights(pipe, [(name, saved)])
    assert np.array_equal(pipe("seven", seed=0, steps=2).array, before)


def test_lora_add_replace_scale_and_reference(pipe):
    from peft import LoraConfig, get_peft_model_state_dict

    from src_models.digits.model import DigitsDiT

    donor = DigitsDiT.from_config(pipe.components["transformer"].config)
    donor.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights=False),
                      adapter_name="d")
    state = get_peft_model_state_dict(donor, adapter_name="d")
    meta = {"r": 2, "lora_alpha": 2, "target_modules": ["to_q", "to_v"]}
    base = pipe("two", seed=0, steps=2).array
    set_lora(pipe, "policy", state, metadata=meta)
    try:
        on = pipe("two", seed=0, steps=2).array
        assert not np.allclose(on, base)
        with reference(pipe):
            assert np.array_equal(pipe("two", seed=0, steps=2).array, base)
        scale_lora(pipe, "policy", 0.0)
        assert np.abs(pipe("two", seed=0, steps=2).array - base).max() < 1e-6
        set_lora(pipe, "policy", state, scale=1.0, metadata=meta)  # replace by name
        assert np.abs(pipe("two", seed=0, steps=2).array - on).max() < 1e-6
    finally:
        pipe.components["transformer"].delete_adapters("policy")


def test_grpo_example_raises_the_reward_within_seconds():
    import sys

    sys.path.insert(0, str(SPECS.parent / "examples"))
    import grpo_digits

    history = grpo_digits.train(iterations=20, kl=0.01, log=lambda s: None)
    for row in history:
        assert {"reward", "ratio_mean", "ratio_max_dev", "clip_fraction", "kl"} <= set(row)
        assert 0 <= row["reward"] <= 1 and abs(row["ratio_mean"] - 1) < 1e-2
    rewards = [row["reward"] for row in history]
    assert np.mean(rewards[-5:]) - np.mean(rewards[:5]) > 0.04  # measured: 0.766 -> 0.851 (kl 0)


# torchao's per-row fp8 takes bfloat16 weights only
QUANTIZED_BASES = [("int8_dynamic", "cpu", "none"),
                   pytest.param("fp8_dynamic, granularity: row", "cuda", "none", marks=pytest.mark.gpu),
                   pytest.param("fp8_dynamic, granularity: row", "cuda", "regional", marks=pytest.mark.gpu)]


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
@pytest.mark.parametrize("method, device, compile_mode", QUANTIZED_BASES, ids=["int8", "fp8-cuda", "fp8-cuda-compiled"])
def test_a_lora_over_a_dynamically_quantized_base_gets_gradients_and_replays_exactly(method, device, compile_mode):
    """torchao's dynamic-activation linears compute no input gradient (int8 cuts the graph at the activation's
    quantization, fp8's _scaled_mm has no derivative): a LoRA on block 0 under such a base would get none from
    the blocks above it. Through QuantizedLinear it gets about what the dequantized base gives, and the replay's
    log-probs, with gradients or without, equal the rollout's (the rollout of GRPO over an fp8 base)."""
    from peft import LoraConfig

    from omnispec.policies.quantization import dequantized

    dtype = "bfloat16" if method.startswith("fp8") else "float32"
    overrides = ["runtime.progress=false", "recipe.defaults.steps=4", f"runtime.device={device}",
                 f"model.dtype={dtype}"]
    lora = LoraConfig(r=2, lora_alpha=2, target_modules=["blocks.0.attn.to_q"], init_lora_weights=False)
    quantized = omnispec.build(SPECS / "digits.yaml", overrides=[
        *overrides, f"policies.quantization={{transformer: {{method: {method}}}}}",
        f"policies.compile.mode={compile_mode}"])
    dit = quantized.components["transformer"]
    assert type(dit.blocks[1].attn.to_out[0]).__name__ == "QuantizedLinear"
    torch.manual_seed(0)
    dit.add_adapter(lora)
    ro = quantized.rollout("three", group_size=2, seed=0, sampler=SAMPLERS[0])
    no_grad = (quantized.log_prob(ro, grad=False).log_probs.cpu() - ro.log_probs).abs().max().item()
    assert no_grad == 0.0, f"replay without gradients is {no_grad} off the rollout's log-probs"
    replay = quantized.log_prob(ro, steps=[0], grad=True)
    with_grad = (replay.log_probs.detach().cpu() - ro.log_probs[:, :1]).abs().max().item()
    assert with_grad == 0.0, f"replay with gradients is {with_grad} off the rollout's log-probs"
    replay.log_probs.sum().backward()
    got = torch.cat([p.grad.flatten() for n, p in dit.named_parameters() if "lora" in n])

    # the same LoRA over the dequantized weights in plain linears, replaying the same rollout
    plain = omnispec.build(SPECS / "digits.yaml", overrides=overrides)
    ref = plain.components["transformer"]
    for name, module in dit.named_modules():
        if type(module).__name__ == "QuantizedLinear":
            plain_linear = ref.get_submodule(name.removesuffix(".base_layer"))
            plain_linear.weight.data = dequantized(module.weight).to(plain_linear.weight.dtype)
    torch.manual_seed(0)
    ref.add_adapter(lora)
    ref.load_state_dict({n: p for n, p in dit.state_dict().items() if "lora" in n}, strict=False)
    plain.log_prob(ro, steps=[0], grad=True).log_probs.sum().backward()
    want = torch.cat([p.grad.flatten() for n, p in ref.named_parameters() if "lora" in n])
    # the forwards differ by the activations' quantization: int8 in float32 agreed to 0.9986 on the CPU, fp8 in
    # bfloat16 (e4m3 activations) to 0.9926 on the CPU's _scaled_mm
    cosine = torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=0).item()
    assert got.abs().sum() > 0 and cosine > (0.99 if dtype == "float32" else 0.95), cosine


@pytest.mark.parametrize("device, compile_mode", [
    ("cpu", "regional"), pytest.param("cuda", "none", marks=pytest.mark.gpu),
    pytest.param("cuda", "regional", marks=pytest.mark.gpu),
    pytest.param("cuda", "regional+cudagraphs", marks=pytest.mark.gpu),
    pytest.param("cuda", "full+cudagraphs", marks=pytest.mark.gpu),
    pytest.param("cuda", "regional+cudagraphs+flash4", marks=pytest.mark.gpu)])
def test_replay_with_gradients_equals_the_rollout_in_bfloat16(device, compile_mode):
    """What a trainer's first ratio reads: log-probs replayed with gradients (a LoRA training) against the
    rollout's, in bfloat16. Compiled, the training graphs a replay with gradients runs fuse other kernels than the
    inference graphs a rollout runs; here without ``eager_rounding`` they keep other intermediates in float32
    (about 1e-3 off on the CPU), and a replay takes its values from a forward without gradients (``exact``). With
    CUDA graphs the rollout's forwards start a graph generation each and the replay's with gradients none (a whole
    compiled denoiser on the CPU took a minute here: those cases run on CUDA only). ``flash4``: FlashAttention-4
    compiled in, its backward the operator's registered one."""
    from peft import LoraConfig

    mode, *options = compile_mode.split("+")
    compiled = mode != "none"
    if "flash4" in options:
        pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed")
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=[
        "runtime.progress=false", "recipe.defaults.steps=4", f"runtime.device={device}", "model.dtype=bfloat16",
        f"policies.compile.mode={mode}",
        *("policies.attention.default=flash4" if option == "flash4" else f"policies.compile.{option}=true"
          for option in options),
        *(["policies.compile.eager_rounding=false"] if compiled else [])])
    torch.manual_seed(0)
    pipe.components["transformer"].add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"],
                                                          init_lora_weights=False))
    ro = pipe.rollout(["seven", "two"], group_size=2, seed=0, sampler=SAMPLERS[0])
    for micro in (None, 1):
        replay = pipe.log_prob(ro, grad=True, micro_batch=micro)
        assert replay.log_probs.grad_fn is not None
        off = (replay.log_probs.detach().cpu() - ro.log_probs).abs().max().item()
        assert off == 0.0, f"micro-batch {micro}: replay with gradients is {off} off the rollout's log-probs"
    replay.log_probs.sum().backward()
    grads = [p.grad for n, p in pipe.components["transformer"].named_parameters() if "lora" in n]
    assert all(g is not None and g.abs().sum() > 0 for g in grads), "the LoRA got no gradient through the replay"
    if compiled and device == "cpu":  # what ``exact`` is for: the training graphs' own values are off
        one_forward = pipe.log_prob(ro, grad=True, exact=False).log_probs.detach().cpu()
        assert (one_forward - ro.log_probs).abs().max().item() > 0, \
            "the training graphs now compute the rollout's values: this case no longer tests exact=True"


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", ["regional+cudagraphs", "full+cudagraphs"])
def test_gradients_accumulated_over_replays_under_cuda_graphs_are_those_without(compile_mode):
    """A trainer's gradient accumulation: two replays with gradients, a backward after each, into the same LoRA
    grads. Under CUDA graphs a backward's outputs live in graph memory, which the next replay's new generation may
    reuse (the graph trees' "gradient tensor output ... overwritten"); the grads must be those of the same
    compiled pipeline without graphs, which runs the same kernels."""
    from peft import LoraConfig

    mode, *options = compile_mode.split("+")

    def grads(*overrides):
        pipe = omnispec.build(SPECS / "digits.yaml", overrides=[
            "runtime.progress=false", "recipe.defaults.steps=4", "runtime.device=cuda", "model.dtype=bfloat16",
            f"policies.compile.mode={mode}", *overrides])
        torch.manual_seed(0)
        pipe.components["transformer"].add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"],
                                                              init_lora_weights=False))
        ro = pipe.rollout(["seven", "two", "three", "five"], group_size=1, seed=0, sampler=SAMPLERS[0])
        for rows in (slice(0, 2), slice(2, 4)):
            pipe.log_prob(ro, grad=True).log_probs[rows].sum().backward()
        return [p.grad.float().cpu() for n, p in pipe.components["transformer"].named_parameters() if "lora" in n]

    plain = grads()
    graphs = grads(*(f"policies.compile.{option}=true" for option in options))
    assert all(g.abs().sum() > 0 for g in plain)
    for got, want in zip(graphs, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)  # bf16 grads; overwritten memory is far off


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_rows_log_prob_is_the_same_bits_whatever_rows_are_scored_with_it(device):
    """A replay scores a sample in another micro-batch than its rollout did, and a trainer's ratio reads the
    difference: each row's log-prob must not depend on the batch around it (on an H200 a batch-wide reduction
    put a row of 4 one float32 ulp off the same row alone). Shapes: latents of images and of a video, one of them
    of an odd element count, so rows of a batch start at unaligned addresses."""
    from omnispec.runtime.samplers import gaussian_log_prob

    g = torch.Generator().manual_seed(0)
    for shape in [(16, 64, 64), (4, 8, 8), (16, 5, 30, 52), (3, 7, 11)]:
        sample, mean = (torch.randn(8, *shape, generator=g).to(device) for _ in range(2))
        std = torch.rand(8, *[1] * len(shape), generator=g).add(0.1).to(device)
        batch = gaussian_log_prob(sample, mean, std).cpu()
        for lo, hi in [(0, 1), (3, 4), (1, 5), (7, 8), (2, 8)]:
            alone = gaussian_log_prob(sample[lo:hi], mean[lo:hi], std[lo:hi]).cpu()
            assert torch.equal(alone, batch[lo:hi]), (shape, lo, hi, (alone - batch[lo:hi]).abs().max().item())


def test_grpo_example_runs_from_any_folder_and_names_a_missing_package_before_training(tmp_path):
    """Copied out of the repository, it runs (the bundled spec by name, the reward from the installed package); a
    --plot without matplotlib is one error line before any training."""
    import shutil
    import subprocess
    import sys

    from conftest import cpu_env

    example = shutil.copy(SPECS.parent / "examples" / "grpo_digits.py", tmp_path)
    env = cpu_env(OMP_NUM_THREADS="1")
    ran = subprocess.run([sys.executable, example, "--iterations", "1", "--prompts", "1", "--group", "2",
                          "--steps", "2", "--window", "1", "--out", "log.json"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert json.loads((tmp_path / "log.json").read_text())["history"]
    if importlib.util.find_spec("matplotlib") is None:
        refused = subprocess.run([sys.executable, example, "--plot", "reward.png"], capture_output=True, text=True,
                                 cwd=tmp_path, env=env, timeout=60)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
            "error: this example needs matplotlib: pip install 'omnispec-diffusion[examples]'"]
