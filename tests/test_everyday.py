"""Everyday use: questions that need no model answer before torch is imported, and each message names what the user
gave (the --set argument with the nearest key, the folder given as an output, the missing file, the spec's own
source), shortened where the user's string is long; a local run asks the Hub nothing; CPU threads follow the free
cores."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from conftest import SPECS, cpu_env, refused

DIGITS = str(SPECS / "digits.yaml")


def imports_after(argv: list[str], tmp_path) -> tuple[int, set[str]]:
    """The CLI's exit code for ``argv`` and the model libraries imported by then, in a fresh interpreter."""
    script = ("import sys, json; from omnispec.cli import main; code = main(sys.argv[1:]); "
              "print(json.dumps([code, sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", script, "-q", *argv], capture_output=True, text=True, cwd=tmp_path,
                         env=cpu_env(), timeout=120)
    code, modules = json.loads(out.stdout.strip().splitlines()[-1])
    return code, set(modules)


@pytest.mark.parametrize("argv", [
    ["explain", "digits"], ["validate", "digits"], ["list"], ["schema"],
    ["run", "digits", "--prompt", "seven", "--steps", "0", "--output", "x.png"],
    ["run", "digits", "--prompt", "seven", "--output", "x.txt"],
    ["run", "digits", "--prompt", "seven", "--output", "."],
], ids=["explain", "validate", "list", "schema", "request", "suffix", "folder"])
def test_questions_and_mistakes_are_answered_before_any_model_library_is_imported(argv, tmp_path):
    code, modules = imports_after(argv, tmp_path)
    assert code == (0 if argv[0] in ("explain", "validate", "list", "schema") else 2)
    assert modules == set(), modules


def test_a_set_typo_names_the_set_argument_and_the_nearest_key(capsys):
    refused(["validate", DIGITS, "--set", "recipe.defalts.steps=2"],
            "error: --set 'recipe.defalts.steps=2': recipe.defalts: unknown key 'defalts'; did you mean 'defaults'?",
            capsys=capsys)
    refused(["validate", DIGITS, "--set", "policies.cache={kind: step_mask, mask: [true], maks: 1}"],
            "unknown key 'maks'; did you mean 'mask'?", capsys=capsys)


def test_a_key_of_the_file_itself_is_still_blamed_on_the_file(tmp_path, capsys):
    spec = tmp_path / "mine.yaml"
    spec.write_text(f"extends: {DIGITS}\nruntime: {{sed: 3}}\n")
    refused(["validate", str(spec)], f"error: {spec}: runtime.sed: unknown key 'sed'; did you mean 'seed'?",
            capsys=capsys)


def test_a_folder_given_as_output_is_told_as_a_folder(tmp_path, capsys):
    refused(["run", "digits", "--prompt", "seven", "--output", str(tmp_path)],
            f"--output: {tmp_path} is a directory; give a file name in it, such as {tmp_path / 'out.png'}", capsys=capsys)


def test_explaining_a_missing_output_names_the_file_and_the_nearest_output_not_every_bundled_spec(tmp_path, capsys):
    (tmp_path / "cat.png").write_bytes(b"")
    near = f"did you mean {str(tmp_path / 'cat.png')!r}?"
    err = refused(["explain", str(tmp_path / "car.png")], "no such file", near, "omnispec list", capsys=capsys)
    assert "flux1-dev" not in err and len(err.splitlines()) == 1, err


def test_a_misspelt_spec_name_is_one_line_with_the_nearest_names_and_a_pointer_to_list(capsys):
    err = refused(["explain", "fluxx"], "error: no such spec file 'fluxx' and no bundled spec named 'fluxx'; did you "
                  "mean 'flux", "(omnispec list names the bundled specs)", capsys=capsys)
    assert "qwen-image" not in err and len(err.splitlines()) == 1, err


def test_a_misspelt_spec_file_names_the_spec_file_beside_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "mine.yaml").write_text(f"extends: {DIGITS}\n")
    monkeypatch.chdir(tmp_path)
    refused(["validate", "mine.yml"], "no such spec file 'mine.yml'", "did you mean 'mine.yaml'?", capsys=capsys)


HUGE = 120_000  # characters: a value pasted by mistake, a file read into an argument


@pytest.mark.parametrize("argv", [
    ["validate", DIGITS, "--set", f"runtime.seed={'x' * HUGE}"],  # pydantic's error quotes the value
    ["validate", DIGITS, "--set", f"runtime.{'k' * HUGE}=1"],  # an unknown key, in the path and in the message
    ["validate", DIGITS, "--set", f"policies.cache.kind={'k' * HUGE}"],  # an unknown variant
    ["explain", "f" * HUGE],  # a spec name the OS refuses as a file name
    ["explain", "f" * 200],  # a spec name that is no file and no bundled spec
], ids=["value", "key", "variant", "file", "name"])
def test_an_error_line_shortens_a_long_value_and_says_how_long_it_was(argv, capsys):
    err = refused(argv, "characters)", capsys=capsys)
    assert len(err) < 600 and len(err.splitlines()) == 1, err[:2000]


