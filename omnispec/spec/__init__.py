"""The omnispec spec layer: pure data (pydantic v2), its loader and pure helpers. Never imports torch."""

from .errors import Problem, SpecError, SpecTypeError
from .explain import explain_spec, render_explain
from .guidance import (
    APG,
    CFG,
    CFGZeroStar,
    GuidanceSpec,
    Modality,
    ScaleSchedule,
    SkipLayer,
    TrueCFG,
    Window,
)
from .loader import (
    apply_override,
    deep_merge,
    dump_spec,
    load_spec,
    resolve_spec_data,
    spec_with_overrides,
    validate_spec,
)
from .model import BUILTIN_FAMILIES, AdapterSlot, Component, ModelSpec
from .pipeline import PipelineSpec, RuntimeSpec
from .plan import PlannedTerm, StepPlan, compile_plan, compress_plan
from .policies import Policies
from .recipe import Constraints, Phase, Recipe, RequestDefaults
from .schedule import FlowMatchSchedule, SchedulerSchedule, SegmentSchedule, flow_match_sigmas


def json_schema() -> dict:
    """JSON Schema of ``PipelineSpec`` (for editor completion of YAML specs)."""
    schema = PipelineSpec.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "omnispec pipeline spec"
    return schema


__all__ = [
    "APG", "CFG", "CFGZeroStar", "AdapterSlot", "BUILTIN_FAMILIES", "Component", "Constraints", "GuidanceSpec",
    "FlowMatchSchedule", "Modality", "ModelSpec", "Phase", "PipelineSpec", "PlannedTerm", "Policies", "Problem",
    "Recipe", "RequestDefaults", "RuntimeSpec", "ScaleSchedule", "SchedulerSchedule", "SegmentSchedule",
    "SkipLayer", "SpecError", "SpecTypeError", "StepPlan", "TrueCFG", "Window", "apply_override", "compile_plan",
    "compress_plan", "deep_merge", "dump_spec", "explain_spec", "flow_match_sigmas", "json_schema", "load_spec",
    "render_explain", "resolve_spec_data", "spec_with_overrides", "validate_spec",
]
