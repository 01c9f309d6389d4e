"""RL weight sync of a LoRA under regional compile: recompiles and time per ``omnispec.rl.set_lora`` sync.
No peer: ``--replace`` (delete and reload the adapter each sync, the behaviour before the hotswap) is the comparison.

``python -m benchmarks.gpu_lora_hotswap [--syncs 5] [--rank 64] [--json FILE]``  (needs CUDA; ``--smoke``: tiny
FLUX on the CPU with dynamo's eager backend)

FLUX.1-dev-size transformer (random bf16 weights), ``policies.compile.mode: regional`` (inductor). A rank-``rank``
LoRA on the attention projections is set, one step runs (compiling), then each sync sets new LoRA weights (another
seed; every other sync half the rank and another alpha, padded to ``--rank`` by ``enable_lora_hotswap``) and runs
one step. Recorded per sync: dynamo's recompiles and new graphs (``CompileWatch``), the sync's time and the step's.
``--replace`` deletes and reloads the adapter instead (the behaviour before the hotswap), for comparison.
"""

from __future__ import annotations

import time

import torch

from . import harness
from .workloads import WORKLOADS

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def lora_targets(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The attention projections a LoRA adapts (taken before any adapter wraps them)."""
    return [(name, m) for name, m in transformer.named_modules()
            if isinstance(m, torch.nn.Linear) and "attn" in name and any(name.endswith(t) for t in TARGETS)]


def lora_state(targets: list[tuple[str, torch.nn.Linear]], rank: int, alpha: float, seed: int) -> tuple[dict, dict]:
    """A random LoRA for the target layers, as a trainer's state dict and its config."""
    torch.manual_seed(seed)
    state = {}
    for name, module in targets:
        like = dict(dtype=module.weight.dtype, device=module.weight.device)
        state[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, **like) * 0.01
        state[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, **like) * 0.01
    return state, {"r": rank, "lora_alpha": alpha, "target_modules": TARGETS}


def add_arguments(parser) -> None:
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--replace", action="store_true", help="delete and reload the adapter on each sync")


def benchmark(args, results: harness.Results) -> None:
    import omnispec
    from omnispec.rl import set_lora, weights

    if args.replace:  # the behaviour before hotswap: a new adapter every sync
        def replace(module, name, state, kwargs):
            module.delete_adapters(name)
            module.load_lora_adapter(state, adapter_name=name, prefix=None, **kwargs)
            return False

        weights._replace_lora = replace
    results.header |= {"device": harness.device_name(), "rank": args.rank,
                       "mode": "replace" if args.replace else "hotswap"}
    w = WORKLOADS["flux"]
    backend = "eager" if args.smoke else "inductor"
    pipe = omnispec.build(harness.ROOT / "specs" / w["spec"], components=w["components"](), device=harness.DEVICE,
                          overrides=["runtime.progress=false", "policies.attention.default=sdpa",
                                     f"policies.compile={{mode: regional, backend: {backend}}}"])
    targets = lora_targets(pipe.components["transformer"])
    request = dict(w["request"], steps=1)
    state, meta = lora_state(targets, args.rank, args.rank, seed=0)
    set_lora(pipe, "policy", state, metadata=meta, max_rank=args.rank)
    start = time.perf_counter()
    pipe("a photo of a cat", seed=0, **request)
    harness.sync()
    results.save({"event": "first step (compiles)", "step_s": time.perf_counter() - start})
    for i in range(1, args.syncs + 1):
        rank = args.rank if i % 2 == 0 else max(1, args.rank // 2)
        state, meta = lora_state(targets, rank, rank * (1 + i % 3), seed=i)
        with harness.CompileWatch() as watch:
            harness.sync()
            start = time.perf_counter()
            set_lora(pipe, "policy", state, metadata=meta)
            harness.sync()
            synced = time.perf_counter()
            pipe("a photo of a cat", seed=0, **request)
            harness.sync()
        results.save({"event": f"sync {i} (rank {rank}, alpha {meta['lora_alpha']})", "sync_s": synced - start,
                      "step_s": time.perf_counter() - synced, **watch.summary()})


def main() -> None:
    harness.run_benchmark(__doc__, add_arguments, benchmark, needs_cuda=True,
                          smoke="tiny FLUX on the CPU with dynamo's eager backend (checks the script only)")


if __name__ == "__main__":
    main()
