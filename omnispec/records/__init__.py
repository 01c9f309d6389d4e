"""Records of what made an output: made at generation, written into each file, read back and checked for replay.

Below the runtime: this package imports the spec layer and nothing of the runtime (replay, above it, is
``omnispec.replay``).
"""

from .checks import check_versions, recorded_source, replay_problems
from .making import a1111_parameters, checkpoint_record, for_sample, make_record, spec_data, to_text
from .reading import OUTPUT_SUFFIXES, SIDECAR_SUFFIXES, is_output, read, sidecar
from .render import render
from .schema import FORMAT, KEY, Record, parse_record, version_drift

__all__ = ["FORMAT", "KEY", "OUTPUT_SUFFIXES", "SIDECAR_SUFFIXES", "Record", "a1111_parameters", "check_versions",
           "checkpoint_record", "for_sample", "is_output", "make_record", "parse_record", "read", "recorded_source",
           "render", "replay_problems", "sidecar", "spec_data", "to_text", "version_drift"]
