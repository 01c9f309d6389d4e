"""RolloutPool on a local Ray cluster with 2 CPU actors (skipped without ray)."""

import pytest
import torch

ray = pytest.importorskip("ray")

import omnispec  # noqa: E402
from omnispec.rl import RolloutPool  # noqa: E402

from conftest import ROOT, SPECS  # noqa: E402

OVERRIDES = ["runtime.progress=false", "recipe.defaults.steps=4"]
SAMPLER = {"kind": "sde", "window": {"kind": "random", "length": 2, "high": 3, "scope": "sample"}}


@pytest.fixture(scope="module")
def pool():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}})
    p = RolloutPool(str(SPECS / "digits.yaml"), num_workers=2, overrides=OVERRIDES)
    yield p
    p.shutdown()
    ray.shutdown()


def test_sharded_rollout_equals_one_pipeline(pool):
    prompts = ["one", "two", "three"]
    sharded = pool.rollout(prompts, group_size=2, seed=3, sampler=SAMPLER)
    assert sharded.extra["shards"] == [4, 2]  # samples per actor: prompts split 2 + 1
    local = omnispec.build(SPECS / "digits.yaml", overrides=OVERRIDES).rollout(prompts, group_size=2, seed=3,
                                                                               sampler=SAMPLER)
    assert sharded.group_ids.tolist() == local.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(sharded.step_indices, local.step_indices)
    assert torch.allclose(sharded.latents, local.latents, atol=1e-5)
    assert torch.allclose(sharded.log_probs, local.log_probs, atol=1e-5)


def test_weight_updates_reach_every_actor(pool):
    versions = pool.weight_versions()
    bias = torch.zeros(64)  # proj_out: dim -> patch 8 x 8 x 1 channel
    assert pool.update_weights([("proj_out.bias", bias)]) == [1, 1]
    assert pool.weight_versions() == [v + 1 for v in versions]
