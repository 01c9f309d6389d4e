"""``policies.mlp.precomputed_modulation`` on the tiny FLUX (CPU): the plain run's output, each modulation weight
read once per phase instead of once per step, a rollout's exact replay, compiled blocks, refusals."""

import contextlib
import copy
import importlib.util

import numpy as np
import pytest
import torch

import omnispec
from omnispec.policies.modulation import EMBEDDER_HOOK, ModulationTables, TabledLinear, nearest_rows
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS, int8_weight

ON = "policies.mlp.precomputed_modulation=true"


def build(ckpt, *overrides, spec="flux1-dev.yaml", family="flux"):
    return omnispec.build(SPECS / spec, source=str(ckpt), overrides=[*TINY_OVERRIDES[family], *overrides])


def modulation_linears(transformer):
    return [m for n, m in transformer.named_modules() if n.endswith(("norm1.linear", "norm1_context.linear",
                                                                      "norm.linear", "norm_out.linear"))]


@contextlib.contextmanager
def counting_products(weights):
    """Counts ``F.linear`` calls on any of ``weights`` (nn.Linear's forward and the table's build both call it)."""
    seen = {id(w) for w in weights}
    calls = [0]
    original = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        calls[0] += id(weight) in seen
        return original(x, weight, bias)

    torch.nn.functional.linear = linear
    try:
        yield calls
    finally:
        torch.nn.functional.linear = original


@pytest.fixture(scope="module")
def plain(flux_dir):
    return build(flux_dir)


def test_the_table_gives_the_plain_output_reading_each_weight_once_a_phase(flux_dir, plain):
    pipe = build(flux_dir, ON)
    linears = modulation_linears(pipe.components["transformer"])
    assert len(linears) == 2 * len(pipe.components["transformer"].transformer_blocks) + len(
        pipe.components["transformer"].single_transformer_blocks) + 1
    expected = plain("a cat", seed=0, steps=5).array
    with counting_products([m.weight for m in linears]) as calls:
        out = pipe("a cat", seed=0, steps=5).array
    assert calls[0] == len(linears)  # one matmul per linear for the request's five steps
    assert np.abs(out - expected).max() <= 1e-5
    with counting_products([m.weight for m in modulation_linears(plain.components["transformer"])]) as calls:
        plain("a cat", seed=0, steps=5)
    assert calls[0] == 5 * len(linears)  # what the plain run reads: every weight at every step
    note = pipe.explain(as_dict=True)["applied"]["modulation"]
    assert note.startswith(f"transformer: {len(linears)} modulation linears from a table built once per phase")
    assert "modulation linears precomputed per request" in pipe.explain()


def test_modules_handed_over_with_trainable_weights_use_the_table_in_inference(flux_dir, plain):
    """Modules a caller builds (``components=``) keep ``requires_grad`` on: generating (no gradients) still reads
    the table, one matmul per linear."""
    components = dict(plain.components)
    transformer = components["transformer"] = copy.deepcopy(plain.components["transformer"]).requires_grad_(True)
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", components=components, device="cpu",
                          overrides=[*TINY_OVERRIDES["flux"], ON])
    linears = modulation_linears(transformer)
    with counting_products([m.weight for m in linears]) as calls:
        out = pipe("a cat", seed=0, steps=4).array
    assert calls[0] == len(linears)
    assert np.abs(out - plain("a cat", seed=0, steps=4).array).max() <= 1e-5


def test_a_replay_training_the_modulation_gets_its_gradients_and_the_rollouts_values(flux_dir):
    """Full fine-tuning (every weight trainable): each replay with gradients builds its table with them, from the
    same matmuls as the rollout's kept table (ratio exactly 1), and a backward after each micro-batch reaches the
    modulation linears."""
    pipe = build(flux_dir, ON, "recipe.defaults.steps=3")
    transformer = pipe.components["transformer"].requires_grad_(True)
    ro = pipe.rollout(["a cat", "a dog"], group_size=2, seed=1, sampler={"kind": "sde"})
    for micro in (1, None):
        transformer.zero_grad()
        replay = pipe.log_prob(ro, micro_batch=micro)
        assert torch.equal(replay.log_probs.detach().cpu(), ro.log_probs), f"micro-batch {micro}"
        replay.log_probs.sum().backward()
        grads = [m.weight.grad for m in modulation_linears(transformer)] + [
            transformer.time_text_embed.timestep_embedder.linear_1.weight.grad]
        assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_two_prompts_with_true_cfg_take_their_own_rows(flux_dir):
    """Four rows a forward (two prompts, each with the negative prompt's pass): each row finds its own step and
    prompt in the table, which holds each conditioning once."""
    cfg = "recipe.phases.0.guidance.terms=[{kind: true_cfg, scale: 2.5}]"
    request = dict(seed=3, steps=4, negative_prompt="blurry")
    expected = build(flux_dir, cfg)(["a cat", "a red car in the snow"], **request).array
    out = build(flux_dir, cfg, ON)(["a cat", "a red car in the snow"], **request).array
    assert np.abs(out - expected).max() <= 1e-5


