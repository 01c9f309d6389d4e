"""Single weights files in the model authors' own key layouts, written from tiny diffusers models, for the tests.

Each writer inverts diffusers' converter for its family (``convert_wan_transformer_to_diffusers``,
``convert_z_image_transformer_checkpoint_to_diffusers``, ``convert_flux_transformer_checkpoint_to_diffusers``), so
a file written here loads only through the real converter, as a file from the authors does. ``write_gguf`` writes
the same tensors as a GGUF file with the ``gguf`` package, block-quantizing the Linear weights as city96's files do
(1-D tensors, embeddings and convolutions stay F32).
"""

from __future__ import annotations

from pathlib import Path

import torch

COMFY_PREFIX = "model.diffusion_model."

# diffusers name part -> original name part, applied in this order (the inverse of the converter's renames).
_WAN_PARTS = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    (".attn1.", ".self_attn."), (".attn2.", ".cross_attn."),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."), (".norm_added_k.", ".norm_k_img."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
)


def wan_original(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A diffusers ``WanTransformer3DModel`` state dict in Wan's own layout (``blocks.N.self_attn.q`` ...)."""
    out = {}
    for key, value in state.items():
        name = key
        if name == "scale_shift_table":
            name = "head.modulation"
        elif name.endswith(".scale_shift_table"):
            name = name.replace(".scale_shift_table", ".modulation")
        for ours, theirs in _WAN_PARTS:
            name = name.replace(ours, theirs)
        # diffusers' norm2 is the original's norm3 (the affine cross-attention norm) and the reverse
        name = name.replace(".norm2.", ".__n3__.").replace(".norm3.", ".norm2.").replace(".__n3__.", ".norm3.")
        out[prefix + name] = value.contiguous()
    return out


def z_image_original(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A diffusers ``ZImageTransformer2DModel`` state dict in Z-Image's own layout (fused ``attention.qkv``)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            stem = key.split(".attention.to_q.")[0]
            leaf = key.rsplit(".", 1)[1]
            parts = [state[f"{stem}.attention.to_{p}.{leaf}"] for p in "qkv"]
            out[f"{prefix}{stem}.attention.qkv.{leaf}"] = torch.cat(parts).contiguous()
            continue
        name = (key.replace(".attention.to_out.0.", ".attention.out.").replace(".attention.norm_q.", ".attention.q_norm.")
                .replace(".attention.norm_k.", ".attention.k_norm.").replace("all_x_embedder.2-1.", "x_embedder.")
                .replace("all_final_layer.2-1.", "final_layer."))
        out[prefix + name] = value.contiguous()
    return out


def flux_original(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A diffusers ``FluxTransformer2DModel`` state dict in Black Forest Labs' layout (``double_blocks.N.img_attn.qkv``
    ...). diffusers' converter fixes the width at 3072 (24 heads of 128), so the model must have it."""
    out: dict[str, torch.Tensor] = {}

    def put(name: str, value: torch.Tensor) -> None:
        out[prefix + name] = value.contiguous()

    def both(ours: str, theirs: str) -> None:
        for leaf in ("weight", "bias"):
            if f"{ours}.{leaf}" in state:
                put(f"{theirs}.{leaf}", state[f"{ours}.{leaf}"])

    for ours, theirs in (("time_text_embed.timestep_embedder", "time_in"),
                         ("time_text_embed.text_embedder", "vector_in"),
                         ("time_text_embed.guidance_embedder", "guidance_in")):
        both(f"{ours}.linear_1", f"{theirs}.in_layer")
        both(f"{ours}.linear_2", f"{theirs}.out_layer")
    both("context_embedder", "txt_in")
    both("x_embedder", "img_in")
    both("proj_out", "final_layer.linear")
    for leaf in ("weight", "bias"):  # AdaLayerNormContinuous's (scale, shift) is the original's (shift, scale)
        scale, shift = state[f"norm_out.linear.{leaf}"].chunk(2, dim=0)
        put(f"final_layer.adaLN_modulation.1.{leaf}", torch.cat([shift, scale]))
    doubles = sorted({int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")})
    for i in doubles:
        ours, theirs = f"transformer_blocks.{i}", f"double_blocks.{i}"
        both(f"{ours}.norm1.linear", f"{theirs}.img_mod.lin")
        both(f"{ours}.norm1_context.linear", f"{theirs}.txt_mod.lin")
        for leaf in ("weight", "bias"):
            put(f"{theirs}.img_attn.qkv.{leaf}", torch.cat([state[f"{ours}.attn.to_{p}.{leaf}"] for p in "qkv"]))
            put(f"{theirs}.txt_attn.qkv.{leaf}",
                torch.cat([state[f"{ours}.attn.add_{p}_proj.{leaf}"] for p in "qkv"]))
        put(f"{theirs}.img_attn.norm.query_norm.scale", state[f"{ours}.attn.norm_q.weight"])
        put(f"{theirs}.img_attn.norm.key_norm.scale", state[f"{ours}.attn.norm_k.weight"])
        put(f"{theirs}.txt_attn.norm.query_norm.scale", state[f"{ours}.attn.norm_added_q.weight"])
        put(f"{theirs}.txt_attn.norm.key_norm.scale", state[f"{ours}.attn.norm_added_k.weight"])
        both(f"{ours}.ff.net.0.proj", f"{theirs}.img_mlp.0")
        both(f"{ours}.ff.net.2", f"{theirs}.img_mlp.2")
        both(f"{ours}.ff_context.net.0.proj", f"{theirs}.txt_mlp.0")
        both(f"{ours}.ff_context.net.2", f"{theirs}.txt_mlp.2")
        both(f"{ours}.attn.to_out.0", f"{theirs}.img_attn.proj")
        both(f"{ours}.attn.to_add_out", f"{theirs}.txt_attn.proj")
    singles = sorted({int(k.split(".")[1]) for k in state if k.startswith("single_transformer_blocks.")})
    for i in singles:
        ours, theirs = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        both(f"{ours}.norm.linear", f"{theirs}.modulation.lin")
        for leaf in ("weight", "bias"):
            put(f"{theirs}.linear1.{leaf}", torch.cat([*(state[f"{ours}.attn.to_{p}.{leaf}"] for p in "qkv"),
                                                       state[f"{ours}.proj_mlp.{leaf}"]]))
        put(f"{theirs}.norm.query_norm.scale", state[f"{ours}.attn.norm_q.weight"])
        put(f"{theirs}.norm.key_norm.scale", state[f"{ours}.attn.norm_k.weight"])
        both(f"{ours}.proj_out", f"{theirs}.linear2")
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return Path(path)


def write_gguf(tensors: dict[str, torch.Tensor], path: str | Path, quant: str, arch: str) -> Path:
    """``tensors`` as a GGUF file: 2-D weights whose rows are whole blocks in ``quant`` (``Q8_0``, ``Q4_0``, ``BF16``
    ...), everything else F32, as city96's converter keeps them."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[quant]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, value in tensors.items():
        data = value.detach().float().cpu().numpy().astype(np.float32)
        if value.ndim == 2 and value.shape[1] % block == 0 and value.shape[0] > 1 and name.endswith(".weight"):
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


__all__ = ["COMFY_PREFIX", "flux_original", "wan_original", "write_gguf", "write_safetensors", "z_image_original"]
