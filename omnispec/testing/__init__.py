"""Offline tiny fixtures: random checkpoints in diffusers layout with tokenizers trained here."""

from .fixtures import TINY_OVERRIDES, tiny_flux, tiny_flux2_klein, tiny_sd3, tiny_wan, tiny_wan_i2v
from .ltx2_fixtures import tiny_ltx2
from .tokenizers import clip_tokenizer, gemma_tokenizer, t5_tokenizer

__all__ = ["TINY_OVERRIDES", "clip_tokenizer", "gemma_tokenizer", "t5_tokenizer", "tiny_flux", "tiny_flux2_klein",
           "tiny_ltx2", "tiny_sd3", "tiny_wan", "tiny_wan_i2v"]

from .fixtures import tiny_hunyuan_video15, tiny_qwen_image, tiny_wan_ti2v, tiny_wan_vace, tiny_z_image
from .tokenizers import qwen_tokenizer, qwen_vl_processor

__all__ += ["qwen_tokenizer", "qwen_vl_processor", "tiny_hunyuan_video15", "tiny_qwen_image", "tiny_wan_ti2v",
            "tiny_wan_vace", "tiny_z_image"]

from .fixtures_flux2 import tiny_flux2

__all__ += ["tiny_flux2"]
from .fixtures_qwen_image21 import qwen21_processor, tiny_qwen_image21

__all__ += ["qwen21_processor", "tiny_qwen_image21"]

from .fixtures_krea2 import tiny_krea2

__all__ += ["tiny_krea2"]
from .fixtures_minimax_h3 import minimax_h3_processor, tiny_minimax_h3

__all__ += ["minimax_h3_processor", "tiny_minimax_h3"]

from .offline import TINY_SPECS, tiny_checkpoint

__all__ += ["TINY_SPECS", "tiny_checkpoint"]

from .fixtures_kandinsky6 import kandinsky6_tokenizer, tiny_kandinsky6
from .fixtures_kandinsky6_sr import tiny_kandinsky6_sr

__all__ += ["kandinsky6_tokenizer", "tiny_kandinsky6", "tiny_kandinsky6_sr"]
from .fixtures_ltx25 import tiny_ltx25

__all__ += ["tiny_ltx25"]
from .fixtures_flux3 import flux3_processor, tiny_flux3

__all__ += ["flux3_processor", "tiny_flux3"]
