"""Every GPU benchmark's ``--smoke`` run on the CPU: tiny models through the same code the H200 runs, so a
benchmark that no longer starts, or whose rows now report an error, fails here and not in a GPU session (whose
time is scarce). ``gpu_peers`` has its own, finer test (tests/test_gpu_peers_smoke.py). And the shape of the
benchmarks' package: shared modules that import no benchmark, one ``main`` skeleton, a peer named by each."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

import preloaded
from conftest import cpu_env

# (module, extra arguments, processes): the parallel benchmark runs under torchrun on gloo.
SMOKES = [
    ("estimate_vs_measured", [], 1),
    ("gpu_soak", [], 1),
    ("gpu_soak", ["--model", "wan_ti2v", "--set", "policies.compile.mode=regional",  # a video model, compiled
                  "--set", "policies.compile.backend=aot_eager"], 1),
    ("gpu_lora_hotswap", [], 1),
    ("gpu_interpreter", ["--repeats", "1", "--workloads", "flux,wan,wan22_i2v,ltx2_condition",  # LTX-2: gpu_ltx2's
                         "--also", "policies.mlp.fused_gelu=true"], 1),
    # sides timed after the rounds over the same modules: a preset (its row says what it turned on here), offload
    # moves them to the host, int8 then quantizes them in place (fp8 on the GPU), as FLUX.2 [dev]'s 80 GB rows do
    ("gpu_interpreter", ["--repeats", "1", "--workloads", "flux2", "--then", "policies.preset=fast",
                         "--then", "policies.offload={strategy: model}",
                         "--then", "policies.quantization={transformer: {method: int8_weight_only}}"], 1),
    # FLUX.3, Krea 2, Qwen-Image-2.1, LTX-2.5, Kandinsky 6 and MiniMax-H3 (bf16, and quantized on its way to the card
    # for an 80 GB one): the workloads of their GPU calls, in one run
    ("gpu_interpreter", ["--repeats", "1", "--workloads",
                         "flux3,flux3_distilled,krea2,qwen_image21,ltx25,kandinsky6,minimax_h3,minimax_h3_fp8"], 1),
    ("gpu_ltx2", ["--repeats", "1"], 1),
    # one process for every part (tiny models, so no longer two halves); the fp8 rows' compiled variants are the
    # compile part's code again: left out to keep the suite short. The second round runs the variants backwards, so
    # diffusers' peer then copies the transformer the fused variant left (the copy must strip omnispec's processors)
    ("gpu_policies", ["--repeats", "1", "--parts", "attention,compile,wan_attention,layerwise,quant,model_offload",
                      "--quant-compile", "none", "--quant-profile", "--inductor-passes", "fast_tanh",
                      "--compile-variants", "regional+fused_qkv+qk_norm_rope+fused_gelu,full+qk_norm_rope",
                      "--compile-rounds", "2"], 1),
    ("gpu_video_rollout", [], 1),  # eager and compiled (aot_eager), replays with and without gradients
    ("gpu_video_rollout", ["--model", "ltx23", "--no-compile", "--profile"], 1),  # audio + video, split by module
    ("gpu_compile_ready", ["--workloads", "ltx23"], 1),  # two child processes, STG in LTX-2.3's compiled blocks
    # --smoke quantizes int8 (the CPU has no fp8); two variants, so the second copy of the base is made and used,
    # the second with its VAE decoder compiled too (the breakdown then times the compiled decode)
    ("gpu_rollout", ["--quantized-base", "fp8_dynamic:row", "--quantized-compile", "regional,regional+vae",
                     "--profile-rollout", "--compress", "0.5"], 1),
    ("gpu_activation_quant", ["--iters", "2"], 1),
    ("gpu_norm_rope", [], 1),
    ("gpu_adaln_norm", [], 1),  # every default variant: each heuristic's scope entered around a compile
    ("gpu_gemm_epilogue", [], 1),
    ("gpu_attention_kernels", [], 1),
    ("gpu_sparse_attention", [], 1),
    ("gpu_sparse_attention", ["--kept-only"], 1),  # the layouts' blocks kept and their masks' build, no timing
    ("gpu_sage_attention", [], 1),
    ("gpu_gemm_kernels", [], 1),
    ("gpu_joint_gemm", [], 1),
    # the whole block and one LoRA linear: every code path; the feed-forward as policies.mlp.fused_gelu makes it
    ("gpu_replay_bits", ["--parts", "block,attn.to_q,ff.net.0", "--fused-gelu"], 1),
    ("gpu_parallel", ["--repeats", "1"], 2),
    ("gpu_scale", ["--repeats", "1", "--workloads", "wan"], 2),  # LTX-2's rows run the same code
    ("gpu_shard_graphs", [], 1),
    ("gpu_engine", [], 1),  # Ray actors: 1 then 2 CPU workers beside the trainer
    ("gpu_engine", ["--model", "wan_ti2v"], 1),  # the video family through the engine
]
# Benchmarks that need an optional package, not in the dev extra: skipped without it.
NEEDS = {"gpu_engine": "ray"}
# Rows a CPU cannot run by nature: diffusers' CUDA-only attention backends and SageAttention's kernels, which the GPU
# run measures (an unusable backend is a row of its own, printed as every row is).
CUDA_ONLY = ("_native_cudnn", "_native_flash", "sdpa_cudnn", "sdpa_efficient", "sage")


def _rows(stdout: str) -> list[dict]:
    rows = []
    for line in stdout.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


@pytest.mark.parametrize("module, extra, processes", SMOKES,
                         ids=[s[0] + "".join("-" + s[1][s[1].index(flag) + 1] for flag in ("--parts", "--model")
                                             if flag in s[1]) for s in SMOKES])
def test_benchmark_smoke_runs_and_reports_no_error(module, extra, processes, tmp_path):
    if module in NEEDS:
        pytest.importorskip(NEEDS[module])
    # forks of a process that imported torch, diffusers and omnispec once (``preloaded``), each in its own folder
    env, argv = cpu_env(OMP_NUM_THREADS="1"), ["--smoke", *extra]
    ranks = preloaded.run_ranks(processes, f"benchmarks.{module}", argv, env, tmp_path) if processes > 1 else [
        preloaded.run(f"benchmarks.{module}", argv, env, tmp_path)]
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-3000:]
    done = ranks[0]
    rows = _rows(done.stdout)
    assert rows, f"{module} --smoke printed no result row:\n{done.stdout[-2000:]}"
    failed = [row for row in rows if "error" in row and not any(b in str(row.get("config")) for b in CUDA_ONLY)]
    assert not failed, f"{module} --smoke rows report errors: {failed}"
    # a side run under a preset names what the preset turned on on this machine (it differs between machines)
    unnamed = [label for row in rows for label, side in row.items()
               if "policies.preset=" in label and isinstance(side, dict) and "preset" not in side]
    assert not unnamed, f"{module} --smoke: preset sides without the preset's outcome: {unnamed}"


def test_the_interpreter_benchmark_has_a_workload_for_every_family_with_a_diffusers_pipeline():
    """A family added without a GPU workload would never be timed against its pipeline (issue 27's first
    deliverable); the digits model is omnispec's own and has no diffusers pipeline to time against."""
    from benchmarks.workloads import WORKLOADS
    from omnispec.spec import BUILTIN_FAMILIES

    assert sorted(set(BUILTIN_FAMILIES) - {"digits"} - set(WORKLOADS)) == []


