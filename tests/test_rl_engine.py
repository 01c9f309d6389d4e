"""RolloutEngine driven by a toy trainer (this process) on a local Ray cluster: 2 CPU workers of the digits model.

Ray is the ``ray`` extra, not in ``dev``: the engine's tests skip without it; the bucket tests run everywhere.
"""

import pytest
import torch

import omnispec
from omnispec.rl.buckets import Assembler, to_buckets

from conftest import ROOT, SPECS

# one thread in every process: a CPU matmul's sums follow the thread count, which a build otherwise takes from the free
# cores of the moment, so the trainer and the workers could round differently
OVERRIDES = ["runtime.progress=false", "recipe.defaults.steps=4", "runtime.threads=1"]
# windows the same for every sample of a rollout, so its replay batches each step's rows as the rollout did (a
# per-sample random window regroups them, and a CPU forward of another batch size can differ in the last bit)
SDE = {"kind": "sde", "window": {"kind": "random", "length": 2, "high": 2, "scope": "batch"}}
CPS = {"kind": "cps", "window": {"kind": "fixed", "start": 0, "length": 2}}
LORA = {"r": 4, "lora_alpha": 4, "target_modules": ["to_q", "to_v"]}


# ---- buckets (no Ray) -------------------------------------------------------------------------------------------

def test_buckets_split_tensors_and_put_them_back():
    state = {"a": torch.randn(10, 3), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, dtype=torch.bfloat16),
             "empty": torch.zeros(0, 4)}
    buckets = list(to_buckets(state.items(), bucket_bytes=32))
    assert all(sum(p.nbytes for p in b) <= 32 for b in buckets)
    assert len([p for b in buckets for p in b if p.name == "a"]) == 4  # 120 bytes over 4 buckets
    got = {}
    assembler = Assembler()
    for bucket in reversed(buckets):  # any order
        got.update(assembler.add(bucket))
    assert assembler.incomplete() == []
    assert set(got) == set(state)
    for name, tensor in state.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
    partial = Assembler()
    partial.add(buckets[0])
    assert partial.incomplete() == ["a"]


def test_bucket_size_is_checked():
    with pytest.raises(omnispec.SpecError, match="bucket_bytes"):
        list(to_buckets([("a", torch.ones(2))], 8))
    with pytest.raises(TypeError, match="bucket_bytes"):
        list(to_buckets([("a", torch.ones(2))], 1.5))


def test_a_closing_worker_drops_its_pipeline_and_staged_weights():
    """What ``shutdown`` asks of each worker before the kill (no Ray: the worker class in this process)."""
    import gc
    import weakref

    from omnispec.rl.engine import _EngineWorker

    worker = _EngineWorker(str(SPECS / "digits.yaml"), {"overrides": OVERRIDES})
    denoiser = weakref.ref(worker.pipe.components["transformer"])
    answer = worker.close()
    gc.collect()
    assert worker.pipe is None and worker.staged is None and denoiser() is None
    assert set(answer) == {"allocated_bytes", "reserved_bytes"}


# ---- the engine -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    ray = pytest.importorskip("ray")
    from omnispec.rl.engine import RolloutEngine

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    e = RolloutEngine(str(SPECS / "digits.yaml"), num_workers=2, bucket_bytes=4096, overrides=OVERRIDES)
    yield e
    e.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def trainer():
    return omnispec.build(SPECS / "digits.yaml", overrides=OVERRIDES)


def _exact_ratio(trainer, ro) -> None:
    """The trainer's replay of the engine's rollout: log-probs equal bit for bit (ratio exactly 1)."""
    new = trainer.log_prob(ro, grad=False)
    assert torch.equal(new.log_probs, ro.log_probs), (new.log_probs - ro.log_probs).abs().max()
    assert torch.equal((new.log_probs - ro.log_probs).exp(), torch.ones_like(ro.log_probs))


def test_batches_queue_and_come_back_in_request_order(engine, trainer):
    first = engine.submit([
        {"prompts": ["one", "two", "three"], "group_size": 2, "seed": 3, "sampler": SDE},
        {"prompts": "seven", "group_size": 3, "seed": 5, "sampler": CPS, "steps": 3},
    ])
    second = engine.submit([{"prompts": ["four"], "group_size": 2, "seed": 1, "sampler": SDE},
                            {"prompts": ["five", "six"], "seed": 2, "sampler": SDE, "shared_noise": True}])
    later, earlier = engine.get(second), engine.get(first)  # collected in any order
    assert [ro.prompts for ro in earlier] == [["one", "one", "two", "two", "three", "three"], ["seven"] * 3]
    assert [ro.prompts for ro in later] == [["four", "four"], ["five", "six"]]
    assert [ro.extra["worker"] for ro in earlier + later] == [0, 1, 1, 1]  # the least loaded so far (6, 3, 5 samples)
    assert earlier[1].log_probs.shape == (3, 2) and earlier[1].step_indices[0].tolist() == [0, 1]
    assert first.stats["samples"] == 9 and first.stats["samples_per_s"] > 0
    local = trainer.rollout(["one", "two", "three"], group_size=2, seed=3, sampler=SDE)
    assert earlier[0].seeds == local.seeds and earlier[0].group_ids.tolist() == local.group_ids.tolist()
    assert torch.equal(earlier[0].step_indices, local.step_indices)
    assert torch.equal(earlier[0].latents, local.latents) and torch.equal(earlier[0].log_probs, local.log_probs)
    for ro in earlier + later:
        assert ro.policy_version == engine.version
        _exact_ratio(trainer, ro)


