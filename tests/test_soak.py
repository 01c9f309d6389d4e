"""One digits pipeline through 1,000 mixed requests (``benchmarks.gpu_soak.soak``: prompts, batch sizes, guidance,
sequence lengths, a step-mask cache policy, refused requests, LoRA swaps, rollouts and replays interleaved):
resident memory, Python objects and tensors stop growing after warm-up, a repeated request returns the identical
array, the prompt-encoding cache stays within its byte bound. The digits model has one size (32x32); other
sizes are among the refused requests."""

import logging

import numpy as np
import pytest

from benchmarks.gpu_soak import digits_soak

REQUESTS = 1000
WARMUP = 300  # requests before memory must be flat: every kind of request, LoRA and shape has been seen


@pytest.fixture
def quiet_progress():
    """pytest keeps every log record a test emits, for its report, and pytest 9.2 attaches its capture handlers to
    non-propagating loggers such as omnispec's too. An earlier in-process CLI test leaves that logger at INFO, so the
    progress lines of 1,000 requests, and the warnings on their prompts (the soak's unique prompts are longer than the
    digits model's 8 tokens), pile up there as LogRecords and read as the pipeline's growth; the pipeline holds none
    of them."""
    logger = logging.getLogger("omnispec")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.mark.slow
def test_a_thousand_mixed_requests_hold_memory_and_repeat_exactly(quiet_progress):
    result = digits_soak(REQUESTS)
    kinds = result["kinds"]
    assert min(kinds.values()) >= 40, kinds  # every kind of request ran many times
    assert result["repeats_identical"] == kinds["repeat"]
    assert result["cache_over_bound"] == 0
    assert max(s["cache_entries"] for s in result["samples"]) >= 3  # the cache was used, and evicted
    after = [s for s in result["samples"] if s["request"] >= WARMUP]
    x = np.array([s["request"] for s in after], dtype=float)
    for key, scale, unit, tolerance in (("rss", 2**20, "MiB", 8.0), ("objects", 1, "objects", 250),
                                        ("tensors", 1, "tensors", 20)):
        y = np.array([s["memory"][key] / scale for s in after])
        third = len(y) // 3
        drift = np.median(y[-third:]) - np.median(y[:third])
        per_1000 = np.polyfit(x, y, 1)[0] * 1000
        assert drift < tolerance and per_1000 < tolerance, (
            f"{key} grew after warm-up: {drift:.1f} {unit} between the first and last third of requests "
            f"{WARMUP}-{REQUESTS} (trend {per_1000:.1f} {unit} per 1,000 requests); samples {np.round(y, 1).tolist()}")
