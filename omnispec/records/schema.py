"""The record of what made an output, as a closed, typed model: what ``Output.save`` writes and what replay reads.

A record read from a file is somebody's input like a spec: every field is checked here (types, ranges, that the
sample it names exists, that recorded paths stay inside their checkpoint) before anything uses it, and an unknown
key is an error. The resolved spec inside it is plain data here; replay validates it as a spec (classes outside
the trusted packages refused) before anything is built.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from ..spec.base import MAX_PROMPTS, Fps, Frames, MaskBlur, Seed, SequenceLength, Size, SpecModel, Steps, Unit
from ..spec.errors import Problem, SpecError, from_validation_error
from ..version import minor

FORMAT = 1
KEY = "omnispec"  # the PNG text chunk's key; the record's format marker
_SHA256 = r"^[0-9a-f]{64}$"
_DIGEST = r"^[0-9a-f]{32,64}$"


class RecordModel(SpecModel):
    """Base of the record's models: a spec model that also validates strictly, so a record's ``"0"`` is not the
    sample 0 nor ``true`` a seed (records are written by omnispec as JSON; nothing in one needs coercing)."""

    model_config = ConfigDict(strict=True)


class RecordedImage(RecordModel):
    """A conditioning image of the request: where it was placed, its pixels' digest, the file it came from."""

    frame: int
    digest: Annotated[str, Field(pattern=_DIGEST)]
    path: str | None = None


class RecordedVideo(RecordModel):
    """A conditioning video of the request (or a mask per frame): its frame count, its pixels' digest, its file."""

    frames: Frames
    digest: Annotated[str, Field(pattern=_DIGEST)]
    path: str | None = None


class RecordedSound(RecordModel):
    """A sound of the request (an audio reference, a reference video's soundtrack): its length, rate, digest, file."""

    kind: Literal["audio"] = "audio"
    samples: Annotated[int, Field(ge=1)]
    sample_rate: Annotated[int, Field(ge=1)]
    digest: Annotated[str, Field(pattern=_DIGEST)]
    path: str | None = None


class RecordedReferenceVideo(RecordModel):
    """A reference video of the request: its frames as a conditioning video's, its frame rate and soundtrack."""

    kind: Literal["video"] = "video"
    frames: Frames
    digest: Annotated[str, Field(pattern=_DIGEST)]
    path: str | None = None
    fps: Annotated[float, Field(gt=0)] | None = None
    audio: RecordedSound | None = None


class RequestedSize(RecordModel):
    """The size the caller asked for where the family generated another."""

    height: Size | None = None
    width: Size | None = None


class RecordedRequest(RecordModel):
    """The request as it ran (``Request`` with its images as digests and paths)."""

    prompts: list[str] = Field(min_length=1, max_length=MAX_PROMPTS)
    seeds: list[Seed] = Field(max_length=MAX_PROMPTS)
    negative_prompt: str = ""
    height: Size | None = None
    width: Size | None = None
    frames: Frames | None = None
    fps: Fps | None = None
    steps: Steps
    sigmas: list[Unit] | None = None
    guidance_scale: float | None = None
    max_sequence_length: SequenceLength | None = None
    strength: Unit | None = None
    images: list[RecordedImage] = Field(default_factory=list)
    video: RecordedVideo | None = Field(default=None, description="The video of a video-to-video request.")
    mask: RecordedImage | RecordedVideo | None = Field(
        default=None, description="The mask: one image (its frame is 0), or a mask per frame of the video.")
    mask_blur: MaskBlur | None = None
    references: list[RecordedImage | RecordedReferenceVideo | RecordedSound] = Field(
        default_factory=list, description="References, in order: images (frame 0), videos, sounds.")
    requested: RequestedSize | None = Field(default=None, description=(
        "Sizes the caller asked for where the family generated others (image-to-image at the image's size, "
        "Kontext's area rule): requested vs. generated."))

    @model_validator(mode="after")
    def _one_seed_per_prompt(self) -> RecordedRequest:
        if len(self.seeds) != len(self.prompts):
            raise ValueError(f"{len(self.seeds)} seeds for {len(self.prompts)} prompts")
        return self


def _relative_name(name: str) -> str:
    """A path recorded inside a checkpoint: relative, no ``..`` (a record cannot point the check elsewhere)."""
    parts = name.replace("\\", "/").split("/")
    if name.startswith("/") or ".." in parts or len(parts) > 3 or not name:
        raise ValueError(f"{name!r} is not a file name inside the checkpoint")
    return name


