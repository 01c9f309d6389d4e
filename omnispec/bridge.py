"""The one bridge to diffusers' internals: every private diffusers name omnispec uses is read here, and nowhere else.

Each is a pin on the diffusers minor series (pyproject bounds diffusers to it), so each is listed in ``PRIVATE`` with
why omnispec reads it instead of a public API and the version it was checked against; ``tests/test_bridge.py`` fails
when an installed diffusers lacks one, and when a private name appears outside this module.

The latent helpers are the pipelines' own, called so that packing, position ids and VAE normalisation equal
diffusers' by construction; the hook names and contexts are how policies attach and detach behaviour on modules
that are not diffusers models (the embedded digits DiT), and how a rebuild leaves a module as it was.
"""

from __future__ import annotations

from typing import Any

CHECKED_AGAINST = "0.42.1"

# (where the name lives, the name, why it is read) -- all checked against diffusers CHECKED_AGAINST.
PRIVATE: tuple[tuple[str, str, str], ...] = (
    ("diffusers.FluxPipeline", "_pack_latents", "FLUX's 2x2 latent packing; no public form"),
    ("diffusers.FluxPipeline", "_unpack_latents", "the inverse, for phase transforms and decoding"),
    ("diffusers.FluxPipeline", "_prepare_latent_image_ids", "FLUX's position ids of the latent tokens"),
    ("diffusers.FluxImg2ImgPipeline", "_encode_vae_image", "the image's VAE latents as FLUX img2img/Kontext draw them"),
    ("diffusers.QwenImagePipeline", "_pack_latents", "Qwen-Image's packing"),
    ("diffusers.QwenImagePipeline", "_unpack_latents", "the inverse"),
    ("diffusers.QwenImageEditPipeline", "_encode_vae_image", "Qwen-Image-Edit's image latents"),
    ("diffusers.LTX2Pipeline", "_pack_latents", "LTX-2's video latent packing"),
    ("diffusers.LTX2Pipeline", "_unpack_latents", "the inverse"),
    ("diffusers.LTX2Pipeline", "_pack_audio_latents", "LTX-2's audio latent packing"),
    ("diffusers.LTX2Pipeline", "_unpack_audio_latents", "the inverse"),
    ("diffusers.LTX2Pipeline", "_normalize_latents", "the video VAE's latent normalisation"),
    ("diffusers.LTX2Pipeline", "_denormalize_latents", "its inverse, before decoding"),
    ("diffusers.LTX2Pipeline", "_denormalize_audio_latents", "the audio VAE's, before decoding"),
    ("diffusers.Flux2KleinPipeline", "_unpack_latents_with_ids", "FLUX.2's packed tokens back to their grid by "
     "their position ids, before decoding"),
    ("diffusers.Flux2KleinPipeline", "_unpatchify_latents", "FLUX.2's 2x2 channel patches back to the VAE's "
     "latent layout"),
    ("diffusers.pipelines.flux2.image_processor.Flux2ImageProcessor", "_resize_to_target_area", "a reference image "
     "above 1 MP resized to 1 MP as the pipeline resizes it (no public form)"),
    ("diffusers.hooks.layer_skip", "_apply_layer_skip_hook", "skip-layer guidance's hook under a name we remove after "
     "the pass (the public apply_layer_skip has a fixed name and no removal)"),
    ("diffusers.hooks.hooks", "_set_cache_context", "a cache context on a module without CacheMixin (the digits DiT)"),
    ("diffusers.hooks.first_block_cache", "_FBC_BLOCK_HOOK", "first-block cache hook names, to remove them from a "
     "module without CacheMixin"),
    ("diffusers.hooks.first_block_cache", "_FBC_LEADER_BLOCK_HOOK", "the same"),
    ("diffusers.hooks.mag_cache", "_MAG_CACHE_BLOCK_HOOK", "MagCache's hook names, likewise"),
    ("diffusers.hooks.mag_cache", "_MAG_CACHE_LEADER_BLOCK_HOOK", "the same"),
    ("diffusers.hooks.taylorseer_cache", "_TAYLORSEER_CACHE_HOOK", "TaylorSeer's hook name, likewise"),
    ("diffusers.ModelMixin", "_repeated_blocks", "whether compile_repeated_blocks has blocks to compile (it raises "
     "otherwise); the family's block lists are compiled then"),
    ("diffusers.hooks.hooks", "_diffusers_hook", "the attribute a module's hook registry lives in (a string in "
     "HookRegistry's code): removing the last hook leaves the registry and a bound forward behind, which make dynamo "
     "recompile each block"),
    ("diffusers.models.attention_dispatch.AttentionBackendName", "_NATIVE_FLASH", "the attention backend ring "
     "attention needs (it returns the log-sum-exp that merges ring steps)"),
    ("diffusers.WanTransformer3DModel", "_cp_plan", "which modules diffusers' context parallelism hooks to split "
     "their inputs (Wan's first block): a compiled block carrying that hook cannot be one graph"),
    ("diffusers.FluxTransformer2DModel", "_tp_plan", "a model's tensor-parallel plan (which linears split by column "
     "or row); the public enable_parallelism(TensorParallelConfig) refuses CPU meshes and context parallelism on top"),
    ("diffusers.hooks.tensor_parallel", "_resolve_tp_plan", "a flat plan grouped per block, as parallelize_module "
     "takes it"),
    ("diffusers.loaders.single_file_model", "_should_convert_state_dict_to_diffusers", "whether the single-file "
     "loader converts a file or takes its keys as they are (a file already in diffusers' layout), so the dry run "
     "before loading decides as the loader will"),
    ("diffusers.hooks.tensor_parallel", "_styles", "a plan's style names (and packed markers) as torch's "
     "ParallelStyle objects"),
    ("diffusers.models.transformers.transformer_flux.FluxAttnProcessor", "_attention_backend", "the attention "
     "backend diffusers keeps on a processor (set_attention_backend): omnispec's FLUX processor takes over the one "
     "it replaces"),
    ("diffusers.models.transformers.transformer_flux.FluxAttnProcessor", "_parallel_config", "the context-parallel "
     "settings diffusers keeps on a processor (enable_parallelism), likewise"),
    ("diffusers.models.transformers.transformer_flux", "_get_qkv_projections", "FLUX attention's query, key and "
     "value projections (and the text stream's), fused or not, as its processor computes them: omnispec's "
     "processor replaces only the norms and the RoPE after them"),
    ("diffusers.QwenImage21Pipeline", "_pack_latents", "Qwen-Image-2.1's token flatten of its unpatched latents"),
    ("diffusers.QwenImage21Pipeline", "_unpack_latents", "the inverse"),
    ("diffusers.QwenImage21Pipeline", "_encode_vae_image", "Qwen-Image-2.1's normalised reference-image latents"),
    ("diffusers.LTX2InContextPipeline", "_build_video_self_attention_mask", "the IC-LoRA's video self-attention "
     "weights over [video | keyframes | references] (the blocks' LTX2BuildVideoSelfAttentionMaskStep builds the same "
     "inside a pipeline state); no public form"),
    ("diffusers.modular_pipelines.flux3.encoders.Flux3TextEncoderStep", "_get_qwen3_vl_prompt_embeds", "FLUX.3's "
     "encoding of one prompt (chat template, window padded to its multiple, explicit position ids, stacked layers); "
     "the block itself encodes the negative prompt too, by its guider"),
)