def test_full_update_in_buckets_applies_between_rollouts(engine, trainer):
    transformer = trainer.components["transformer"]
    torch.manual_seed(0)
    with torch.no_grad():
        for p in transformer.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    state = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
    old = engine.version
    before = engine.submit([{"prompts": ["one", "two"], "group_size": 2, "seed": 0, "sampler": SDE}] * 3)
    report = engine.update_weights(state)  # queued behind the rollouts above
    after = engine.submit([{"prompts": ["one", "two"], "group_size": 2, "seed": 0, "sampler": SDE}])
    largest = max(v.numel() * v.element_size() for v in state.values())
    assert largest > engine.bucket_bytes and report.buckets > 3  # tensors split across buckets
    assert report.version == engine.version == old + 1 and report.tensors == len(state)
    assert report.bytes == sum(v.numel() * v.element_size() for v in state.values()) and report.gb_per_s > 0
    assert [ro.policy_version for ro in engine.get(before)] == [old] * 3
    (new,) = engine.get(after)
    assert new.policy_version == old + 1
    assert [s["version"] for s in engine.worker_states()] == [old + 1] * 2
    _exact_ratio(trainer, new)
    stale = engine.get(before)[0]  # rolled out by the old weights: the trainer's replay differs now
    assert not torch.equal(trainer.log_prob(stale, grad=False).log_probs, stale.log_probs)


def test_lora_update_in_buckets_and_its_version(engine, trainer):
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = trainer.components["transformer"]
    transformer.add_adapter(LoraConfig(**LORA), adapter_name="policy")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    state = get_peft_model_state_dict(transformer, adapter_name="policy")
    report = engine.set_lora("policy", state, metadata=LORA, version=engine.version + 5, bucket_bytes=1024)
    assert report.buckets > 1
    (ro,) = engine.rollout([{"prompts": ["three", "eight"], "group_size": 2, "seed": 4, "sampler": SDE}])
    assert ro.policy_version == report.version == engine.version
    _exact_ratio(trainer, ro)
    with pytest.raises(omnispec.SpecError, match="version"):
        engine.set_lora("policy", state, metadata=LORA, version=engine.version)  # not newer
    with pytest.raises(omnispec.SpecError, match="no parameter"):
        engine.update_weights({"no.such.weight": torch.zeros(2)})
    assert {s["version"] for s in engine.worker_states()} == {engine.version}  # nothing applied


def test_sleep_refuses_rollouts_takes_updates_and_wake_resumes(engine, trainer):
    engine.sleep()
    from omnispec.rl.engine import EngineAsleep

    with pytest.raises(EngineAsleep, match="wake"):
        engine.submit([{"prompts": "one", "sampler": SDE}])
    transformer = trainer.components["transformer"]
    bias = {"proj_out.bias": transformer.proj_out.bias.detach() + 0.01}
    with torch.no_grad():
        transformer.proj_out.bias.copy_(bias["proj_out.bias"])
    report = engine.update_weights(bias)  # lands in host memory while asleep
    assert all(s["asleep"] for s in engine.worker_states())
    engine.wake()
    (ro,) = engine.rollout([{"prompts": ["nine"], "group_size": 2, "seed": 7, "sampler": SDE}])
    assert ro.policy_version == report.version
    _exact_ratio(trainer, ro)


def test_bad_requests_are_refused_at_submit(engine):
    with pytest.raises(omnispec.SpecError, match="group_size") as caught:
        engine.submit([{"prompts": "one"}, {"prompts": "two", "group_size": 0}])
    assert caught.value.problems[0].path.startswith("requests.1")
    with pytest.raises(omnispec.SpecError, match="prompts"):
        engine.submit([{"group_size": 2}])
    with pytest.raises(omnispec.SpecError, match="empty"):
        engine.submit([])
    with pytest.raises(TypeError, match="requests.0.prompts"):
        engine.submit([{"prompts": 5}])
    handle = engine.submit([{"prompts": "one", "sampler": {"kind": "ode"}}])  # checked in the worker
    with pytest.raises(omnispec.SpecError, match="stochastic") as caught:
        engine.get(handle)
    assert caught.value.problems[0].path == "sampler" and "ray::" not in str(caught.value)  # the worker's own error
    (ro,) = engine.rollout([{"prompts": "one", "sampler": SDE}])  # the workers go on
    assert ro.select([0]).policy_version == ro.policy_version == engine.version