def test_the_stack_sampler_names_where_a_long_call_waits_and_leaves_a_file_while_it_runs(tmp_path):
    """A first call cut by a device call's limit printed nothing of where its minutes went; the sampler's file is
    written while the call runs, and its innermost frames name the function that waited, not only its callers."""
    import time

    from benchmarks.harness import StackSampler

    dump = tmp_path / "stacks.json"

    def compile_that_waits() -> None:
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            if dump.exists():
                return
            time.sleep(0.01)

    with StackSampler(interval=0.02, dump_to=dump, dump_every_s=0.1) as stacks:
        compile_that_waits()
        assert dump.exists(), "nothing written while the call ran"
    top = stacks.top()
    assert top["samples"] >= 5
    first = next(iter(top["innermost"]))
    assert "compile_that_waits" in first, top["innermost"]
    assert json.loads(dump.read_text())["samples"] == top["samples"]


def test_the_profile_idle_summary_counts_only_time_no_kernel_covers():
    """A CPU run has no device kernels, so the smoke leaves ``idle_summary`` empty; its arithmetic here."""
    import types

    from benchmarks.gpu_policies import idle_summary

    def kernel(start, end, name):
        return types.SimpleNamespace(time_range=types.SimpleNamespace(start=start, end=end), name=name,
                                     device_type=types.SimpleNamespace(name="CUDA"))

    # b runs inside a (another stream): no gap; then 30 µs idle before c, none before d, 40 before a again
    events = [kernel(0, 10, "a"), kernel(5, 8, "b"), kernel(40, 50, "c"), kernel(50, 60, "d"), kernel(100, 110, "a")]
    idle = idle_summary(types.SimpleNamespace(events=lambda: events), per=2)
    assert idle["idle_ms_per_step"] == pytest.approx(0.035) and idle["span_ms_per_step"] == pytest.approx(0.055)
    assert [(g["us"], g["after"], g["before"]) for g in idle["largest_us"]] == [(40, "d", "a"), (30, "a", "c")]
    assert idle["by_neighbours"][0] == {"between": "d -> a", "ms_per_step": pytest.approx(0.02), "gaps_per_step": 0.5}
    assert idle_summary(types.SimpleNamespace(events=lambda: []), per=1) == {}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_inductor_kernels_smoke_compiles_every_kernel_for_hopper(tmp_path):
    # the norms made persistent by the policy (its default): every kernel of the block pair written, compiled for
    # sm_90, reported
    done = preloaded.run("benchmarks.inductor_kernels", ["--smoke"], cpu_env(OMP_NUM_THREADS="1"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(done.stdout)
    norms = [row for row in rows if "layer_norm" in row["kernel"]]
    assert len(norms) >= 5 and all(row["rows_read"] == "once" for row in norms), rows
    assert all(row["global_memory_instructions"] and row.get("spilled_bytes", 0) == 0 for row in rows), rows


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_inductor_kernels_reads_norm_rows_once_up_to_the_default_bound(tmp_path):
    """The other families' norms at SD3.5's width and Wan 14B's: read once by default up to 4,096 elements, looped
    past it, in 16-byte loads with nothing spilled where read once."""
    done = preloaded.run("benchmarks.inductor_kernels", ["--norms", "1536,5120"], cpu_env(OMP_NUM_THREADS="1"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["shape"]: row for row in _rows(done.stdout)}
    assert set(rows) == {f"{norm}_modulated {width}" for norm in ("rms_norm", "layer_norm") for width in (1536, 5120)}
    for shape, row in rows.items():
        assert row["rows_read"] == ("once" if shape.endswith("1536") else "looped"), row
        if row["rows_read"] == "once":
            assert set(row["global_memory_instructions"]) <= {"ld v4.b32", "st v4.b32"}, row
            assert row.get("spilled_bytes", 0) == 0, row


# ---- the package's shape ------------------------------------------------------------------------------------------

BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
# Modules every benchmark may import; each imports only the shared modules listed with it, never a benchmark.
SHARED = {"harness": set(), "workloads": {"harness"}, "kernel_timing": set(), "inductor_passes": set(),
          "flow_grpo": {"harness"}}


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(BENCHMARKS_DIR.glob("*.py"))
            if path.stem != "__init__"}


def _benchmarks_imported(tree: ast.Module) -> set[str]:
    """The modules of the ``benchmarks`` package that ``tree`` imports, at any depth (function bodies too), written
    relatively (``from . import x``, ``from .x import y``) or absolutely (``benchmarks.x``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
        elif isinstance(node, ast.ImportFrom):
            package = (node.level == 1 and not node.module) or node.module == "benchmarks"
            if package:  # from . import x / from benchmarks import x
                names |= {a.name for a in node.names}
            elif node.level == 1:  # from .x import y
                names.add(node.module.split(".")[0])
            elif node.module and node.module.startswith("benchmarks."):
                names.add(node.module.split(".")[1])
    return names


def test_shared_benchmark_modules_import_no_benchmark():
    modules = _modules()
    assert set(SHARED) <= set(modules)
    for name, allowed in SHARED.items():
        imported = _benchmarks_imported(modules[name])
        assert imported <= allowed, f"benchmarks/{name}.py imports {sorted(imported - allowed)}; it may import only " \
                                    f"{sorted(allowed) or 'no benchmarks module'}"


def test_no_benchmark_imports_another_benchmark():
    for name, tree in _modules().items():
        if name in SHARED:
            continue
        others = _benchmarks_imported(tree) - set(SHARED)
        assert not others, f"benchmarks/{name}.py imports the benchmarks {sorted(others)}: what they share belongs " \
                           f"in one of {sorted(SHARED)}"


def test_every_benchmark_runs_through_the_one_main_skeleton():
    """No benchmark builds its own parser: each ``main`` is ``harness.run_benchmark``'s, with the shared flags."""
    for name, tree in _modules().items():
        if name in SHARED:
            continue
        calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        assert "harness.run_benchmark" in calls, f"benchmarks/{name}.py has no harness.run_benchmark main"
        assert "argparse.ArgumentParser" not in calls, f"benchmarks/{name}.py builds its own parser"


def test_every_benchmark_says_what_it_measures_and_against_which_peer():
    """The docstring's first line says what is measured (the parser's description); the next names the peer, or
    says why there is none."""
    for name, tree in _modules().items():
        if name in SHARED:
            continue
        lines = (ast.get_docstring(tree) or "").splitlines()
        assert len(lines) > 1 and len(lines[0]) > 20, f"benchmarks/{name}.py: no docstring saying what it measures"
        assert lines[1].startswith(("Peer: ", "No peer: ")), \
            f"benchmarks/{name}.py: its docstring's second line names no peer ('Peer: ...' or 'No peer: ...')"


@pytest.mark.gpu
def test_a_run_held_to_a_smaller_cards_memory_cannot_allocate_past_it():
    """``--device-memory-gib``: an H200 run stands in for an 80 GB card's only if it cannot use more than that."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from benchmarks import harness

    total = torch.cuda.get_device_properties(0).total_memory
    assert harness.hold_device_memory(1.0) == 1.0
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
        with pytest.raises(harness.UsageError, match="this GPU has"):
            harness.hold_device_memory(total / 2**30 + 1)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