HOOK_REGISTRY_ATTRIBUTE = "_diffusers_hook"
NATIVE_FLASH_BACKEND = "_native_flash"


# ---- the pipelines' latent helpers ------------------------------------------------------------------------

def pack_latents(pipeline: Any, *args: Any) -> Any:
    """``pipeline._pack_latents(*args)``: a pipeline class or instance (FLUX, Qwen-Image, LTX-2); so are the
    functions below."""
    return pipeline._pack_latents(*args)


def unpack_latents(pipeline: Any, *args: Any) -> Any:
    return pipeline._unpack_latents(*args)


def prepare_latent_image_ids(pipeline: Any, *args: Any) -> Any:
    return pipeline._prepare_latent_image_ids(*args)


def encode_vae_image(pipeline: Any, image: Any, generator: Any) -> Any:
    return pipeline._encode_vae_image(image, generator=generator)


def unpack_latents_with_ids(pipeline: Any, *args: Any) -> Any:
    return type(pipeline)._unpack_latents_with_ids(*args)


def qwen3_vl_prompt_embeds(block: Any, *args: Any, **kwargs: Any) -> Any:
    return block._get_qwen3_vl_prompt_embeds(*args, **kwargs)


def unpatchify_latents(pipeline: Any, latents: Any) -> Any:
    return type(pipeline)._unpatchify_latents(latents)