def test_an_argument_errors_line_shortens_the_long_value_it_quotes(capsys):
    from omnispec.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["run", "digits", "--prompt", "seven", "--steps", "9" * HUGE + "x"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err) < 200 and err.strip().endswith("... (120,001 characters)'"), err[:2000]


def test_a_device_that_is_not_here_is_told_before_diffusers_is_imported(tmp_path):
    code, modules = imports_after(["run", "digits", "--prompt", "seven", "--device", "cuda:9", "--output", "x.png"],
                                  tmp_path)
    assert code == 2 and "diffusers" not in modules and "transformers" not in modules, modules


def test_the_estimate_names_the_specs_source_when_no_source_was_given(tmp_path, capsys):
    err = refused(["explain", DIGITS, "--estimate", "--set", f"model.source={tmp_path / 'nowhere'}"],
                  "model.source:", capsys=capsys)
    assert "--source:" not in err


def test_a_long_log_message_is_shortened(capsys):
    from omnispec.log import LONGEST_MESSAGE, configure

    configure(0)
    logging.getLogger("some.library").addHandler(handler := logging.StreamHandler(sys.stderr))
    try:
        logging.getLogger("some.library").warning("truncated: " + "seven " * 20_000)
    finally:
        logging.getLogger("some.library").removeHandler(handler)
    line = capsys.readouterr().err.strip()
    assert len(line) <= LONGEST_MESSAGE and line.endswith("(120,011 characters)"), line[-80:]


