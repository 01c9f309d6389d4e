"""The resolved run of a spec, without loading weights: what ``omnispec explain`` prints."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .checkpoint import CheckpointConfigs
from .errors import SpecError
from .pipeline import PipelineSpec
from .plan import StepPlan, compile_plan, compress_plan
from .policies import PARALLEL_AXES
from .presets import asked
from .recipe import Phase
from .weights_file import locate, read_weights_file


def static_sigmas(spec: PipelineSpec, phase: Phase, steps: int) -> list[float] | None:
    """Step sigmas (without the terminal 0) when they follow from the spec alone, else None."""
    return phase.schedule.static_sigmas(steps, spec.recipe.schedules)


def phase_step_count(spec: PipelineSpec, phase: Phase, steps: int) -> int | None:
    """A phase's step count, or None for a segment whose split only the checkpoint's scheduler knows."""
    return phase.schedule.step_count(steps)


def explain_spec(
    spec: PipelineSpec,
    steps: int | None = None,
    phase_sigmas: Mapping[str, Sequence[float]] | None = None,
    attention: Mapping[str, Any] | None = None,
    attention_with_gradients: Mapping[str, Any] | None = None,
    weights: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A JSON-ready description of the run.

    ``phase_sigmas`` (the sigmas each phase actually steps through, from the runtime) replaces what
    can't be known from the spec alone (dynamic shift, a checkpoint's scheduler, segment splits).
    """
    steps = steps or spec.recipe.defaults.steps
    phases = []
    for phase in spec.recipe.phases:
        sigmas = list(phase_sigmas[phase.name]) if phase_sigmas and phase.name in phase_sigmas else None
        if sigmas is None:
            sigmas = static_sigmas(spec, phase, steps)
        n = len(sigmas) if sigmas is not None else phase_step_count(spec, phase, steps)
        plans = _plan_or_none(phase, n, sigmas) if n else None
        entry: dict[str, Any] = {
            "name": phase.name,
            "denoiser": phase.denoiser,
            "steps": n,
            "schedule": phase.schedule.describe(spec.recipe.schedules),
            "sigma_range": [sigmas[0], sigmas[-1]] if sigmas else None,
            "input": phase.input.model_dump(mode="json", exclude_defaults=True) | {"kind": phase.input.kind},
            "adapter": phase.adapter,
            "sampler": phase.sampler.kind,
            "embedded_guidance": plans[0].embedded if plans else None,
            "renorm": phase.guidance.renorm.model_dump(exclude_none=True) if phase.guidance.renorm else None,
            "passes": list(plans[0].passes) if plans else _first_passes(phase),
            "plan": [_describe_run(first, last, plan) for first, last, plan in compress_plan(plans)] if plans else [],
        }
        if n is None:
            of = phase.schedule.of  # type: ignore[union-attr]
            shared = spec.recipe.schedules[of]
            entry["shared_steps"] = shared.steps or steps
            entry["split"] = (f"unknown without the checkpoint: its scheduler decides which of the {entry['shared_steps']} "
                              f"steps of {of!r} fall in this segment (omnispec explain --source DIR)")
        phases.append(entry)
    out: dict[str, Any] = {
        "name": spec.name,
        "family": spec.model.family,
        "source": spec.model.source,
        "task": spec.recipe.task,
        "defaults": spec.recipe.defaults.model_dump(mode="json", exclude_none=True),
        "components": {name: c.role for name, c in spec.model.components.items()},
        "adapters": {name: {"path": a.path, "weight_name": a.weight_name, "scale": a.scale,
                            "on": "every phase" if a.always else
                            [p.name for p in spec.recipe.phases if p.adapter == name]}
                     for name, a in spec.model.adapters.items()},
        "phases": phases,
        "output_phase": spec.recipe.phases[spec.recipe.output_index() or 0].name,
        "policies": spec.policies.model_dump(mode="json"),
    }
    if spec.policies.preset != "none":
        out["preset"] = {"name": spec.policies.preset, "asks": asked(spec.policies.preset)}
    if spec.policies.parallel.world_size > 1:
        out["mesh"] = describe_mesh(spec)
    if attention is not None:
        out["attention"] = dict(attention)
    if attention_with_gradients is not None:
        out["attention_with_gradients"] = dict(attention_with_gradients)
    if weights:
        out["weights"] = dict(weights)
    return out


