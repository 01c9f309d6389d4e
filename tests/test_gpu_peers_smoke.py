"""``benchmarks/gpu_peers.py`` on tiny CPU modules: the threshold search, the forward counts both sides report, and
the step-caching rows against cache-dit (skipped when cache-dit is not installed; it is no omnispec dependency)."""

import copy
import re
import types

import pytest


@pytest.fixture
def peers(monkeypatch):
    """The benchmark in smoke mode, with every module-level setting it changes restored afterwards."""
    from benchmarks import gpu_peers, harness, workloads

    for module, names in ((harness, ("SMOKE", "DEVICE")), (gpu_peers, ("SMOKE_OVERRIDES", "VERSIONS", "_TOKENIZERS"))):
        for name in names:
            monkeypatch.setattr(module, name, copy.copy(getattr(module, name)))
    for key, value in workloads.LTX2_SIZE.items():  # one dict, shared by the modules that import it
        monkeypatch.setitem(workloads.LTX2_SIZE, key, value)
    monkeypatch.setattr(workloads, "WORKLOADS", copy.deepcopy(workloads.WORKLOADS))
    monkeypatch.setattr(gpu_peers, "WORK", copy.deepcopy(gpu_peers.WORK))
    monkeypatch.setattr(gpu_peers, "RESULTS", harness.Results())
    harness.enable_smoke()
    for w in gpu_peers.WORK.values():
        w["cache_steps"] = 6
    return gpu_peers


def test_threshold_search_finds_the_count_or_the_closest():
    from benchmarks.gpu_peers import match_threshold

    def count_at(t):  # forwards fall as the threshold grows
        return max(1, round(20 - 40 * t))

    best, tried = match_threshold(count_at, 12, 0.08, 12)
    assert tried[best] == 12 and len(tried) <= 12
    best, tried = match_threshold(lambda t: 20 if t < 0.5 else 4, 12, 0.08, 6)  # a jump: 12 is never reached
    assert tried[best] in (20, 4) and len(tried) == 6


def _args(**kw):
    return types.SimpleNamespace(mask_policy="medium", dbcache="F1B0W0", dbcache_threshold="0.3", search_probes=4,
                                 **kw)


@pytest.mark.timeout(120)
def test_step_mask_rows_run_one_pattern_and_count_it(peers):
    pytest.importorskip("cache_dit")
    wl = peers.Workload("flux", 1, 1e12)
    peers.step_mask_part(wl, _args())
    eager, cachedit, ours = peers.RESULTS.rows
    assert eager["forwards"]["full_forwards"] == 6
    mask = cachedit["settings"]["mask"]
    assert mask == ours["settings"]["mask"] and mask[0] == "1"
    computed = mask.count("1")
    # the same full forwards; cache-dit still calls the denoiser on reused steps (its first block runs),
    # omnispec does not call it at all
    assert cachedit["forwards"]["full_forwards"] == ours["forwards"]["full_forwards"] == computed
    assert cachedit["forwards"]["denoiser_calls"] == 6 and ours["forwards"]["denoiser_calls"] == computed
    assert cachedit["forwards"]["block_computes_in_full_forwards"] > computed
    assert cachedit["cached_steps"] == [[i for i, m in enumerate(mask) if m == "0"]]


@pytest.mark.timeout(120)
def test_dbcache_row_and_first_block_row_make_the_same_full_forwards(peers):
    pytest.importorskip("cache_dit")
    wl = peers.Workload("wan", 1, 1e12)  # CFG: cond and uncond are separate forwards on both sides
    peers.dbcache_part(wl, _args())
    eager, cachedit, ours = peers.RESULTS.rows
    assert eager["forwards"]["full_forwards"] == 12
    assert "error" not in cachedit and "error" not in ours
    assert ours["forwards"]["full_forwards"] == cachedit["forwards"]["full_forwards"] < 12
    assert ours["matched"] is True
    assert not any(hasattr(m, "_diffusers_hook") for m in wl.mods["transformer"].modules())  # hooks removed


@pytest.mark.timeout(180)
def test_compile_part_runs_each_omnispec_variant_asked(peers, monkeypatch):
    monkeypatch.setattr(peers, "cachedit_compile", lambda twin: (_ for _ in ()).throw(RuntimeError("not here")))
    wl = peers.Workload("flux", 1, 1e12)
    peers.compile_part(wl, _args(omnispec_compile="regional+backend=aot_eager,"
                                                  "regional+backend=aot_eager+fused_gelu+modulation",
                                 compile_extra=False, compile_rounds=0))
    ours = [r for r in peers.RESULTS.rows if r.get("engine") == "omnispec"]
    assert [r["config"] for r in ours] == ["compile: regional + backend=aot_eager",
                                           "compile: regional + backend=aot_eager + fused_gelu + modulation"]
    assert all("error" not in r for r in ours), ours
    assert ours[0]["settings"]["mlp"] is None and ours[1]["settings"]["mlp"].startswith("transformer: bias + GELU")
    assert ours[0]["settings"]["modulation"] is None
    assert re.match(r"transformer: \d+ modulation linears from a table", ours[1]["settings"]["modulation"])


@pytest.mark.timeout(180)
def test_compile_rounds_interleave_the_first_omnispec_row_with_the_peer(peers, monkeypatch):
    """``--compile-rounds``: both sides stay built after their rows, run once each untimed, then in turns, the order
    flipped each round; one paired ratio per round. The peer's compile path stands in as the same regional compile
    (aot_eager)."""
    import contextlib

    def stand_in(twin):
        twin.compile_repeated_blocks(fullgraph=False, backend="aot_eager")
        return {"call": "stand-in"}

    monkeypatch.setattr(peers, "cachedit_compile", stand_in)
    monkeypatch.setattr(peers, "cachedit_settings", contextlib.nullcontext)
    timed, per_step = [], peers._per_step
    monkeypatch.setattr(peers, "_per_step", lambda run, *a: timed.append(run.__qualname__.split(".")[0]) or per_step(
        run, *a))
    wl = peers.Workload("flux", 1, 1e12)
    peers.compile_part(wl, _args(omnispec_compile="regional+backend=aot_eager", compile_extra=False,
                                 compile_rounds=3))
    assert not [r for r in peers.RESULTS.rows if "error" in r], peers.RESULTS.rows
    row = peers.RESULTS.rows[-1]
    first, second = "omnispec compile: regional + backend=aot_eager", "cache-dit compile path"
    assert row["config"] == f"interleaved: {first} | {second}" and row["rounds"] == 3
    assert [len(row["samples_ms"][side]) for side in (first, second)] == [3, 3]
    assert row["second_over_first_per_round"] == [b / a for a, b in zip(row["samples_ms"][first],
                                                                         row["samples_ms"][second])]
    assert row["second_over_first"] == sorted(row["second_over_first_per_round"])[1]
    ours, theirs = "omnispec_runner", "diffusers_runner"
    # an untimed round in each order (the first switches between the sides were slow), then ABBA: the order flips
    # each round
    assert timed[-10:] == [ours, theirs, theirs, ours, ours, theirs, theirs, ours, ours, theirs]
