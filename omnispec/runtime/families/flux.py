"""FLUX.1 (dev, schnell): packed 2x2 latent patches, embedded guidance, optional true CFG; image-to-image
(``FluxImg2ImgPipeline``) through an ``image`` phase input."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from diffusers import FluxImg2ImgPipeline, FluxPipeline
from diffusers.hooks import ModelHook
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxSingleTransformerBlock
from diffusers.utils.torch_utils import randn_tensor

from ... import bridge
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, MlpTarget, ModulationTarget, ParallelTarget, Targets
from .base import Family
from .checks import Inputs
from .latents import PackedLatents, decode_images
from .parallel_plans import model_tensor_plan
from .perturbations import layer_skip
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

# The fused operator ``policies.attention.fused_qk_norm_rope`` hands over (``omnispec::qk_norm_rope``): queries and
# keys in, both prepared out.
PreparesQueriesAndKeys = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class FusedQKNormRopeProcessor(FluxAttnProcessor):
    """diffusers' ``FluxAttnProcessor`` with the query and key norms, the text stream's concatenation and the RoPE
    as one operator for both tensors (``policies.attention.fused_qk_norm_rope``, which hands over the operator); the
    rest as diffusers computes it."""

    def __init__(self, replaced: FluxAttnProcessor, fused: PreparesQueriesAndKeys):
        super().__init__()
        bridge.set_processor_settings(self, bridge.processor_settings(replaced))  # backend, context parallelism
        self.fused = fused

    @classmethod
    def replacing(cls, processor: Any, fused: PreparesQueriesAndKeys) -> FusedQKNormRopeProcessor | None:
        """The processor for an attention whose processor is ``processor``; None leaves it (an IP-Adapter's)."""
        return cls(processor, fused) if type(processor) is FluxAttnProcessor else None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        text_norms = (attn.norm_added_q, attn.norm_added_k) if attn.added_kv_proj_dim is not None else ()
        if image_rotary_emb is None or any(getattr(n, "weight", None) is None or n.eps != attn.norm_q.eps
                                           for n in (attn.norm_q, attn.norm_k, *text_norms)):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query, key, value, text_query, text_key, text_value = bridge.flux_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        text_weights: tuple[Any, Any] = (None, None)
        if attn.added_kv_proj_dim is None:  # no text stream (its fused projections return placeholders then)
            text_query = text_key = None
        else:
            text_query, text_key, text_value = (t.unflatten(-1, (-1, attn.head_dim))
                                                for t in (text_query, text_key, text_value))
            value = torch.cat([text_value, value], dim=1)
            text_weights = (attn.norm_added_q.weight, attn.norm_added_k.weight)
        cos, sin = image_rotary_emb
        query, key = self.fused(query, key, attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps, cos, sin,
                                text_query, text_key, *text_weights)
        backend, parallel_config = bridge.processor_settings(self)
        hidden_states = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, backend=backend,
                                              parallel_config=parallel_config)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return hidden_states
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        return hidden_states, attn.to_add_out(encoder_hidden_states.contiguous())


class FusedSingleBlockMlp(ModelHook):
    """FLUX's single block (``FluxSingleTransformerBlock``) with its MLP's bias and GELU in the matmul and the output
    projection taken over the attention's and the MLP's outputs without concatenating them
    (``policies.mlp.fused_gelu``, which hands over the operators); the rest as diffusers computes it. The block's
    own forward where its projections' weights are not plain (a LoRA, fp8) or its activation is another."""

    def __init__(self, ops: Any):
        super().__init__()
        self.ops = ops

    def new_forward(self, block, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                    joint_attention_kwargs=None):
        act = block.act_mlp
        if not (self.ops.takes(block.proj_mlp, hidden_states) and self.ops.takes(block.proj_out, hidden_states)
                and type(act) is torch.nn.GELU and act.approximate == "tanh"):
            return self.fn_ref.original_forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                                joint_attention_kwargs)
        text_tokens = encoder_hidden_states.shape[1]
        residual = hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        normed, gate = block.norm(hidden_states, emb=temb)
        mlp = self.ops.linear_gelu(normed, block.proj_mlp.weight, block.proj_mlp.bias)
        attention = block.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb,
                               **(joint_attention_kwargs or {}))
        projected = self.ops.linear_of_pair(attention, mlp, block.proj_out.weight, block.proj_out.bias)
        hidden_states = residual + gate.unsqueeze(1) * projected
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_tokens], hidden_states[:, text_tokens:]

    @classmethod
    def hooks(cls, denoiser: torch.nn.Module, ops: Any) -> list[tuple[torch.nn.Module, ModelHook]]:
        return [(block, cls(ops)) for block in getattr(denoiser, "single_transformer_blocks", ())
                if type(block) is FluxSingleTransformerBlock]