def describe_weights(spec: PipelineSpec, configs: CheckpointConfigs | None, root: str | None,
                     only: Iterable[str] | None = None) -> dict[str, str]:
    """Components whose weights are not a plain diffusers folder, with what they are: a single file (its format and
    tensor types, read from its header) or a checkpoint's pre-quantized weights (method, scheme, compute dtype)."""
    out = {}
    for name, component in spec.model.components.items():
        if only is not None and name not in only:
            continue
        dtype = component.dtype or spec.model.dtype
        if component.file is not None:
            where = f"model.components.{name}.file"
            try:
                path = locate(component, root, where, spec.model.revision, fetch=False)
                what = read_weights_file(path, where, trusted=True).describe() if path else "a Hub file, not fetched yet"
            except SpecError as exc:  # explain describes the plan; loading is where a bad file stops the run
                path, what = None, f"not readable here: {exc.problems[0].message}"
            out[name] = f"single file {path or component.file} ({what}), computes in {dtype}"
        elif configs is not None and name in configs.prequantized:
            out[name] = f"pre-quantized by its checkpoint: {configs.prequantized[name].describe()}"
    return out


def describe_mesh(spec: PipelineSpec) -> list[str]:
    """Which rank holds and runs what, one line per rank, on the mesh ``runtime/parallel/context.py`` lays out
    (row-major over ``PARALLEL_AXES``' mesh axes: the sample groups outermost, the ranks in step innermost)."""
    par = spec.policies.parallel
    host = getattr(spec.policies.offload, "distributed", False)
    lines = []
    for rank in range(par.world_size):
        coords, rest = {}, rank
        for name in reversed(PARALLEL_AXES.mesh_names):
            degree = getattr(par, name)
            coords[name], rest = rest % degree, rest // degree
        parts = []
        if par.data * par.shard > 1:
            parts.append(f"samples of group {rank // par.in_step} of {par.data * par.shard}")
        if par.shard > 1:
            where = "host memory, gathered to the device as it runs" if host else "gathered as it runs"
            parts.append(f"1/{par.shard} of every denoiser block ({where})")
        if par.cfg > 1:
            parts.append(f"guidance passes {coords['cfg']}::{par.cfg}")
        if par.tensor > 1:
            parts.append(f"1/{par.tensor} of the split linears (heads {coords['tensor']}/{par.tensor})")
        if par.sequence > 1:
            parts.append(f"1/{par.sequence} of each forward's tokens")
        if par.vae_patch > 1:
            parts.append(f"VAE tiles {rank % par.in_step % par.vae_patch}::{par.vae_patch}")
        lines.append(f"rank {rank}: " + "; ".join(parts or ["everything (replicated)"]))
    return lines


def _first_passes(phase: Phase) -> list[str]:
    """The passes a phase starts with when its step count is unknown (a segment without the checkpoint)."""
    plan = _plan_or_none(phase, 1, None)
    return list(plan[0].passes) if plan else ["cond"]


def _plan_or_none(phase: Phase, n: int, sigmas: Sequence[float] | None) -> list[StepPlan] | None:
    try:
        return compile_plan(phase.guidance, n, sigmas)
    except ValueError:  # sigma-keyed guidance and sigmas only known at run time
        return None


def _describe_run(first: int, last: int, plan: StepPlan) -> dict[str, Any]:
    return {
        "steps": [first, last],
        "passes": list(plan.passes),
        "coefficients": plan.coefficients,
        **({"embedded": plan.embedded} if plan.embedded is not None else {}),
        **({"rescale": plan.rescale} if plan.rescale else {}),
        **({"zero": True} if plan.zero else {}),
    }


