"""Shared base for every spec model: closed (unknown keys are errors) and immutable."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

DType = Literal["float32", "float16", "bfloat16"]

# A value in [0, 1]: step fractions, normalised timesteps, sigmas.
Unit = Annotated[float, Field(ge=0.0, le=1.0)]


class SpecModel(BaseModel):
    """Base of all spec models.

    ``extra="forbid"`` turns a misspelled key into an error that names its path instead of a silently
    ignored setting; ``frozen`` lets a built pipeline hold its spec without defensive copies.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