def _guidance(rows: int, embedded: float | None, device: torch.device) -> torch.Tensor:
    """The embedded guidance a FLUX forward takes for ``rows`` rows (FluxPipeline's 3.5 unless the plan sets one)."""
    return torch.full([rows], 3.5 if embedded is None else embedded, device=device, dtype=torch.float32)


class FluxFamily(PackedLatents, Family):
    name = "flux"
    pipeline_class = FluxPipeline
    targets = Targets(
        attention=AttentionTarget({"joint": ("transformer_blocks.*.attn",),
                                   "single": ("single_transformer_blocks.*.attn",)},
                                  qk_norm_rope_processor=FusedQKNormRopeProcessor.replacing),
        blocks=BlocksTarget(("transformer_blocks", "single_transformer_blocks"),
                            shared_inputs=("pos_embed", "time_text_embed")),
        mlp=MlpTarget(FusedSingleBlockMlp.hooks),
        modulation=ModulationTarget("time_text_embed", (
            "transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
            "single_transformer_blocks.*.norm.linear", "norm_out.linear")),
        parallel=ParallelTarget(sequence_refusal=None, tensor_plan=model_tensor_plan, tensor_refusal=None),
    )
    required = {
        "text_encoder": "encoder", "tokenizer": "tokenizer", "text_encoder_2": "encoder",
        "tokenizer_2": "tokenizer", "vae": "vae",
    }
    inputs = Inputs(max_images=1)  # image-to-image

    def helper_components(self):
        return (*self.required, "scheduler", "transformer")

    @classmethod
    def index_problems(cls, spec, index) -> list[tuple[str, str]]:
        """A FLUX.1 Fill checkpoint's transformer takes the masked image beside the noise (384 input channels):
        only family flux_fill runs it, and flux_fill runs nothing else."""
        problems = super().index_problems(spec, index)
        fill = index.get("_class_name") == "FluxFillPipeline"
        if fill and cls.name != "flux_fill":
            problems.append(("model.family", "the checkpoint is FLUX.1 Fill's (FluxFillPipeline in model_index.json), "
                                             "whose transformer also takes a masked image: run it with the spec "
                                             "flux1-fill-dev (family flux_fill)"))
        elif not fill and cls.name == "flux_fill":
            problems.append(("model.family", f"family 'flux_fill' runs FLUX.1 Fill's transformer, and the checkpoint's "
                                             f"model_index.json names {index.get('_class_name')!r}, not "
                                             "FluxFillPipeline"))
        return problems

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        embeds, pooled, text_ids = self.helper.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device,
            max_sequence_length=request.max_sequence_length or 512,
        )
        return Conditioning({"encoder_hidden_states": embeds, "pooled_projections": pooled}, {"txt_ids": text_ids})

    def _channels(self) -> int:
        return self.helper.vae.config.latent_channels

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        h, w = self._latent_hw(geometry)
        shape = (len(generators), self._channels(), h, w)
        noise = randn_tensor(shape, generator=generators, device=self.device, dtype=self.latent_dtype(None))
        return {"latents": self.pack("latents", noise, geometry)}

    def noise(self, latents: Streams, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        return self.initial_latents(geometry, generators)  # drawn unpacked, then packed, as FluxImg2ImgPipeline

    @functools.cached_property
    def img2img_helper(self) -> FluxImg2ImgPipeline:
        return FluxImg2ImgPipeline(**{name: self.components.get(name) for name in self.helper_components()})

    def image_latents(self, request: Request, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """FluxImg2ImgPipeline's image latents: the image stretched to the output size, then each sample's
        VAE posterior drawn from its own generator (before its noise, as diffusers draws them)."""
        img2img = self.img2img_helper
        dtype = self.latent_dtype(None)
        image = img2img.image_processor.preprocess(request.images[0].image, height=geometry.height,
                                                   width=geometry.width).to(self.device, torch.float32)
        spatial = torch.cat([bridge.encode_vae_image(img2img, image.to(dtype), g) for g in generators])
        return {"latents": self.pack("latents", spatial, geometry)}

    def latent_dtype(self, denoiser: torch.nn.Module) -> torch.dtype:
        # FluxPipeline keeps latents in the text embeddings' dtype (the T5 encoder's).
        return self.helper.text_encoder_2.dtype

    def pack(self, stream: str, spatial: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        b, c, h, w = spatial.shape
        return bridge.pack_latents(FluxPipeline, spatial, b, c, h, w)

    def unpack(self, stream: str, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return bridge.unpack_latents(FluxPipeline, latents, geometry.height, geometry.width,
                                     self.helper.vae_scale_factor)

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"].to(self.latent_dtype(denoiser))
        return {"latents": self._forward(denoiser, x, timestep, cond, geometry, embedded, perturbation)}

    def _forward(self, denoiser, latents, timestep, cond, geometry, embedded, perturbation, extra_ids=None):
        """One transformer call; ``extra_ids`` are position ids of tokens appended after the noise tokens."""
        b = latents.shape[0]
        key = ("img_ids", latents.device, latents.dtype)
        if key not in geometry.extra:  # built once per phase: a host->device copy per step would stall the GPU
            h, w = self._latent_hw(geometry)
            ids = bridge.prepare_latent_image_ids(FluxPipeline, b, h // 2, w // 2, latents.device, latents.dtype)
            geometry.extra[key] = ids if extra_ids is None else torch.cat([ids, extra_ids.to(ids)])
        img_ids = geometry.extra[key]
        guidance = _guidance(b, embedded, latents.device) if denoiser.config.guidance_embeds else None
        t = timestep.expand(b).to(latents.dtype)
        with layer_skip(denoiser, perturbation, self.targets):
            return denoiser(
                hidden_states=latents, timestep=t / 1000, guidance=guidance,
                pooled_projections=cond.batched["pooled_projections"],
                encoder_hidden_states=cond.batched["encoder_hidden_states"],
                txt_ids=cond.shared["txt_ids"], img_ids=img_ids, return_dict=False,
            )[0]

    def modulation_embeddings(self, denoiser, timesteps, embedded, cond):
        """``time_text_embed`` of every step's rows, through the conversions ``_forward`` and the model make."""
        pooled = cond.batched["pooled_projections"]
        rows, latent_dtype, model_dtype = pooled.shape[0], self.latent_dtype(denoiser), denoiser.dtype
        t = torch.cat([(timestep.expand(rows).to(latent_dtype) / 1000) for timestep in timesteps])
        args = [t.to(model_dtype) * 1000]
        if denoiser.config.guidance_embeds:
            guidance = torch.cat([_guidance(rows, e, pooled.device) for e in embedded])
            args.append(guidance.to(model_dtype) * 1000)
        return denoiser.time_text_embed(*args, pooled.repeat(len(timesteps), 1))

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        vae = self.helper.vae
        spatial = self.unpack("latents", latents["latents"], geometry)
        spatial = spatial / vae.config.scaling_factor + vae.config.shift_factor
        return Decoded(decode_images(self.helper, vae.decode(spatial.to(vae.dtype), return_dict=False)[0]))