def test_a_local_run_puts_the_hub_libraries_offline_and_a_hub_source_does_not(monkeypatch):
    from omnispec.spec import load_spec
    from omnispec.spec.hub import needs_hub, offline_unless_needed

    local = load_spec(DIGITS)
    assert not needs_hub(local) and needs_hub(load_spec(DIGITS, ["model.source=owner/model"]))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    offline_unless_needed(load_spec(DIGITS, ["model.source=owner/model"]))
    assert "HF_HUB_OFFLINE" not in os.environ
    offline_unless_needed(local)
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_a_local_run_makes_no_hub_request_at_any_verbosity(tmp_path):
    """With HF_HUB_OFFLINE unset and no route to the Hub (a proxy that refuses), -vv shows no request and no
    traceback."""
    env = cpu_env(OMP_NUM_THREADS="1")
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    env.update(HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    out = subprocess.run([sys.executable, "-m", "omnispec", "-vv", "run", "digits", "--prompt", "seven", "--steps", "1",
                          "--output", "x.png"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "huggingface.co" not in out.stderr, out.stderr[-3000:]


def _hub_connections_of(call: str, cwd) -> tuple[list[str], str | None, bool]:
    """Run ``call`` (Python after ``import omnispec``) in a fresh interpreter with HF_HUB_OFFLINE unset and every
    connection refused and recorded: the hosts it tried, and HF_HUB_OFFLINE and huggingface_hub's setting after."""
    script = (
        "import json, os, socket\n"
        "tried = []\n"
        "def refuse(*args, **kwargs):\n"
        "    tried.append(str(args[0] if args else kwargs.get('host')))\n"
        "    raise OSError('no network in this test')\n"
        "socket.getaddrinfo = refuse\n"
        "socket.socket.connect = lambda self, address: refuse(address)\n"
        "import omnispec, huggingface_hub\n"
        f"{call}\n"
        "print(json.dumps([tried, os.environ.get('HF_HUB_OFFLINE'), huggingface_hub.constants.HF_HUB_OFFLINE]))\n")
    env = cpu_env(OMP_NUM_THREADS="1", HF_HOME=str(cwd / "hf"))  # no cached answer of the Hub's to read
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tried, variable, offline = json.loads(out.stdout.strip().splitlines()[-1])
    return tried, variable, offline


def test_build_from_python_of_a_local_spec_asks_the_hub_nothing_and_leaves_the_setting_as_it_was(tmp_path):
    """``omnispec.build`` in a fresh interpreter with HF_HUB_OFFLINE unset: a local spec builds with no connection
    tried, and the process is online again afterwards."""
    tried, variable, offline = _hub_connections_of("omnispec.build('digits', overrides=['runtime.progress=false'])",
                                                   tmp_path)
    assert tried == [] and variable is None and offline is False, (tried, variable, offline)


def test_replay_from_python_of_a_local_record_asks_the_hub_nothing(tmp_path):
    """``omnispec.replay`` of an output made from a local checkpoint, in a fresh interpreter with HF_HUB_OFFLINE
    unset: no connection is tried, and the process is online again afterwards."""
    made = subprocess.run([sys.executable, "-m", "omnispec", "-q", "run", "digits", "--prompt", "seven", "--steps",
                           "1", "--output", "seven.png"], capture_output=True, text=True, cwd=tmp_path,
                          env=cpu_env(OMP_NUM_THREADS="1"), timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    tried, variable, offline = _hub_connections_of("omnispec.replay('seven.png')", tmp_path)
    assert tried == [] and variable is None and offline is False, (tried, variable, offline)


def test_a_mistake_under_torchrun_is_one_error_line_and_exit_2_from_each_rank(tmp_path):
    """torchrun then adds its own report (a traceback of torchrun and a table of the ranks' exit codes) and exits 1:
    docs/cli.md shows it. omnispec's part is one line, from rank 0, and exit code 2 on every rank that got so far."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "omnispec", "validate", "nosuch.yaml"], capture_output=True, text=True, cwd=tmp_path,
                         env=cpu_env(OMP_NUM_THREADS="1"), timeout=120)
    lines = (out.stdout + out.stderr).splitlines()
    assert [line for line in lines if line.startswith("error:")] == [(
        "error: no such spec file 'nosuch.yaml' and no bundled spec named 'nosuch.yaml' (omnispec list names the "
        "bundled specs)")], out.stderr
    assert "exitcode  : 2" in out.stderr and out.returncode == 1, out.stderr


NO_SPEC = "error: no such spec file 'nosuch.yaml' and no bundled spec named 'nosuch.yaml'"


@pytest.mark.parametrize("argv", [["validate", "nosuch.yaml"], ["explain", "nosuch.yaml"]])
def test_another_rank_that_fails_first_waits_for_rank_0_to_say_it(argv, tmp_path, monkeypatch, capsys):
    """torchrun stops every rank once one exits with an error: a rank other than 0 that found the mistake first must
    not exit before rank 0 has said it (the line would be lost), and says it itself where rank 0 never does."""
    import threading

    from omnispec import log
    from omnispec.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(log, "RANK_ZERO_WAIT_S", 0.5)
    assert main(argv) == 2 and NO_SPEC in capsys.readouterr().err  # rank 0 never spoke: this rank says it

    flag = log._spoken_flag()
    assert flag is not None and os.path.dirname(flag) == str(tmp_path)
    monkeypatch.setattr(log, "RANK_ZERO_WAIT_S", 30.0)
    rank_0 = threading.Timer(0.3, lambda: open(flag, "w").close())  # rank 0 says it a little later
    rank_0.start()
    assert main(argv) == 2 and os.path.exists(flag)  # returned only once rank 0 had spoken
    rank_0.join()
    assert capsys.readouterr().err == ""  # said once, by rank 0

    os.remove(flag)
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 2 and NO_SPEC in capsys.readouterr().err and os.path.exists(flag)  # rank 0: says, marks


def test_cpu_threads_follow_the_free_cores(monkeypatch):
    import torch

    from omnispec.runtime import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_CHOSEN", [])
    monkeypatch.setattr(threads, "free_cores", lambda: 1)
    before = torch.get_num_threads()
    try:
        threads.set_cpu_threads(None)
        assert torch.get_num_threads() == min(before, 1)
        threads.set_cpu_threads(3)  # runtime.threads
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_free_cores_leave_out_the_load_of_other_processes(monkeypatch):
    from omnispec.runtime import threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    assert threads.free_cores() == 2  # 4 cores, 2 busy beside this process
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 0.0, 0.0))
    assert threads.free_cores() == 1


def _digits_step_predicted_and_measured(pipe) -> tuple[float, float]:
    """The CPU estimate of a digits step, calibrated now, and the step measured right after it: the slope between
    2 and 12 steps, the fastest of seven each, as the calibration takes its fastest of seven."""
    import time

    from omnispec.estimate import calibrate, estimate
    from omnispec.spec import load_spec

    calibrate._measured.cache_clear()  # a calibration cached earlier in the suite saw another load
    predicted = estimate(load_spec(DIGITS), kind="cpu").step_seconds
    timings = []
    for steps in (2, 12) * 7:
        start = time.perf_counter()
        pipe.generate(pipe.request("seven", seed=0, steps=steps), decode=False)
        timings.append(time.perf_counter() - start)
    return predicted, (min(timings[1::2]) - min(timings[0::2])) / 10


def test_the_cpu_estimate_of_a_digits_step_is_within_twice_a_measured_one():
    """A busy machine can change speed between the calibration and the measurement, so the pair is taken up to three
    times; an estimate that is wrong is wrong in every pair, and fails."""
    import torch

    import omnispec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU kind is measured at the thread count the run then uses
    pairs = []
    try:
        pipe = omnispec.build(DIGITS, overrides=["runtime.progress=false"])
        for _ in range(3):
            predicted, measured = _digits_step_predicted_and_measured(pipe)
            pairs.append((predicted, measured))
            if measured / 2 <= predicted <= measured * 2:
                break
    finally:
        torch.set_num_threads(threads)
    assert measured / 2 <= predicted <= measured * 2, pairs


def test_a_spec_error_crosses_a_process_boundary_whole():
    """Errors raised in Ray workers or spawned processes come back pickled: the problems, their paths and the class
    survive."""
    import pickle

    from omnispec.spec.errors import LaunchError, Problem, SpecError

    for error in (SpecError([Problem("recipe.defaults.steps", "must be at least 1"), Problem("", "and another")]),
                  LaunchError.single("WORLD_SIZE is 2 but RANK is missing", "policies.parallel")):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and back.problems == error.problems and str(back) == str(error)
