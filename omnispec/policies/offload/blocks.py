"""Layerwise and group offload: the denoiser's blocks stream to the device as they run, through diffusers'
``apply_group_offloading`` (block level, N blocks per group, side-stream prefetch on CUDA)."""

from __future__ import annotations

from typing import Any

import torch


class BlockOffload:
    def apply(self, policy: Any, modules: dict[str, torch.nn.Module], roles: dict[str, str],
              device: torch.device) -> str:
        from diffusers.hooks import apply_group_offloading

        per_group = getattr(policy, "blocks_per_group", 1)
        use_stream = policy.prefetch and device.type == "cuda"
        if getattr(policy, "distributed", False):  # the shard axis keeps each rank's shards on its host
            for name, m in modules.items():
                if roles[name] != "denoiser":
                    m.to(device)
            return (f"{policy.strategy}, distributed: each rank's shard of every denoiser block in host memory, "
                    f"all-gathered to {device} as the block runs; other components on {device}")
        for name, m in modules.items():
            if roles[name] == "denoiser":
                apply_group_offloading(m, onload_device=device, offload_device=torch.device("cpu"),
                                       offload_type="block_level", num_blocks_per_group=per_group,
                                       use_stream=use_stream, record_stream=use_stream,
                                       low_cpu_mem_usage=not policy.pin_memory)
            else:
                m.to(device)
        return (f"{policy.strategy}: denoiser blocks streamed {per_group} at a time"
                f"{' with side-stream prefetch' if use_stream else ''}; other components on {device}")

    def host_bytes(self, policy: Any, components: list[Any]) -> int:
        """The denoisers' streamed blocks, kept in host memory between their onloads."""
        return sum(sum(c.blocks.values()) for c in components if c.role == "denoiser" and c.blocks)

    def device_bytes(self, policy: Any, stage: str, roles: tuple[str, ...], components: list[Any],
                     accelerator: bool) -> int:
        """Everything but the denoisers' blocks; while denoising, one group of the largest blocks (two when
        the next is prefetched on a side stream, which only happens on an accelerator)."""
        groups = getattr(policy, "blocks_per_group", 1) * (2 if policy.prefetch and accelerator else 1)
        weights = sum(c.bytes for c in components)
        for c in components:
            if c.role == "denoiser" and c.blocks:
                streamed = sum(c.blocks.values())
                weights -= streamed
                if stage == "denoise":
                    weights += min(streamed, groups * max(c.blocks.values()))
        return weights


BLOCKS = BlockOffload()
