"""Tiny Qwen-VL text encoders (random weights) for the fixtures of the families that encode prompts with them."""

from __future__ import annotations


def qwen25_vl_encoder(ids: list[int], vision_depth: int):
    """A tiny Qwen2.5-VL (2 text layers 16 wide, a ``vision_depth``-block vision tower); ``ids``: the tokenizer's
    vision start, vision end, vision pad, image pad, video pad and end-of-text tokens."""
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "rope_theta": 1000000.0, "vocab_size": 512, "bos_token_id": ids[5],
                     "eos_token_id": ids[5],
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}},
        vision_config={"depth": vision_depth, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": 16},
        hidden_size=16, vocab_size=512, vision_start_token_id=ids[0], vision_end_token_id=ids[1],
        vision_token_id=ids[2], image_token_id=ids[3], video_token_id=ids[4], bos_token_id=ids[5],
        eos_token_id=ids[5])).eval()


def qwen3_vl_encoder(ids: list[int], width: int, layers: int):
    """A tiny Qwen3-VL (``layers`` text layers ``width`` wide, one vision block); ``ids``: the tokenizer's vision
    start, vision end, image pad and video pad tokens."""
    import transformers

    return transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
        text_config={"hidden_size": width, "intermediate_size": 16, "num_hidden_layers": layers,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 512,
                     "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [2, 1, 1], "rope_type": "default", "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": width, "deepstack_visual_indexes": [0], "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2},
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3])).eval()
