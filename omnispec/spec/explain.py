"""The resolved run of a spec, without loading weights: what ``omnispec explain`` prints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .pipeline import PipelineSpec
from .plan import StepPlan, compile_plan, compress_plan
from .recipe import Phase
from .schedule import FlowMatchSchedule, SchedulerSchedule, SegmentSchedule, flow_match_sigmas


def static_sigmas(spec: PipelineSpec, phase: Phase, steps: int) -> list[float] | None:
    """Step sigmas (without the terminal 0) when they follow from the spec alone, else None."""
    schedule = phase.schedule
    if isinstance(schedule, SegmentSchedule):
        return None
    if isinstance(schedule, FlowMatchSchedule) and schedule.shift != "dynamic":
        return flow_match_sigmas(schedule, schedule.steps or steps)[:-1]
    return None


def phase_step_count(spec: PipelineSpec, phase: Phase, steps: int) -> int:
    schedule = phase.schedule
    if isinstance(schedule, SegmentSchedule):
        shared = spec.recipe.schedules[schedule.of]
        return shared.steps or steps
    if isinstance(schedule, FlowMatchSchedule) and schedule.sigmas is not None:
        return len(schedule.sigmas)
    return schedule.steps or steps


def explain_spec(
    spec: PipelineSpec,
    steps: int | None = None,
    phase_sigmas: Mapping[str, Sequence[float]] | None = None,
    attention: Mapping[str, Any] | None = None,
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
        plans = _plan_or_none(phase, n, sigmas)
        entry: dict[str, Any] = {
            "name": phase.name,
            "denoiser": phase.denoiser,
            "steps": n,
            "schedule": _describe_schedule(spec, phase),
            "sigma_range": [sigmas[0], sigmas[-1]] if sigmas else None,
            "input": phase.input.model_dump(mode="json", exclude_defaults=True) | {"kind": phase.input.kind},
            "adapter": phase.adapter,
            "sampler": phase.sampler.kind,
            "embedded_guidance": plans[0].embedded if plans else None,
            "passes": list(plans[0].passes) if plans else ["cond"],
            "plan": [_describe_run(first, last, plan) for first, last, plan in compress_plan(plans)] if plans else [],
        }
        phases.append(entry)
    out: dict[str, Any] = {
        "name": spec.name,
        "family": spec.model.family,
        "source": spec.model.source,
        "task": spec.recipe.task,
        "defaults": spec.recipe.defaults.model_dump(mode="json", exclude_none=True),
        "components": {name: c.role for name, c in spec.model.components.items()},
        "phases": phases,
        "output_phase": spec.recipe.phases[spec.recipe.output_index() or 0].name,
        "policies": spec.policies.model_dump(mode="json"),
    }
    if attention is not None:
        out["attention"] = dict(attention)
    return out


def _plan_or_none(phase: Phase, n: int, sigmas: Sequence[float] | None) -> list[StepPlan] | None:
    try:
        return compile_plan(phase.guidance, n, sigmas)
    except ValueError:  # sigma-keyed guidance and sigmas only known at run time
        return None


def _describe_schedule(spec: PipelineSpec, phase: Phase) -> str:
    s = phase.schedule
    if isinstance(s, FlowMatchSchedule):
        shift = "dynamic shift" if s.shift == "dynamic" else f"shift {s.shift:g}"
        return f"flow_match ({shift}{', explicit sigmas' if s.sigmas else ''})"
    if isinstance(s, SchedulerSchedule):
        return f"scheduler component {s.component!r}"
    shared = spec.recipe.schedules[s.of]
    inner = shared.kind if isinstance(shared, FlowMatchSchedule) else f"scheduler component {shared.component!r}"
    return f"segment [{s.low:g}, {s.high:g}{']' if s.high == 1 else ')'} of {s.of!r} ({inner})"


def _describe_run(first: int, last: int, plan: StepPlan) -> dict[str, Any]:
    return {
        "steps": [first, last],
        "passes": list(plan.passes),
        "coefficients": plan.coefficients,
        **({"embedded": plan.embedded} if plan.embedded is not None else {}),
        **({"rescale": plan.rescale} if plan.rescale else {}),
        **({"zero": True} if plan.zero else {}),
    }


def render_explain(info: Mapping[str, Any]) -> str:
    lines = [f"{info['name']}  (family {info['family']}, task {info['task']}, source {info['source']})"]
    lines.append("components:")
    lines += [f"  {name:<16} {role}" for name, role in info["components"].items()]
    for phase in info["phases"]:
        sr = phase["sigma_range"]
        sigma_text = f"sigma {sr[0]:.4g} -> {sr[1]:.4g}" if sr else "sigmas from the checkpoint at run time"
        count = f"{phase['steps']} steps" if sr or not phase["schedule"].startswith("segment") else (
            f"its part of {phase['steps']} shared steps"
        )
        lines.append(f"phase {phase['name']!r}: denoiser {phase['denoiser']}, {count}, {phase['schedule']}, {sigma_text}")
        lines.append(f"  input: {phase['input']['kind']}   adapter: {phase['adapter'] or '-'}   sampler: {phase['sampler']}")
        if not phase["plan"]:
            lines.append("  guidance: resolved at run time (sigma-keyed)")
        for run in phase["plan"]:
            a, b = run["steps"]
            span = f"step {a}" if a == b else f"steps {a}-{b}"
            coef = ", ".join(f"{k} x{v:g}" for k, v in run["coefficients"].items())
            extra = "".join(
                [f"; embedded {run['embedded']:g}" if "embedded" in run else "",
                 f"; rescale {run['rescale']:g}" if "rescale" in run else "",
                 "; zero prediction" if run.get("zero") else ""]
            )
            lines.append(f"  {span:<12} passes [{', '.join(run['passes'])}]{' ' + coef if coef else ''}{extra}")
    lines.append(f"output: phase {info['output_phase']!r}")
    pol = info["policies"]
    lines.append("policies:")
    lines.append(f"  attention    default {pol['attention']['default']}, per role {pol['attention']['per_role'] or '-'}")
    for key in ("offload", "cache"):
        inner = dict(pol[key])
        kind = inner.pop("strategy", None) or inner.pop("kind", None)
        lines.append(f"  {key:<12} {kind}{' ' + str(inner) if inner else ''}")
    lines.append(f"  quantization {pol['quantization'] or '-'}")
    lines.append(f"  compile      {pol['compile']['mode']}")
    par = pol["parallel"]
    lines.append("  parallel     " + " x ".join(f"{k}={v}" for k, v in par.items()))
    if "attention" in info:
        lines.append("attention per role:")
        lines += [f"  {role:<12} {why}" for role, why in info["attention"].items()]
    return "\n".join(lines)
