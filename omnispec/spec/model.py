"""The component profile: which modules make up the model and what role each plays."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .base import MAX_LORA_SCALE, DType, SpecModel
from .files import PICKLE_SUFFIXES
from .hub import hub_path_problem

Role = Literal["denoiser", "encoder", "tokenizer", "processor", "vae", "scheduler", "resident", "upsampler", "other"]
ROLES: tuple[str, ...] = Role.__args__  # type: ignore[attr-defined]
# Roles whose components hold no weights (tokenizers, image processors, schedulers): no dtype, no placement.
WEIGHTLESS_ROLES = ("tokenizer", "processor", "scheduler")
OptionValue = Union[bool, int, float, str, None]

# Built-in family adapters (omnispec.runtime.families registers the same names; a test keeps them equal).
BUILTIN_FAMILIES = ("flux", "flux_kontext", "flux_fill", "flux2_klein", "sd3", "wan", "wan_i2v", "wan_ti2v",
                    "wan_vace", "ltx2", "ltx2_condition", "digits", "qwen_image", "qwen_image_edit",
                    "qwen_image_edit_plus", "qwen_image_inpaint", "z_image", "hunyuan_video15", "hunyuan_video15_i2v",
                    "flux2", "kandinsky6", "ltx25", "ltx25_condition", "ltx25_ic", "krea2", "qwen_image21",
                    "minimax_h3", "flux3", "flux3_distilled", "minimax_h3_ref2va", "kandinsky6_sr")
# Packages whose classes a spec may name without --trust-code: importing them runs only their own code. The
# embedded model is omnispec.src_models, so no other distribution's top-level package is trusted by name.
TRUSTED_PACKAGES = ("diffusers", "transformers", "omnispec")

# Keywords of diffusers' and transformers' ``from_pretrained`` that decide what is loaded and from where, or whether
# a checkpoint's own code may run. A component's ``config`` replaces entries of the component's own config, so it
# may never name one of these: a spec (or an output record replayed) could otherwise turn on trust_remote_code.
LOADER_KEYWORDS = frozenset({
    "adapter_kwargs", "adapter_name", "allow_all_kernels", "attn_implementation", "cache_dir", "code_revision",
    "config", "custom_pipeline", "device_map", "device_mesh", "disable_mmap", "distributed_config", "dtype",
    "experts_implementation", "flashpack_kwargs", "force_download", "from_flax", "from_tf", "generation_config",
    "gguf_file", "ignore_mismatched_sizes", "kernel_config", "key_mapping", "local_files_only", "low_cpu_mem_usage",
    "max_memory", "mirror", "offload_buffers", "offload_folder", "offload_state_dict", "output_loading_info",
    "parallel_config", "proxies", "quantization_config", "resume_download", "return_unused_kwargs", "revision",
    "state_dict", "subfolder", "token", "torch_dtype", "tp_plan", "tp_size", "trust_remote_code", "use_auth_token",
    "use_flashpack", "use_kernels", "use_safetensors", "variant", "weights_only",
})

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_CLASS_REF = re.compile(rf"^{_DOTTED}(:{_DOTTED})?$")


def check_import_ref(ref: str, info: ValidationInfo, what: str) -> str:
    """Refuse references to code outside the trusted packages unless the caller trusts the spec, and dunder parts
    (``omnispec.__main__`` would make the CLI import its own entry point, running it again inside itself)."""
    if not _CLASS_REF.match(ref):
        raise ValueError(f"{what} must look like 'package.Class' or 'package.module:Class', got {ref!r}")
    dunder = [part for part in re.split(r"[.:]", ref) if part.startswith("__") and part.endswith("__")]
    if dunder:
        raise ValueError(f"{what} {ref!r} names {dunder[0]!r}: a module or class reference never names a dunder "
                         "(__main__, __init__ ...)")
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
    file: str | None = Field(default=None, description=(
        "One weights file (.safetensors or .gguf) holding this component, in its authors' key layout, a repack's or "
        "diffusers': a path (/x/model.safetensors; ./x relative to the spec file), a file inside the component's "
        "folder, or a Hub file as owner/name/path. Converted by diffusers' single-file converters; its config comes "
        "from the component's folder in the source."))
    config: dict[str, OptionValue | list[OptionValue]] = Field(default_factory=dict, description=(
        "Entries of the component's own config replaced at load (from_pretrained's config overrides), e.g. "
        "LTX-2.0's transformer perturbed_attn: true to make spatio-temporal guidance act as Lightricks' code does."))

    @field_validator("class_")
    @classmethod
    def _trusted_class(cls, ref: str, info: ValidationInfo) -> str:
        return check_import_ref(ref, info, "class")

    @field_validator("config")
    @classmethod
    def _config_entries_only(cls, config: dict[str, Any]) -> dict[str, Any]:
        loader = sorted(k for k in config if k in LOADER_KEYWORDS or k.startswith("_"))
        if loader:
            named = ", ".join(map(repr, loader))
            raise ValueError(f"{named}: keyword(s) of from_pretrained, not config entries; config replaces entries of "
                             "the component's own config file only (trusting a checkpoint's code is --trust-code, "
                             "given on the command line)")
        return config

    @field_validator("file")
    @classmethod
    def _no_pickle(cls, file: str | None, info: ValidationInfo) -> str | None:
        trusted = bool(info.context and info.context.get("trust_code"))
        if file is not None and file.lower().endswith(PICKLE_SUFFIXES) and not trusted:
            raise ValueError(f"{file!r} is a pickled weights file, which loading would run code from; use a "
                             ".safetensors (or .gguf) file, or pass --trust-code (trust_code=True) for a file you trust")
        if file is not None and not file.lower().endswith((".safetensors", ".gguf", *PICKLE_SUFFIXES)):
            raise ValueError(f"{file!r}: a weights file is a .safetensors or .gguf file")
        own = file is None or Path(file).is_absolute() or file.startswith(("./", "../", "~"))
        if not own and (problem := hub_path_problem(file)):  # a file inside the component's folder, or a Hub file
            raise ValueError(problem)
        return file

    @model_validator(mode="after")
    def _config_needs_weights(self) -> Component:
        if self.config and self.role in WEIGHTLESS_ROLES:
            raise ValueError(f"config overrides apply to components with weights; a {self.role} has none to override "
                             "(a scheduler's settings are its schedule's config)")
        return self


class AdapterSlot(SpecModel):
    """A LoRA that can be switched on for a phase (``recipe.phases[].adapter``), or on in every phase (``always``:
    a LoRA the user adds to the model, as ``omnispec run --lora`` does)."""

    path: str = Field(description="Local directory/file or Hub id of the LoRA weights.")
    weight_name: str | None = None
    scale: float = Field(default=1.0, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)
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