class LocalRoot(RecordModel):
    kind: Literal["local"]
    path: str
    config_sha256: dict[str, Annotated[str, Field(pattern=_SHA256)]] = Field(default_factory=dict)

    @field_validator("config_sha256")
    @classmethod
    def _inside(cls, hashes: dict[str, str]) -> dict[str, str]:
        for name in hashes:
            _relative_name(name)
        return hashes


class HubRoot(RecordModel):
    kind: Literal["hub"]
    repo: str
    revision: str | None = None


class LocalAdapter(RecordModel):
    kind: Literal["local"]
    path: str
    sha256: Annotated[str, Field(pattern=_SHA256)]


class HubAdapter(RecordModel):
    kind: Literal["hub"]
    repo: str
    weight_name: str | None = None


class CheckpointRecord(RecordModel):
    """Where the weights came from: per checkpoint root a local path with its config files' SHA-256, or a Hub id
    with its revision; the components handed to ``build`` in memory; each LoRA slot's file."""

    source: str | None = None
    in_memory: list[str] = Field(default_factory=list)
    roots: dict[str, Annotated[Union[LocalRoot, HubRoot], Field(discriminator="kind")]] = Field(default_factory=dict)
    adapters: dict[str, Annotated[Union[LocalAdapter, HubAdapter], Field(discriminator="kind")]] = Field(
        default_factory=dict)


class Versions(RecordModel):
    omnispec: str
    diffusers: str | None = None
    transformers: str | None = None
    torch: str | None = None


class ReplayOf(RecordModel):
    """Set on an output made again from a record: the versions that made the original, and how they differ."""

    versions: Versions
    drift: list[str] = Field(default_factory=list)


class PresetRecord(RecordModel):
    """What ``policies.preset`` did at build (the record's spec holds the fields it set): the fields it turned on,
    which of them approximate, the ones it left out and why."""

    name: Literal["fast", "fastest"]
    turned_on: dict[str, Any] = Field(default_factory=dict)
    approximate: list[Annotated[str, Field(max_length=200)]] = Field(default_factory=list, max_length=32)
    left_out: dict[str, Annotated[str, Field(max_length=2000)]] = Field(default_factory=dict)


class Record(RecordModel):
    omnispec: Literal[1]
    created: str = Field(max_length=64)
    versions: Versions
    device: str = Field(max_length=64)
    spec: dict[str, Any]
    request: RecordedRequest
    sample: Annotated[int, Field(ge=0)] | None = None
    checkpoint: CheckpointRecord = Field(default_factory=CheckpointRecord)
    weights_changed: Annotated[int, Field(ge=0)] = 0
    preset: PresetRecord | None = None
    replay_of: ReplayOf | None = None

    @model_validator(mode="after")
    def _sample_exists(self) -> Record:
        if self.sample is not None and self.sample >= len(self.request.prompts):
            raise ValueError(f"sample {self.sample} does not exist: the request has {len(self.request.prompts)} "
                             f"sample(s), 0 to {len(self.request.prompts) - 1}")
        return self

    def data(self) -> dict[str, Any]:
        """The record as JSON-ready data (what is written into a file)."""
        return self.model_dump(mode="json", exclude_none=True)


def parse_record(data: Any, file: str | None = None) -> Record:
    """A record from parsed JSON, or ``SpecError`` naming the file and the first wrong field."""
    if not isinstance(data, dict) or data.get(KEY) != FORMAT:
        found = data.get(KEY) if isinstance(data, dict) else None
        raise SpecError.single(f"its record is not an omnispec record of format {FORMAT}"
                               + (f" (format {found!r})" if found is not None else ""), file=file)
    try:
        return Record.model_validate(data)
    except ValidationError as exc:
        problems = from_validation_error(exc, data).problems
        raise SpecError([Problem(f"record.{p.path}" if p.path else "record", p.message, file)
                         for p in problems[:5]]) from None


def version_drift(recorded: Versions, installed: dict[str, str | None]) -> list[str]:
    """How this installation differs from the one that made a record, where it matters for a bit-equal replay:
    another omnispec major.minor, another diffusers minor."""
    drift = []
    for package in ("omnispec", "diffusers"):
        theirs, ours = getattr(recorded, package), installed.get(package)
        if minor(theirs) != minor(ours):
            drift.append(f"{package} {theirs or 'none'} made it, {ours or 'none'} is installed")
    return drift

__all__ = ["FORMAT", "KEY", "CheckpointRecord", "HubAdapter", "HubRoot", "LocalAdapter", "LocalRoot", "Record",
           "RecordModel", "RecordedImage", "RecordedRequest", "RecordedVideo", "ReplayOf", "RequestedSize", "Versions",
           "parse_record", "version_drift"]
