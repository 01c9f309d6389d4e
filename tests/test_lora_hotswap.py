"""RL weight sync of a LoRA under regional compile swaps the weights in place (diffusers' hotswap): a sync causes no
recompile (dynamo's error_on_recompile; CPU, backend eager) and the output is that of the new weights."""

import numpy as np
import pytest
import torch

import omnispec
from omnispec.rl import set_lora

from conftest import SPECS

BASE = ["runtime.progress=false", "recipe.defaults.steps=2", "recipe.phases.0.guidance.terms=[]"]
COMPILED = [*BASE, "policies.compile={mode: regional, backend: eager}", "policies.attention.default=sdpa"]


def lora(pipe, seed, rank=2, alpha=2):
    from omnispec.src_models.digits.model import DigitsDiT
    from peft import LoraConfig, get_peft_model_state_dict

    torch.manual_seed(seed)
    donor = DigitsDiT.from_config(pipe.components["transformer"].config)
    donor.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=["to_q", "to_v"], init_lora_weights=False),
                      adapter_name="d")
    return get_peft_model_state_dict(donor, adapter_name="d"), {"r": rank, "lora_alpha": alpha,
                                                                "target_modules": ["to_q", "to_v"]}


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_lora_sync_under_regional_compile_does_not_recompile(fresh_dynamo):
    """The synced LoRA has another rank and alpha than the first (padded to ``max_rank``, scales held as tensors):
    replacing the adapter would change shapes and a float the compiled blocks guard on; swapping it does not."""
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=COMPILED)
    eager = omnispec.build(SPECS / "digits.yaml", overrides=BASE)
    first, meta = lora(pipe, 1, rank=4, alpha=4)
    set_lora(pipe, "policy", first, metadata=meta, max_rank=4)
    pipe("seven", seed=0)  # compiles
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    new, meta = lora(pipe, 2, rank=2, alpha=8)
    set_lora(pipe, "policy", new, metadata=meta)
    with torch._dynamo.config.patch(error_on_recompile=True):
        synced = pipe("seven", seed=0).array
    set_lora(eager, "policy", new, metadata=meta)
    assert np.abs(synced - eager("seven", seed=0).array).max() <= 1e-5


def test_a_sync_that_cannot_swap_in_place_replaces_the_adapter(fresh_dynamo):
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=BASE)
    eager = omnispec.build(SPECS / "digits.yaml", overrides=BASE)
    first, meta = lora(pipe, 1)
    set_lora(pipe, "policy", first, metadata=meta)
    bigger, meta = lora(pipe, 3, rank=4, alpha=4)  # a larger rank than the adapter's layers hold
    set_lora(pipe, "policy", bigger, metadata=meta)
    set_lora(eager, "policy", bigger, metadata=meta)
    assert np.abs(pipe("two", seed=0).array - eager("two", seed=0).array).max() <= 1e-6
