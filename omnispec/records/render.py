"""``omnispec explain OUTPUT``: what made an output, then the plan of its spec (read only: nothing is built)."""

from __future__ import annotations

from ..spec import load_spec
from ..spec.errors import printable
from ..spec.explain import explain_spec, render_explain
from .schema import HubRoot, Record, RecordedVideo


def render(record: Record, path: str | None = None) -> str:
    versions_text = ", ".join(f"{k} {v}" for k, v in record.versions.model_dump().items())
    request = record.request
    sample = record.sample
    lines = [f"{path or 'output'}: made {record.created} on {record.device} ({versions_text})"]
    indices = range(len(request.prompts)) if sample is None else [sample]
    for i in indices:
        lines.append(f"  prompt {request.prompts[i]!r}, seed {request.seeds[i]}"
                     + (f" (sample {i} of {len(request.prompts)})" if sample is not None else ""))
    fields = ("height", "width", "frames", "fps", "steps", "sigmas", "guidance_scale", "max_sequence_length",
              "strength", "mask_blur", "negative_prompt")
    settings = {k: getattr(request, k) for k in fields if getattr(request, k) not in (None, "")}
    lines.append("  " + ", ".join(f"{k} {v}" for k, v in settings.items()))
    if request.requested is not None:
        asked = ", ".join(f"{k} {v}" for k, v in request.requested.model_dump().items() if v is not None)
        lines.append(f"  asked for {asked}; generated at the size above")
    for i, image in enumerate(request.images):
        lines.append(f"  image {i}: {image.path or '(in memory)'} at frame {image.frame}, "
                     f"sha256 {image.digest[:16]}...")
    for i, image in enumerate(request.references):
        lines.append(f"  reference {i}: {image.path or '(in memory)'}, sha256 {image.digest[:16]}...")
    if request.video is not None:
        lines.append(f"  video: {request.video.path or '(in memory)'}, {request.video.frames} frames, "
                     f"sha256 {request.video.digest[:16]}...")
    if request.mask is not None:
        frames = f", {request.mask.frames} frames" if isinstance(request.mask, RecordedVideo) else ""
        lines.append(f"  mask: {request.mask.path or '(in memory)'}{frames}, sha256 {request.mask.digest[:16]}...")
    checkpoint = record.checkpoint
    for described in checkpoint.roots.values():
        if isinstance(described, HubRoot):
            lines.append(f"checkpoint: {described.repo} (Hub, revision {described.revision or 'unknown'})")
        else:
            lines.append(f"checkpoint: {described.path} (local, {len(described.config_sha256)} config files hashed)")
    if checkpoint.in_memory:
        lines.append(f"components given in memory: {', '.join(checkpoint.in_memory)}")
    if record.weights_changed:
        lines.append("weights changed in memory after loading: the checkpoint alone does not reproduce it")
    if record.preset is not None:
        approximate = f" (approximate: {', '.join(record.preset.approximate)})" if record.preset.approximate else ""
        lines.append(f"preset {record.preset.name}: turned on {', '.join(record.preset.turned_on) or 'nothing'}"
                     + approximate)
    if record.replay_of is not None:
        drift = "; ".join(record.replay_of.drift) or "same versions"
        lines.append(f"made again from a record ({drift})")
    lines = [printable(line) for line in lines]  # record strings: no control character reaches the terminal
    spec = load_spec(record.spec, trust_code=True)  # reading only: validation imports nothing
    lines.append(render_explain(explain_spec(spec, request.steps)))
    return "\n".join(lines)


__all__ = ["render"]
