"""The component profile: which modules make up the model and what role each plays."""

from __future__ import annotations

import re
from typing import Literal, Union

from pydantic import Field, ValidationInfo, field_validator

from .base import DType, SpecModel

Role = Literal["denoiser", "encoder", "tokenizer", "processor", "vae", "scheduler", "resident", "upsampler", "other"]
ROLES: tuple[str, ...] = Role.__args__  # type: ignore[attr-defined]
# Roles whose components hold no weights (tokenizers, image processors, schedulers): no dtype, no placement.
WEIGHTLESS_ROLES = ("tokenizer", "processor", "scheduler")
OptionValue = Union[bool, int, float, str, None]

# Built-in family adapters (omnispec.runtime.families registers the same names; a test keeps them equal).
BUILTIN_FAMILIES = ("flux", "flux_kontext", "sd3", "wan", "wan_i2v", "ltx2", "ltx2_condition", "digits",
                    "qwen_image", "qwen_image_edit", "qwen_image_edit_plus", "z_image", "hunyuan_video15",
                    "hunyuan_video15_i2v")
# Packages whose classes a spec may name without --trust-code: importing them runs only their own code. The
# embedded model is omnispec.src_models, so no other distribution's top-level package is trusted by name.
TRUSTED_PACKAGES = ("diffusers", "transformers", "omnispec")

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_CLASS_REF = re.compile(rf"^{_DOTTED}(:{_DOTTED})?$")


def check_import_ref(ref: str, info: ValidationInfo, what: str) -> str:
    """Refuse references to code outside the trusted packages unless the caller trusts the spec."""
    if not _CLASS_REF.match(ref):
        raise ValueError(f"{what} must look like 'package.Class' or 'package.module:Class', got {ref!r}")
    package = ref.split(":")[0].split(".")[0]
    trusted = bool(info.context and info.context.get("trust_code"))
    if package not in TRUSTED_PACKAGES and not trusted:
        raise ValueError(
            f"{what} {ref!r} would import code from {package!r}; only {', '.join(TRUSTED_PACKAGES)} are "
            "imported without --trust-code (trust_code=True)"
        )
    return ref


class Component(SpecModel):
    role: Role
    class_: str = Field(alias="class", description="'diffusers.Name', 'transformers.Name' or 'pkg.module:Name'.")
    subfolder: str | None = None
    source: str | None = Field(default=None, description=(
        "This component's checkpoint root (Hub id or local dir) when it is not model.source's."))
    dtype: DType | None = Field(default=None, description="Overrides model.dtype for this component.")
    file: str | None = Field(default=None, description="A single weights file inside the subfolder.")
    config: dict[str, OptionValue | list[OptionValue]] = Field(default_factory=dict, description=(
        "Entries of the component's own config replaced at load (from_pretrained's config overrides), e.g. "
        "LTX-2.0's transformer perturbed_attn: true to make spatio-temporal guidance act as Lightricks' code does."))

    @field_validator("class_")
    @classmethod
    def _trusted_class(cls, ref: str, info: ValidationInfo) -> str:
        return check_import_ref(ref, info, "class")


class AdapterSlot(SpecModel):
    """A LoRA that can be switched on for a phase (``recipe.phases[].adapter``), or on in every phase (``always``:
    a LoRA the user adds to the model, as ``omnispec run --lora`` does)."""

    path: str = Field(description="Local directory/file or Hub id of the LoRA weights.")
    weight_name: str | None = None
    scale: float = 1.0
    target: str | None = Field(default=None, description="Component to load into; the phase's denoiser if unset.")
    always: bool = Field(default=False, description=(
        "Active in every phase whose denoiser is its target, beside the phase's own slot."))


class ModelSpec(SpecModel):
    family: str
    source: str | None = Field(default=None, description="Checkpoint root: Hub id or local directory.")
    revision: str | None = None
    dtype: DType = "bfloat16"
    components: dict[str, Component] = Field(min_length=1)
    adapters: dict[str, AdapterSlot] = Field(default_factory=dict)
    options: dict[str, OptionValue] = Field(default_factory=dict, description=(
        "Settings the family adapter reads (each family lists its own, e.g. flux_kontext's max_area); unknown "
        "names are refused at build."))
    check_checkpoint: bool = Field(default=True, description=(
        "Compare the spec with the checkpoint's model_index.json and scheduler config at build (class names, "
        "a two-expert boundary, the keys that set the sigmas) and refuse a mismatch."))

    @field_validator("family")
    @classmethod
    def _known_family(cls, family: str, info: ValidationInfo) -> str:
        if ":" in family:
            return check_import_ref(family, info, "family")
        if family not in BUILTIN_FAMILIES:
            raise ValueError(f"unknown family {family!r}; built in: {', '.join(BUILTIN_FAMILIES)}, or 'pkg.module:Class'")
        return family

    def names_with_role(self, role: str) -> list[str]:
        return [name for name, c in self.components.items() if c.role == role]