def test_each_row_finds_its_own_step_among_many_close_ones(plain):
    """A 400-step schedule's embeddings, each computed alone (as a forward does), against the table's, computed in
    one batch: every one is nearest to its own step's."""
    family, transformer = plain.family, plain.components["transformer"]
    cond = plain.encode(plain.request("a cat", seed=0))[0]
    timesteps = list(torch.linspace(1000, 1, 400))
    with torch.no_grad():
        table = family.modulation_embeddings(transformer, timesteps, [3.5] * 400, cond)
        alone = torch.cat([family.modulation_embeddings(transformer, [t], [3.5], cond) for t in timesteps])
    assert torch.equal(nearest_rows(alone, table), torch.arange(400))


def test_a_forward_whose_embedding_is_not_in_the_table_is_refused(flux_dir, monkeypatch):
    """A family's ``modulation_embeddings`` that computes other timesteps than its forwards (here every step's
    timestep moved by 300): the table's first forward fails, naming the field."""
    from omnispec.runtime.families.flux import FluxFamily

    own = FluxFamily.modulation_embeddings
    monkeypatch.setattr(FluxFamily, "modulation_embeddings",
                        lambda self, denoiser, timesteps, embedded, cond:
                        own(self, denoiser, [t - 300 for t in timesteps], embedded, cond))
    with pytest.raises(RuntimeError, match=r"precomputed_modulation: a forward's timestep embedding is not in"):
        build(flux_dir, ON)("a cat", seed=0, steps=3)


def test_a_rollout_replays_exactly_with_the_table(flux_dir):
    pipe = build(flux_dir, ON, "recipe.defaults.steps=4")
    ro = pipe.rollout(["a cat", "a dog"], group_size=2, seed=1, sampler={"kind": "sde"})
    for micro in (1, 3, None):
        replay = pipe.log_prob(ro, micro_batch=micro)
        assert torch.equal(replay.log_probs.cpu(), ro.log_probs), f"micro-batch {micro}"