def _per_stream(value: float | Mapping[str, float]) -> str:
    """``2`` or ``{video 2, audio 6}``: a value for every stream, or one per named stream."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{stream} {v:g}" for stream, v in value.items()) + "}"
    return f"{value:g}"


def render_explain(info: Mapping[str, Any]) -> str:
    lines = [f"{info['name']}  (family {info['family']}, task {info['task']}, source {info['source']})"]
    lines.append("components:")
    lines += [f"  {name:<16} {role}" for name, role in info["components"].items()]
    if info.get("adapters"):
        lines.append("adapters:")
        for name, a in info["adapters"].items():
            where = a["on"] if isinstance(a["on"], str) else (f"phases {', '.join(a['on'])}" if a["on"] else "no phase")
            weights = a["path"] + (f" ({a['weight_name']})" if a["weight_name"] else "")
            lines.append(f"  {name:<16} {weights}, scale {a['scale']:g}, on in {where}")
    for phase in info["phases"]:
        sr = phase["sigma_range"]
        sigma_text = f"sigma {sr[0]:.4g} -> {sr[1]:.4g}" if sr else "sigmas from the checkpoint at run time"
        count = f"{phase['steps']} steps" if phase["steps"] is not None else (
            f"its part of {phase['shared_steps']} shared steps (split unknown without --source)")
        lines.append(f"phase {phase['name']!r}: denoiser {phase['denoiser']}, {count}, {phase['schedule']}, {sigma_text}")
        lines.append(f"  input: {phase['input']['kind']}   adapter: {phase['adapter'] or '-'}   sampler: {phase['sampler']}")
        if phase.get("renorm"):
            cap = phase["renorm"].get("max_ratio")
            lines.append(f"  renorm: guided prediction scaled to the cond pass's norm per {phase['renorm']['over']}"
                         + (f", when above {cap:g} times it" if cap else ""))
        if not phase["plan"] and phase["steps"] is None:
            lines.append("  guidance: planned per step once the split is known")
        elif not phase["plan"]:
            lines.append("  guidance: resolved at run time (sigma-keyed)")
        for run in phase["plan"]:
            a, b = run["steps"]
            span = f"step {a}" if a == b else f"steps {a}-{b}"
            coef = ", ".join(f"{k} x{_per_stream(v)}" for k, v in run["coefficients"].items())
            extra = "".join(
                [f"; embedded {run['embedded']:g}" if "embedded" in run else "",
                 f"; rescale {_per_stream(run['rescale'])}" if "rescale" in run else "",
                 "; zero prediction" if run.get("zero") else ""]
            )
            lines.append(f"  {span:<12} passes [{', '.join(run['passes'])}]{' ' + coef if coef else ''}{extra}")
    lines.append(f"output: phase {info['output_phase']!r}")
    pol = info["policies"]
    lines.append("policies:")
    attention = pol["attention"]
    lines.append(f"  attention    default {attention['default']}, per role {attention['per_role'] or '-'}"
                 + (", q/k norms + RoPE in one kernel" if attention["fused_qk_norm_rope"] else ""))
    if sparse := attention.get("sparse"):
        lines.append(f"               sparse {sparse['kind']}, tiles {'x'.join(map(str, sparse['tile']))}, window "
                     f"{'x'.join(map(str, sparse['window']))}, dense for the first {sparse['dense_fraction']:.0%} of "
                     "each phase's steps [approximate]")
    mlp = [what for key, what in (("fused_gelu", "bias + GELU in the matmul"),
                                  ("precomputed_modulation", "modulation linears precomputed per request"))
           if pol["mlp"][key]]
    if mlp:
        lines.append(f"  mlp          {', '.join(mlp)}")
    for key in ("offload", "cache"):
        inner = dict(pol[key])
        kind = inner.pop("strategy", None) or inner.pop("kind", None)
        lines.append(f"  {key:<12} {kind}{' ' + str(inner) if inner else ''}")
    lines.append(f"  quantization {pol['quantization'] or '-'}")
    compiled = pol["compile"]
    options = [name for name in ("cudagraphs", "autotune", "vae") if compiled[name]]
    lines.append(f"  compile      {compiled['mode']}{' (' + ', '.join(options) + ')' if options else ''}")
    par = pol["parallel"]
    lines.append("  parallel     " + " x ".join(f"{k}={v}" for k, v in par.items()))
    vae = pol.get("vae", {})
    if vae.get("tiling") or vae.get("slicing"):
        lines.append(f"  vae          tiling {vae['tiling']}, slicing {vae['slicing']}")
    if info.get("preset"):
        lines.append(f"  preset       {info['preset']['name']}: asks for each of these where the family and device "
                     "support it (a build says which); fields the spec sets keep their values")
        for item in info["preset"]["asks"]:
            mark = "  [approximate]" if item["approximate"] else ""
            lines.append(f"    {item['field']} = {item['value']}: {item['what']}, {item['where']}{mark}")
    if info.get("mesh"):
        lines.append("mesh:")
        lines += [f"  {line}" for line in info["mesh"]]
    if "attention" in info:
        lines.append("attention per role:")
        lines += [f"  {role:<12} {why}" for role, why in info["attention"].items()]
    if "attention_with_gradients" in info:
        lines.append("attention per role with gradients (and in rollouts and replays):")
        lines += [f"  {role:<12} {why}" for role, why in info["attention_with_gradients"].items()]
    if info.get("weights"):
        lines.append("weights:")
        lines += [f"  {name}: {note}" for name, note in info["weights"].items()]
    if info.get("applied"):
        lines.append("applied here:")
        lines += [f"  {key:<12} {note}" for key, note in info["applied"].items()]
    return "\n".join(lines)
