"""``policies.attention.sparse``: the layouts against a plain mask, the policy on a tiny Wan (dense steps first, exact
where the window covers the grid, rollouts replayed exactly), eager and under regional compile, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import omnispec
from omnispec.kernels.sparse_video import kept_fraction, layout, radial_reach
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS

GRID = (3, 4, 6)
# 64x96 pixels, 9 frames: 3 latent frames of 8x12, Wan's 1x2x2 patch: a 3x4x6 token grid
WAN = [*TINY_OVERRIDES["wan"], "recipe.defaults.height=64", "recipe.defaults.width=96", "recipe.defaults.frames=9"]


def coordinates(grid):
    f, h, w = grid
    return torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 3)


def reference_mask(kind, grid, tile, window):
    """The pairs a layout keeps, written out pair by pair over the raster order."""
    tiles = coordinates(grid) // torch.tensor(tile)
    counts = [(g + t - 1) // t for g, t in zip(grid, tile)]
    n = tiles.shape[0]
    keep = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            d = (tiles[q] - tiles[k]).abs().tolist()
            if kind == "sliding_tile":
                keep[q, k] = d[0] <= window[0] and d[1] <= window[1] and d[2] <= window[2]
            else:
                reach_h = radial_reach(counts[1], window[1], window[0], counts[0])[d[0]]
                reach_w = radial_reach(counts[2], window[2], window[0], counts[0])[d[0]]
                keep[q, k] = d[1] <= reach_h and d[2] <= reach_w
    return keep


@pytest.mark.parametrize("kind, tile, window", [
    ("sliding_tile", (1, 2, 2), (0, 1, 1)), ("sliding_tile", (2, 2, 3), (1, 0, 1)), ("sliding_tile", (1, 1, 1), (1, 1, 2)),
    ("radial", (1, 2, 2), (0, 1, 1)), ("radial", (1, 1, 1), (1, 0, 1)),
])
def test_a_layout_is_attention_over_exactly_the_pairs_it_keeps(kind, tile, window):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 72, 16) for _ in range(3))
    video = layout(kind, GRID, tile, window, torch.device("cpu"))
    keep = reference_mask(kind, GRID, tile, window)
    assert not keep.all()  # these settings do leave pairs out
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert torch.allclose(video.attend(q, k, v), expected, atol=1e-5)


def test_a_window_over_the_whole_grid_is_dense_attention():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 72, 16) for _ in range(3))
    video = layout("sliding_tile", GRID, (1, 2, 2), (3, 2, 3), torch.device("cpu"))
    assert kept_fraction(video) == 1.0
    assert torch.allclose(video.attend(q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-5)


@pytest.mark.parametrize("kind, grid, tile, window", [
    ("sliding_tile", (5, 12, 20), (2, 4, 4), (1, 1, 1)), ("radial", (9, 10, 17), (1, 4, 8), (1, 1, 1)),
    ("sliding_tile", (4, 9, 11), (1, 2, 2), (0, 1, 0)),
])
def test_the_block_mask_is_torchs_made_a_few_query_rows_at_a_time(monkeypatch, kind, grid, tile, window):
    """``sparse_video.block_mask`` holds the mask of a few query blocks at once (torch's ``create_block_mask`` holds
    every pair: tens of GB at Wan2.1 14B 480p's 32,760 tokens) and makes the block mask torch's function makes:
    the same partial and full blocks, in the same order, both ways (by query and by key)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from omnispec.kernels import sparse_video

    monkeypatch.setattr(sparse_video, "QUERIES_AT_ONCE", 2 * sparse_video.BLOCK)  # several rounds at these sizes
    rows = []
    video = layout(kind, grid, tile, window, torch.device("cpu"))
    mask_mod = video.mask.mask_mod

    def counting(b, h, q, kv):
        rows.append(q.numel())
        return mask_mod(b, h, q, kv)

    mine = sparse_video.block_mask(counting, video.tokens, torch.device("cpu"))
    torchs = create_block_mask(mask_mod, None, None, video.tokens, video.tokens, device="cpu")
    assert len(rows) > 1 and max(rows) <= 2 * sparse_video.BLOCK
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                            ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        assert torch.equal(getattr(mine, counts), getattr(torchs, counts)), counts
        for row, n in enumerate(getattr(torchs, counts)[0, 0].tolist()):
            assert torch.equal(getattr(mine, indices)[0, 0, row, :n], getattr(torchs, indices)[0, 0, row, :n])


def test_radial_reach_halves_as_the_temporal_distance_doubles():
    assert radial_reach(16, 1, 1, 9).tolist() == [16, 16, 8, 8, 4, 4, 4, 4, 2]
    assert radial_reach(16, 4, 0, 4).tolist() == [16, 8, 4, 4]


def _wan(wan_dir, *extra):
    return omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(wan_dir), overrides=[*WAN, *extra])


SPARSE = "policies.attention.sparse={kind: sliding_tile, tile: [1, 2, 2], window: [0, 1, 1], dense_fraction: 0.5}"


@pytest.fixture(scope="module")
def dense_video(wan_dir):
    return _wan(wan_dir)("a cat", seed=3).array


@pytest.fixture(scope="module")
def eager_sparse(wan_dir):
    """The eager sparse run's explain text and output."""
    pipe = _wan(wan_dir, SPARSE)
    return pipe.explain(), pipe("a cat", seed=3)