@pytest.mark.parametrize("mode", ["regional", "full"])
def test_compiled_code_reads_the_table_and_compiles_once_for_several_step_counts(flux_dir, plain, monkeypatch, mode):
    """Compiled, the lookups read each request's table (not values traced in), and tables of 3 and 6 steps are one
    padded size: no new graphs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    pipe = build(flux_dir, ON, f"policies.compile={{mode: {mode}, backend: aot_eager}}")
    assert np.abs(pipe("a cat", seed=0, steps=3).array - plain("a cat", seed=0, steps=3).array).max() <= 1e-5
    graphs = counters["stats"]["unique_graphs"]
    assert np.abs(pipe("a cat", seed=1, steps=6).array - plain("a cat", seed=1, steps=6).array).max() <= 1e-5
    assert counters["stats"]["unique_graphs"] == graphs  # 3 and 6 steps: both tables padded to 8 rows
    build_table = ModulationTables.build

    def zeroed(self, embeddings):  # a table of zeros: the compiled blocks must now compute otherwise
        table = build_table(self, embeddings)
        table.outputs = [o if o is None else torch.zeros_like(o) for o in table.outputs]
        return table

    monkeypatch.setattr(ModulationTables, "build", zeroed)
    assert np.abs(pipe("a cat", seed=0, steps=3).array - plain("a cat", seed=0, steps=3).array).max() > 1e-2


def test_blocks_alike_compile_to_one_graph(plain):
    """Regional compilation with two double and two single blocks: as many graphs with the table as without (a
    hook per linear made dynamo guard on each block's own function and compile a block of each kind again)."""
    from torch._dynamo.utils import counters

    def graphs(*overrides):
        components = dict(plain.components)
        transformer = components["transformer"] = copy.deepcopy(plain.components["transformer"])
        for blocks in (transformer.transformer_blocks, transformer.single_transformer_blocks):
            blocks.append(copy.deepcopy(blocks[0]))
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        pipe = omnispec.build(SPECS / "flux1-dev.yaml", components=components, device="cpu", overrides=[
            *TINY_OVERRIDES["flux"], "policies.compile={mode: regional, backend: aot_eager}", *overrides])
        pipe("a cat", seed=0, steps=2)
        return counters["stats"]["unique_graphs"] - before

    assert graphs(ON) == graphs()  # 3 on the CPU: the single blocks take a second graph for a stride


def test_a_table_in_storage_another_run_reused_is_built_again(flux_dir):
    """Tables of one size share storage across requests (CUDA graphs take it as a static input): a run whose table
    another run's has since overwritten builds its own again instead of reading the other prompt's values."""
    from omnispec.runtime.run import Run

    pipe = build(flux_dir, ON)
    first, second = (Run(pipe, pipe.request(prompt, seed=0, steps=3)) for prompt in ("a cat", "a red car"))
    starts = {run: run._start(run.walks[0], None) for run in (first, second)}
    with torch.no_grad():
        before = first.prediction(first.walks[0], 0, starts[first])["latents"]
        other = second.prediction(second.walks[0], 0, starts[second])["latents"]
        again = first.prediction(first.walks[0], 0, starts[first])["latents"]
    tables = pipe.components["transformer"]._omnispec_modulation
    assert len(tables.storage) == 1 and not torch.equal(before, other)
    assert torch.equal(again, before)


def test_a_rebuild_without_the_policy_removes_its_hooks(flux_dir):
    pipe = build(flux_dir, ON)
    transformer = pipe.components["transformer"]

    def hooked():
        return [n for n, m in transformer.named_modules() if type(m) is TabledLinear or (
            getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook(EMBEDDER_HOOK))]

    assert len(hooked()) == len(modulation_linears(transformer)) + 1
    omnispec.build(SPECS / "flux1-dev.yaml", components=dict(pipe.components), overrides=TINY_OVERRIDES["flux"],
                   device="cpu")
    assert hooked() == [] and not hasattr(transformer, "_omnispec_modulation")
    assert all(type(m) is torch.nn.Linear and "modulation" not in vars(m) for m in modulation_linears(transformer))


def test_qwen_image_with_true_cfg_reads_each_weight_once_from_one_row_per_step(qwen_image_dir):
    """Qwen-Image's embedding reads no prompt: the table holds one row per step (its prompt's and its negative
    prompt's passes, two forwards of their own lengths, share them), and the output is the plain run's."""
    def qwen(*overrides):
        return build(qwen_image_dir, *overrides, spec="qwen-image.yaml", family="qwen_image")

    request = dict(seed=2, steps=5, negative_prompt="blurry, low quality")
    expected = qwen()("a cat", **request).array
    pipe = qwen(ON)
    transformer = pipe.components["transformer"]
    linears = [m for n, m in transformer.named_modules() if n.endswith(("img_mod.1", "txt_mod.1", "norm_out.linear"))]
    assert len(linears) == 2 * len(transformer.transformer_blocks) + 1
    with counting_products([m.weight for m in linears]) as calls:
        out = pipe("a cat", **request).array
    assert calls[0] == len(linears)
    assert np.abs(out - expected).max() <= 1e-5
    assert list(transformer._omnispec_modulation.storage) == [8]  # 5 steps, one row each (not 10), padded to 8


def test_qwen_image_edit_with_zero_cond_t_finds_its_timestep_zero_rows(qwen_edit_dir):
    """Qwen-Image-Edit-2511's ``zero_cond_t``: the reference images' tokens are modulated at timestep 0, so the
    embedder computes rows at 0 beside each step's, which the table holds too; the text stream's linear, which takes
    only the first half, computes its own product."""
    from PIL import Image

    from omnispec.testing import qwen_vl_processor

    picture = Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype(np.uint8))

    def edit(*overrides):
        return omnispec.build(SPECS / "qwen-image-edit-plus.yaml", source=str(qwen_edit_dir), components={
            "processor": qwen_vl_processor(qwen_edit_dir / "processor")}, overrides=[
            *TINY_OVERRIDES["qwen_image_edit"], "model.components.transformer.config.zero_cond_t=true", *overrides])

    request = dict(seed=3, conditions=[picture], negative_prompt="blurry", height=32, width=32)
    expected = edit()("make it blue", **request).array
    assert np.abs(edit(ON)("make it blue", **request).array - expected).max() <= 1e-5


def test_a_group_of_samples_of_one_prompt_takes_one_row_a_step(flux_dir):
    """GRPO's groups: four samples of each of two prompts, three steps: 6 distinct rows (padded to 8), not 24."""
    pipe = build(flux_dir, ON, "recipe.defaults.steps=3")
    ro = pipe.rollout(["a cat", "a dog"], group_size=4, seed=1, sampler={"kind": "sde"})
    assert list(pipe.components["transformer"]._omnispec_modulation.storage) == [8]
    assert torch.equal(pipe.log_prob(ro, micro_batch=3).log_probs.detach().cpu(), ro.log_probs)


