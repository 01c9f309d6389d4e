"""Kernels omnispec writes or wraps, beneath the policies that put them in place: the fused q/k norm + RoPE operator
and its Triton kernel, FlashAttention-4 as torch operators, cuBLASLt's GEMM epilogues, torch's SDPA kernels as
omnispec chooses among them, inductor's heuristics and graph passes. Every private torch name they (and the rest of
omnispec) read is in ``torch_internals``.

Imports point one way: ``policies -> kernels``; nothing here imports a policy.
"""