def test_on_wan_the_sparse_steps_change_the_video_and_dense_only_steps_do_not(wan_dir, dense_video, eager_sparse):
    explained, out = eager_sparse
    assert "approximate: sliding_tile sparse attention on 2 self attention modules" in explained
    assert "(FlexAttention; a hook on each attention module)" in explained
    sparse = out.array
    assert sparse.shape == dense_video.shape and not np.array_equal(sparse, dense_video)
    a, b = sparse.ravel().astype(np.float64), dense_video.ravel().astype(np.float64)
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.5
    all_dense = _wan(wan_dir, SPARSE.replace("dense_fraction: 0.5", "dense_fraction: 1.0"))("a cat", seed=3).array
    assert np.abs(all_dense - dense_video).max() <= 1e-5
    whole = _wan(wan_dir, SPARSE.replace("window: [0, 1, 1]", "window: [3, 4, 6]"))("a cat", seed=3).array
    assert np.abs(whole - dense_video).max() <= 1e-4


def test_on_wan_rollouts_with_sparse_steps_replay_exactly(wan_dir):
    pipe = _wan(wan_dir, SPARSE.replace("dense_fraction: 0.5", "dense_fraction: 0.25"))
    ro = pipe.rollout(["a cat", "a dog"], group_size=2, seed=1, sampler={"kind": "sde", "multistep": "euler", "window": {
        "kind": "fixed", "start": 1, "length": 2}})
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)
    ratio = (pipe.log_prob(ro, grad=True, micro_batch=1).log_probs.detach().cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-5


COMPILED = "policies.compile={mode: regional, backend: aot_eager}"  # the CPU's compile tests' backend


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters empty before and after: graphs are counted from this test's compiles alone."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
SDE = {"kind": "sde", "multistep": "euler", "window": {"kind": "fixed", "start": 0, "length": 3}}


def test_under_regional_compile_sparse_attention_is_the_eager_one_in_one_more_graph(wan_dir, eager_sparse,
                                                                                     fresh_dynamo):
    """One redirect around the denoiser's call, traced into the compiled blocks: the video is the eager sparse run's,
    and the blocks compile once for the dense steps and once for the sparse ones, however many steps follow."""
    from torch._dynamo.utils import counters

    eager = eager_sparse[1].latents["latents"]
    counters.clear()  # where eager FlexAttention ran after the reset, it did through a graph of its own
    pipe = _wan(wan_dir, SPARSE, COMPILED)
    assert "compiled in, through one redirect around the denoiser's call" in pipe.explain()
    compiled = pipe("a cat", seed=3).latents["latents"]
    assert torch.allclose(compiled, eager, atol=1e-6), (compiled - eager).abs().max()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2, dict(counters)  # the block's dense graph and its sparse one
    pipe("a dog", seed=4, steps=6)  # three dense steps, three sparse: the same two graphs
    assert counters["stats"]["unique_graphs"] == graphs and not counters["recompiles"], dict(counters)


def test_under_regional_compile_the_dense_steps_are_dense_attention_and_replays_are_exact(wan_dir, fresh_dynamo):
    """A compiled rollout's states (4 steps, the first half dense): the dense steps' are the dense run's, the first
    sparse step's differ; the replay computes the rollout's log-probs."""
    dense = _wan(wan_dir).rollout(["a cat"], seed=1, sampler=SDE)
    pipe = _wan(wan_dir, SPARSE, COMPILED)
    ro = pipe.rollout(["a cat"], seed=1, sampler=SDE)
    got, want = ro.states["latents"], dense.states["latents"]
    assert torch.allclose(got[:, :3], want[:, :3], atol=1e-6)  # the first input, then steps 0 and 1: dense
    assert (got[:, 3] - want[:, 3]).abs().max() > 1e-4  # step 2: sparse
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)


def _checked(spec: str, overrides: list[str]) -> None:
    """The spec's checks and the policies' checks against the family's targets, as a build makes them."""
    from omnispec.policies.apply import check_policies
    from omnispec.runtime.families import family_class
    from omnispec.spec import load_spec

    spec_obj = load_spec(SPECS / spec, overrides)
    check_policies(spec_obj, family_class(spec_obj.model.family).targets, torch.device("cpu"))


@pytest.mark.parametrize("cudagraphs", [False, True])
def test_sparse_attention_is_not_refused_under_regional_compile_with_or_without_cuda_graphs(cudagraphs):
    _checked("wan2.1-t2v-1.3b.yaml", [SPARSE, f"policies.compile={{mode: regional, cudagraphs: {str(cudagraphs).lower()}}}"])


@pytest.mark.parametrize("spec, extra, message", [
    ("sd3.5-medium.yaml", [], "family 'sd3' has no video-only self-attention for sparse attention"),
    ("wan2.1-t2v-1.3b.yaml", ["policies.compile.mode=full"], "outside the compiled code; use compile mode regional"),
    ("wan2.1-vace-1.3b.yaml", ["policies.compile.mode=regional"], "the VACE blocks' self-attention"),
    ("wan2.1-t2v-1.3b.yaml", ["policies.parallel.ulysses=2"], "sequence parallelism"),
    ("ltx2-t2v.yaml", [], "perturbs attention scores"),
])
def test_where_sparse_attention_cannot_run_it_is_refused_with_the_reason(spec, extra, message):
    with pytest.raises(SpecError, match=message):
        _checked(spec, [SPARSE, *extra])


def test_explain_marks_sparse_attention_approximate_without_a_build():
    from omnispec.spec import load_spec
    from omnispec.spec.explain import explain_spec, render_explain

    text = render_explain(explain_spec(load_spec(SPECS / "wan2.1-t2v-1.3b.yaml", [SPARSE])))
    assert "sparse sliding_tile, tiles 1x2x2, window 0x1x1, dense for the first 50% of each phase's steps " \
           "[approximate]" in text