def test_a_lora_on_the_modulation_adds_to_the_tables_base_output(plain):
    """A LoRA adapter on the modulation linears (peft wraps each ``TabledLinear`` as its base layer): the table gives
    the base's product, the adapter adds its own, and the output is the plain run's with the same adapter."""
    from peft import LoraConfig

    def with_lora(*overrides):
        components = dict(plain.components)
        transformer = components["transformer"] = copy.deepcopy(plain.components["transformer"])
        pipe = omnispec.build(SPECS / "flux1-dev.yaml", components=components, device="cpu",
                              overrides=[*TINY_OVERRIDES["flux"], *overrides])
        torch.manual_seed(0)
        transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights=False, target_modules=[
            "norm1.linear", "norm1_context.linear", "norm.linear"]))
        return pipe, pipe("a cat", seed=0, steps=3).array

    _, expected = with_lora()
    pipe, out = with_lora(ON)
    bases = [m.base_layer for n, m in pipe.components["transformer"].named_modules() if n.endswith("norm1.linear")]
    assert bases and all(type(b) is TabledLinear for b in bases)
    assert np.abs(out - expected).max() <= 1e-5
    assert np.abs(out - plain("a cat", seed=0, steps=3).array).max() > 1e-3  # the adapter does change the output


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_quantized_modulation_linears_are_refused_and_left_out_of_quantization_are_tabled(flux_dir):
    """Quantized modulation linears (int8: a quantization's own linear class) leave the table nothing: refused before
    anything loads, with the ``exclude`` that keeps them plain; with it, the table holds them and the rest stays
    quantized."""
    int8 = "policies.quantization={transformer: {method: int8_weight_only%s}}"
    with pytest.raises(SpecError, match=r"precomputed_modulation: policies.quantization.transformer quantizes the "
                                        r"modulation linears.*exclude: \[norm1.linear, norm1_context.linear, "
                                        r"norm.linear, norm_out.linear\]"):
        build(flux_dir, int8 % "", ON)
    kept = int8 % ", exclude: [norm1.linear, norm1_context.linear, norm.linear, norm_out.linear]"
    expected = build(flux_dir, kept)("a cat", seed=0, steps=3).array
    pipe = build(flux_dir, kept, ON)
    assert int8_weight(pipe.components["transformer"].transformer_blocks[0].attn.to_q.weight)
    linears = modulation_linears(pipe.components["transformer"])
    with counting_products([m.weight for m in linears]) as calls:
        out = pipe("a cat", seed=0, steps=3).array
    assert calls[0] == len(linears) and np.abs(out - expected).max() <= 1e-5


def test_refused_where_the_family_has_no_table(sd3_dir):
    with pytest.raises(SpecError, match=r"policies.mlp.precomputed_modulation: family 'sd3' has no modulation table"):
        build(sd3_dir, ON, spec="sd3.5-medium.yaml", family="sd3")


def test_refused_with_a_sharded_denoiser(flux_dir):
    """Refused before any weight loads (one process is enough): sharded, the build of the table met FSDP's DTensor
    shards outside a block's forward and failed at the first request."""
    with pytest.raises(SpecError, match=r"policies.mlp.precomputed_modulation: .* shard 2 splits over the ranks"):
        build(flux_dir, ON, "policies.parallel.shard=2")


def test_refused_with_an_offloaded_denoiser(flux_dir):
    with pytest.raises(SpecError, match=r"policies.mlp.precomputed_modulation: .* offload 'model' keeps off it"):
        build(flux_dir, ON, "policies.offload={strategy: model}")


@pytest.mark.gpu
def test_on_cuda_in_bfloat16_under_cuda_graphs(flux_dir):
    """What the H200 runs: bf16, compiled blocks recorded as CUDA graphs (the table and the rows are graph inputs
    copied in at each replay); the plain run's output within bf16's rounding, and a rollout's replay exact."""
    cuda = ["runtime.device=cuda", "model.dtype=bfloat16", "policies.compile={mode: regional, cudagraphs: true}"]
    torch._dynamo.reset()
    expected = build(flux_dir, *cuda)("a cat", seed=0, steps=4).array
    pipe = build(flux_dir, ON, *cuda)
    for seed in (0, 0, 1):  # the second and third requests replay the graphs with new tables
        out = pipe("a cat", seed=seed, steps=4).array
    assert np.abs(pipe("a cat", seed=0, steps=4).array - expected).max() <= 2e-2
    assert np.abs(out - expected).max() > 1e-2  # seed 1 differs: the graphs did not keep an earlier output
    ro = pipe.rollout(["a cat", "a dog"], group_size=2, seed=1, sampler={"kind": "sde"}, steps=4)
    for micro in (1, None):
        assert torch.equal(pipe.log_prob(ro, grad=False, micro_batch=micro).log_probs.cpu(), ro.log_probs)