def resize_to_target_area(processor: Any, image: Any, area: int) -> Any:
    return processor._resize_to_target_area(image, area)


def pack_audio_latents(pipeline: Any, latents: Any) -> Any:
    return pipeline._pack_audio_latents(latents)


def unpack_audio_latents(pipeline: Any, latents: Any, frames: int, **kwargs: Any) -> Any:
    return pipeline._unpack_audio_latents(latents, frames, **kwargs)


def normalize_latents(pipeline: Any, *args: Any) -> Any:
    return pipeline._normalize_latents(*args)


def denormalize_latents(pipeline: Any, *args: Any) -> Any:
    return pipeline._denormalize_latents(*args)


def denormalize_audio_latents(pipeline: Any, *args: Any) -> Any:
    return pipeline._denormalize_audio_latents(*args)


def ltx2_video_self_attention_mask(pipeline: Any, video_tokens: int, prefix_tokens: int, cross: list,
                                   device: Any) -> Any:
    """``_build_video_self_attention_mask``: (1, S, S) weights, 1 among the first ``prefix_tokens`` (video and
    keyframe tokens), each reference group's ``cross`` weights between it and the ``video_tokens``, 1 within a
    group, 0 elsewhere."""
    return pipeline._build_video_self_attention_mask(video_tokens, prefix_tokens, cross, device)


def processor_settings(processor: Any) -> tuple[Any, Any]:
    """The attention backend and context-parallel settings diffusers keeps on an attention processor."""
    return processor._attention_backend, processor._parallel_config


def set_processor_settings(processor: Any, settings: tuple[Any, Any]) -> None:
    processor._attention_backend, processor._parallel_config = settings


def flux_qkv_projections(attn: Any, hidden_states: Any, encoder_hidden_states: Any = None) -> Any:
    from diffusers.models.transformers.transformer_flux import _get_qkv_projections

    return _get_qkv_projections(attn, hidden_states, encoder_hidden_states)


# ---- hooks ------------------------------------------------------------------------------------------------

def apply_layer_skip_hook(module: Any, config: Any, name: str) -> None:
    from diffusers.hooks.layer_skip import _apply_layer_skip_hook

    _apply_layer_skip_hook(module, config, name=name)


def set_cache_context(module: Any, name: str | None, **where: Any) -> None:
    """Name the cache context of ``module``'s hooks (None: leave it)."""
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    _set_cache_context(module, None if name is None else CacheContext(name, **where))


def cache_hook_names() -> tuple[str, ...]:
    """The names diffusers' first-block, MagCache and TaylorSeer caches register their hooks under."""
    from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
    from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    return (_FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK, _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK,
            _TAYLORSEER_CACHE_HOOK)


def hook_registry(module: Any) -> Any:
    """``module``'s diffusers ``HookRegistry``, or None when it has none."""
    from diffusers.hooks import HookRegistry

    registry = getattr(module, HOOK_REGISTRY_ATTRIBUTE, None)
    return registry if isinstance(registry, HookRegistry) else None


