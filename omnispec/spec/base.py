"""Shared base for every spec model: closed (unknown keys are errors), immutable, finite; and the limits.

The limits are far above what any real run needs; they exist so that a mistyped or hostile value is refused
at read time with its field path, instead of running out of memory later (README, "Limits and errors").
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

DType = Literal["float32", "float16", "bfloat16"]

# A value in [0, 1]: step fractions, normalised timesteps, sigmas.
Unit = Annotated[float, Field(ge=0.0, le=1.0)]

# ---- limits ----------------------------------------------------------------------------------------------
MAX_SPEC_BYTES = 1 << 20  # one spec file (the bundled ones are 1-3 KB)
MAX_SPEC_DEPTH = 32  # nesting of mappings and lists, aliases expanded (a valid spec nests 12 deep at most)
MAX_SPEC_NODES = 100_000  # values in one file, aliases expanded
MAX_EXTENDS = 16  # files in one extends chain
MAX_STEPS = 10_000  # denoise steps of a phase or a request
MAX_SIZE = 16_384  # pixels per side (height, width)
MAX_FRAMES = 10_000
MAX_FPS = 1_000
MAX_SEQUENCE_LENGTH = 65_536  # prompt tokens
# A conditioning image (all images of an array's or tensor's batch together), read from its header before any pixel
# is decoded: a 4096 x 4096 RGBA file decodes, converts and hashes within 1.5 GB.
MAX_IMAGE_PIXELS = 4096 * 4096
# A conditioning video: all its frames' pixels together (each frame within MAX_IMAGE_PIXELS), decoded as RGB within
# 0.5 GB: 81 frames of 1280 x 1280, 121 of 1280 x 720 with room to spare.
MAX_VIDEO_PIXELS = 1 << 27
# Index entries of an MP4/MOV file, as FFmpeg builds them from its sample tables: each track's samples times its
# edits, and all samples of its fragments (tens of bytes each: under 100 MB). A video of MAX_FRAMES frames with
# an hour of AAC audio lists about 180,000.
MAX_MEDIA_SAMPLES = 2_000_000
MAX_PROMPTS = 1_024  # prompts of one request (each one is a sample a replay makes again)
MAX_REFERENCES = 16  # references (images, videos, sounds) of one request
# A sound (an audio reference, a reference video's soundtrack): all its channels' samples, float32 within 256 MB
# (17 minutes of stereo at 32 kHz); and the highest sample rate a sound may claim.
MAX_AUDIO_SAMPLES = 1 << 26
MAX_SAMPLE_RATE = 384_000
MAX_LORA_SCALE = 1_000.0  # |scale| of a LoRA slot (real ones lie within a few units; 1e308 overflows to NaN)
# Modules registered while one component is built from its config: FLUX.1's transformer has 1,275, Wan 14B's 1,138,
# LTX-2's 3,674. A config describing a million layers (a few bytes of JSON) is refused at this count instead of
# building for minutes and filling memory (each module costs a few kB and tens of microseconds).
MAX_MODULES = 50_000
# Devices a spec or a caller may name (``runtime.device``, ``--device``, ``build(device=)``).
DEVICE_PATTERN = r"^(auto|cpu|mps|cuda(:\d{1,4})?)$"
# ``torch.Generator.manual_seed`` takes exactly this range; every per-sample seed (seed + i) must lie in it.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1

Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]
Size = Annotated[int, Field(ge=1, le=MAX_SIZE)]
Frames = Annotated[int, Field(ge=1, le=MAX_FRAMES)]
Fps = Annotated[int, Field(ge=1, le=MAX_FPS)]
SequenceLength = Annotated[int, Field(ge=1, le=MAX_SEQUENCE_LENGTH)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
# Gaussian blur radius of an inpainting mask, in pixels (diffusers' ``VaeImageProcessor.blur``).
MaskBlur = Annotated[int, Field(ge=0, le=1_024)]


class SpecModel(BaseModel):
    """Base of all spec models.

    ``extra="forbid"`` turns a misspelled key into an error that names its path instead of a silently
    ignored setting; ``frozen`` lets a built pipeline hold its spec without defensive copies;
    ``allow_inf_nan=False`` refuses NaN and infinity in every float field (a NaN scale would validate and
    then turn every output into NaN).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)
