"""Which attention kernel each role runs, with and without gradients, as far as the spec decides it (no torch).

``explain`` shows it before a build; the attention policy (``policies/attention.py``) follows the same rules and
adds what only the device can say (which kernels are usable, what ``auto`` chose).
"""

from __future__ import annotations

from .pipeline import PipelineSpec

# Named backends that run as named with gradients too: torch's own flash, memory-efficient and math kernels.
SAFE_NAMED = ("sdpa_flash", "sdpa_efficient", "sdpa_math")
# What plain ``sdpa`` is where a forward may be differentiated (a forward with gradients, a rollout, a replay).
SAFE_SDPA = ("sdpa with cuDNN attention off (flash attention; memory-efficient where a call has a mask; math last), "
             "whose backward torch trains with everywhere")


def auto_as_sdpa(spec: PipelineSpec) -> str | None:
    """Why ``auto`` must be plain sdpa for this spec, or None when it may time kernels.

    Under compile, per-module hooks would make the compiler recompile every block (the compiler's own SDPA
    lowering decides the kernel); with several processes, timed trials could pick different kernels on
    different ranks, and the ranks of one sequence or cfg group must compute alike.
    """
    if spec.policies.compile.mode != "none":
        return "auto under compile: the compiler picks the SDPA kernel"
    if spec.policies.parallel.world_size > 1:
        return "auto with several processes: every rank runs the same kernel"
    return None


ALSO = "; rollouts and their replays run it too, so a replay computes its rollout's forward"
# What the approximate backends compute (``kernels/sage.py``, ``kernels/int8_fp8.py``), and their backward.
FORWARDS = {
    "sage": ("approximate: Q and K (K less its mean over tokens) quantized to int8 per block of tokens, softmax in "
             "float32, P·V in the input's dtype; sageattention's kernel on CUDA, omnispec's plain-torch reference on "
             "the CPU; calls with a mask, causal or with dropout run on sdpa"),
    "int8_fp8": ("approximate: Q and K (K less its mean over tokens) quantized to int8 per block of 128 tokens, softmax "
                 "in float32, P and V (a scale per channel) in float8 e4m3 for P·V; omnispec's Triton kernel on CUDA "
                 "(8-bit tensor cores: Ada, Hopper and later), its plain-torch reference on the CPU; calls with a "
                 "mask, causal or with dropout run on sdpa"),
}
STRAIGHT_THROUGH = ("its backward is exact attention's at the same q, k and v (straight-through), on torch's flash or "
                    "memory-efficient attention, never cuDNN's")


def approximation(backend: str) -> str:
    """What an approximate backend computes, as a clause ending in "; " (nothing for an exact one)."""
    return f"{FORWARDS[backend]}; " if backend in FORWARDS else ""


def training_backend(backend: str, compiled: bool) -> str:
    """What a role whose forward without gradients runs ``backend`` runs where a forward may be differentiated."""
    if backend == "sdpa" or backend == "auto":
        return SAFE_SDPA + ALSO
    if backend in SAFE_NAMED:
        return f"{backend} (named; its backward is torch's own){ALSO}"
    if backend in FORWARDS and compiled:
        return f"{backend} (named; {FORWARDS[backend]}; {STRAIGHT_THROUGH}), compiled in{ALSO}"
    if backend in FORWARDS:
        return (f"{backend} (named; {FORWARDS[backend]}; {STRAIGHT_THROUGH}), each call shape first checked by a trial "
                f"forward and backward; a shape that fails it runs on sdpa with cuDNN attention off{ALSO}")
    if backend == "flash4" and compiled:
        return ("flash4 (its operators run a call shape FA4 refuses, forward or backward, on sdpa with cuDNN "
                f"attention off){ALSO}")
    return (f"{backend} (named), each call shape first checked by a trial forward and backward; a shape that fails it "
            f"runs on sdpa with cuDNN attention off{ALSO}")


def planned_attention(spec: PipelineSpec) -> tuple[dict[str, str], dict[str, str]]:
    """For the policy's ``default`` and each of its ``per_role`` entries: the backend it asks for without gradients,
    and the one where a forward may be differentiated, each with how it is chosen. Which attention modules each role
    is, and the checks against a device, need the family and the device: ``Pipeline.explain()`` shows them per role
    after a build."""
    policy = spec.policies.attention
    forced = auto_as_sdpa(spec)
    compiled = spec.policies.compile.mode != "none"
    plain_notes, training_notes = {}, {}
    for role, backend in {"default": policy.default, **policy.per_role}.items():
        source = "default" if role == "default" else "per_role"
        if backend == "auto" and forced:
            plain, trained = f"sdpa ({forced})", training_backend("sdpa", compiled)
        elif backend == "auto":
            plain = ("auto: the fastest usable exact backend, timed per shape on first use (never slower than "
                     "sdpa)")
            trained = ("auto over the backends whose trial forward and backward pass, timed that way per shape on "
                       f"first use (sdpa_cudnn left out; sdpa is {SAFE_SDPA}){ALSO}")
        else:
            plain = f"{backend} ({source}; {approximation(backend)}checked by a test call at build"
            plain += ", falls back to sdpa if unusable)" if policy.allow_fallback else ")"
            trained = training_backend(backend, compiled)
        plain_notes[role], training_notes[role] = plain, trained
    return plain_notes, training_notes