def remove_hook(module: Any, name: str) -> None:
    """Remove hook ``name`` from ``module`` (not its children), if present, restoring the plain module when it was
    the last one: diffusers' ``HookRegistry.remove_hook`` leaves the original bound ``forward`` as an instance
    attribute and the registry on the module, and under ``torch.compile`` dynamo then guards on that object per
    module and recompiles every block of a regionally compiled stack until its limit (BENCHMARKS.md, "Compile: regional,
    full, CUDA graphs, autotune")."""
    registry = hook_registry(module)
    if registry is None:
        return
    if registry.get_hook(name) is not None:
        registry.remove_hook(name, recurse=False)
    if not registry.hooks:
        bound = module.__dict__.get("forward")
        if getattr(bound, "__func__", None) is type(module).forward and getattr(bound, "__self__", None) is module:
            del module.__dict__["forward"]
        delattr(module, HOOK_REGISTRY_ATTRIBUTE)


def has_repeated_blocks(module: Any) -> bool:
    """Whether diffusers' ``compile_repeated_blocks`` finds blocks to compile in ``module``: the class names them
    (``_repeated_blocks``) and submodules of exactly those class names are there. It compares ``type(m).__name__``,
    so blocks that FSDP2's ``fully_shard`` gave a class of its own (``FSDPFluxTransformerBlock``) are not found."""
    names = getattr(module, "_repeated_blocks", None) or ()
    return any(type(m).__name__ in names for m in module.modules())


def context_parallel_split_modules(module: Any) -> list[Any]:
    """The submodules whose inputs diffusers' context parallelism splits (``enable_parallelism`` hooks them), per the
    model class's plan, where an input split is a mapping (argument -> how) and an output gather is not: the root's
    own entry (``""``) and the gathers left out."""
    plan = getattr(type(module), "_cp_plan", None) or {}
    found = []
    for name, entry in plan.items():
        if name and isinstance(entry, dict):
            try:
                found.append(module.get_submodule(name))
            except AttributeError:  # a plan entry this configuration of the model does not build
                continue
    return found


# ---- tensor parallel --------------------------------------------------------------------------------------

def model_tensor_plan(module: Any) -> dict[str, Any] | None:
    """The model class's own tensor-parallel plan (``{glob: "colwise" | "rowwise" | packed marker}``), or None."""
    return getattr(type(module), "_tp_plan", None) or None


def parallelize_with_plan(module: Any, plan: dict[str, Any], mesh: Any) -> None:
    """Split ``module``'s planned linears over ``mesh`` with torch's ``parallelize_module``, one call per block
    (diffusers' grouping and styles, so its packed layouts split as diffusers splits them), after diffusers'
    divisibility check of every planned tensor."""
    from diffusers.hooks.tensor_parallel import _resolve_tp_plan, _styles, resolve_tp_shard_specs
    from torch.distributed.tensor.parallel import parallelize_module

    resolve_tp_shard_specs(module, plan, mesh.size())
    for block, relative in _resolve_tp_plan(module, plan):
        parallelize_module(block, mesh, _styles(relative))


__all__ = ["CHECKED_AGAINST", "NATIVE_FLASH_BACKEND", "PRIVATE", "apply_layer_skip_hook", "cache_hook_names",
           "context_parallel_split_modules", "denormalize_audio_latents", "denormalize_latents", "encode_vae_image",
           "has_repeated_blocks", "model_tensor_plan", "parallelize_with_plan",
           "hook_registry", "normalize_latents", "pack_audio_latents", "pack_latents", "prepare_latent_image_ids",
           "remove_hook", "set_cache_context", "unpack_audio_latents", "unpack_latents"]


def single_file_needs_conversion(model_state: dict[str, Any], checkpoint: dict[str, Any]) -> bool:
    from diffusers.loaders.single_file_model import _should_convert_state_dict_to_diffusers

    return bool(_should_convert_state_dict_to_diffusers(model_state, checkpoint))
