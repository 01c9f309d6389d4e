"""Do sharded blocks keep their CUDA graphs? Why ``policies.parallel.shard`` with ``compile.cudagraphs`` is refused.
No peer: the same blocks compiled whole (not sharded) are the reference, and the uncompiled model for the outputs.

``python -m benchmarks.gpu_shard_graphs [--calls 6] [--json FILE]``  (one process on one GPU; ``--smoke``: the CPU,
gloo, without graphs: checks the script only)

A tiny FLUX transformer (two double and two single blocks, bf16) is compiled by the build's own compile step under
``compile: {mode: regional, cudagraphs: true}`` (omnispec's compile options, a new graph generation per call), once
as it is and once with its blocks sharded by omnispec's shard axis (FSDP2 ``fully_shard`` per block, resharded after
each forward) over a one-rank mesh, which gathers each block's weights at every call as N ranks do. Each row is one
denoiser call: its largest difference from the uncompiled, unsharded model, and how many CUDA graphs the graph trees
have recorded so far. Graphs recorded at every call mean the weights' addresses moved: the recording is paid again
each call, and past torch's limit of unexpected re-recordings the blocks run without graphs.
"""

from __future__ import annotations

import copy
import tempfile
from types import SimpleNamespace
from typing import Self

import torch

from . import harness


def tiny_flux(dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                  attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                                  pooled_projection_dim=32, axes_dims_rope=(8, 12, 12),
                                  guidance_embeds=True).to(harness.DEVICE, dtype).eval()


def compiled_like_a_build(model: torch.nn.Module, family: type, graphs: bool) -> None:
    """``model`` compiled by the build's own step for ``policies.compile`` regional (with ``cudagraphs``), as
    FLUX.1-dev's spec names it ``transformer``."""
    from omnispec.policies.compile import apply_compile
    from omnispec.spec import load_spec

    backend = "aot_eager" if harness.SMOKE else "inductor"
    spec = load_spec(harness.ROOT / "specs" / "flux1-dev.yaml", overrides=[
        f"policies.compile={{mode: regional, cudagraphs: {str(graphs).lower()}, backend: {backend}}}"])
    apply_compile(spec, family.targets.blocks, {"transformer": model})


class GraphCount:
    """Counts the CUDA graphs inductor's graph trees record (``CUDAGraphNode``s made) while it is entered."""

    def __enter__(self) -> Self:
        from torch._inductor import cudagraph_trees

        self.node, self.recorded = cudagraph_trees.CUDAGraphNode, 0
        self.original = self.node.__init__

        def counting(node, *args, **kwargs):
            self.recorded += 1
            self.original(node, *args, **kwargs)

        self.node.__init__ = counting
        return self

    def __exit__(self, *exc) -> None:
        self.node.__init__ = self.original


def inputs(step: int, dtype: torch.dtype, generator: torch.Generator) -> dict:
    def randn(*shape):
        return torch.randn(*shape, device=harness.DEVICE, dtype=dtype, generator=generator)

    return dict(hidden_states=randn(1, 64, 16), encoder_hidden_states=randn(1, 8, 64), pooled_projections=randn(1, 32),
                timestep=torch.tensor([0.9 - 0.1 * step], device=harness.DEVICE),
                guidance=torch.tensor([3.5], device=harness.DEVICE), img_ids=torch.zeros(64, 3, device=harness.DEVICE),
                txt_ids=torch.zeros(8, 3, device=harness.DEVICE), return_dict=False)


def rows_for(sharded: bool, calls: int, mesh, save) -> None:
    from omnispec.runtime.families.flux import FluxFamily
    from omnispec.runtime.parallel.shard import shard_denoiser

    dtype = torch.bfloat16 if harness.DEVICE == "cuda" else torch.float32
    reference = tiny_flux(dtype)
    model = copy.deepcopy(reference)
    if sharded:
        shard_denoiser(model, FluxFamily.targets.blocks.lists, SimpleNamespace(shard_mesh=mesh))
    compiled_like_a_build(model, FluxFamily, graphs=harness.DEVICE == "cuda")
    generator = torch.Generator(harness.DEVICE).manual_seed(1)
    with GraphCount() as graphs, torch.no_grad():
        for call in range(calls):
            x = inputs(call, dtype, generator)
            want, got = reference(**x)[0], model(**x)[0]
            save({"blocks": "sharded" if sharded else "whole", "call": call,
                  "max_abs_diff": (got.float() - want.float()).abs().max().item(), "graphs_recorded": graphs.recorded})
    torch._dynamo.reset()


def add_arguments(parser) -> None:
    parser.add_argument("--calls", type=int, default=6)


def benchmark(args, results: harness.Results) -> None:
    import diffusers
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    results.header["versions"] = {"torch": torch.__version__, "diffusers": diffusers.__version__}
    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(f"{folder}/store", 1)  # one rank: no port to pick
        dist.init_process_group("nccl" if harness.DEVICE == "cuda" else "gloo", store=store, rank=0, world_size=1)
        try:
            mesh = init_device_mesh(harness.DEVICE, (1,))
            calls = 3 if args.smoke else args.calls
            rows_for(False, calls, mesh, results.save)
            rows_for(True, calls, mesh, results.save)
        finally:
            dist.destroy_process_group()


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, smoke="the CPU, gloo, no graphs (checks the script only)")


if __name__ == "__main__":
    main()
