import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
import sys as _sys

_sys.path.insert(0, str(ROOT))


def inherited_path() -> list[str]:
    """This process's PYTHONPATH entries, to keep behind a child process's own: where they hold the dependencies
    (installed with ``pip --target``), a child without them could not import pydantic."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def spec_paths(node, prefix=()):
    """Every path into a spec's plain data (keys and list indices), the root first: where mutations go."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from spec_paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from spec_paths(v, prefix + (i,))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def reference(pipeline, path, **components):
    """The diffusers pipeline a parity test compares against: ``pipeline`` (a class, or its name in diffusers)
    loaded in float32 from ``path`` with ``components`` replaced, its progress bar off."""
    import torch

    if isinstance(pipeline, str):
        import diffusers

        pipeline = getattr(diffusers, pipeline)
    pipe = pipeline.from_pretrained(str(path), dtype=torch.float32, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generators(*seeds):
    """One CPU generator per seed, as omnispec and diffusers seed a batch."""
    import torch

    return [torch.Generator("cpu").manual_seed(s) for s in seeds]


# Tiny checkpoints, built once per test session and shared by every test file.
def _checkpoint(builder: str, folder: str, **kwargs):
    @pytest.fixture(scope="session")
    def fixture(tmp_path_factory):
        import omnispec.testing

        return getattr(omnispec.testing, builder)(tmp_path_factory.mktemp(folder), **kwargs)

    return fixture


flux_dir = _checkpoint("tiny_flux", "flux")
flux_fill_dir = _checkpoint("tiny_flux", "flux_fill", fill=True)
flux2_klein_dir = _checkpoint("tiny_flux2_klein", "flux2_klein")
sd3_dir = _checkpoint("tiny_sd3", "sd3")
wan_dir = _checkpoint("tiny_wan", "wan")
wan22_dir = _checkpoint("tiny_wan", "wan22", two_experts=True)
wan_i2v_dir = _checkpoint("tiny_wan_i2v", "wan_i2v")
wan_ti2v_dir = _checkpoint("tiny_wan_ti2v", "wan_ti2v")
wan_vace_dir = _checkpoint("tiny_wan_vace", "wan_vace")
wan22_i2v_dir = _checkpoint("tiny_wan_i2v", "wan22_i2v", two_experts=True)
ltx2_dir = _checkpoint("tiny_ltx2", "ltx2")
ltx20_dir = _checkpoint("tiny_ltx2", "ltx20", version="2.0")
ltx23_bwe_dir = _checkpoint("tiny_ltx2", "ltx23_bwe", bwe=True)  # the vocoder the ltx2.3-* specs name
qwen_image_dir = _checkpoint("tiny_qwen_image", "qwen_image")
qwen_edit_dir = _checkpoint("tiny_qwen_image", "qwen_edit", edit=True)
z_image_dir = _checkpoint("tiny_z_image", "z_image")
hunyuan_video15_dir = _checkpoint("tiny_hunyuan_video15", "hunyuan_video15")
hunyuan_video15_i2v_dir = _checkpoint("tiny_hunyuan_video15", "hunyuan_video15_i2v", i2v=True)
flux2_dir = _checkpoint("tiny_flux2", "flux2")
kandinsky6_dir = _checkpoint("tiny_kandinsky6", "kandinsky6")
kandinsky6_sr_dir = _checkpoint("tiny_kandinsky6_sr", "kandinsky6_sr")
ltx25_dir = _checkpoint("tiny_ltx25", "ltx25")
krea2_dir = _checkpoint("tiny_krea2", "krea2")


@pytest.fixture(scope="session")
def photo(tmp_path_factory):
    """A small non-square RGB image on disk (so resizing and aspect handling are exercised)."""
    import numpy as np
    from PIL import Image

    path = tmp_path_factory.mktemp("images") / "photo.png"
    Image.fromarray((np.random.RandomState(0).rand(40, 24, 3) * 255).astype(np.uint8)).save(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def _auto_device_is_the_cpu():
    """The suite's tiny models run where their diffusers references run, on the CPU, on a machine with CUDA too:
    there "auto" would put omnispec's side on the GPU and each parity check would compare two devices' roundings.
    Tests of CUDA name it (``device="cuda"``, ``runtime.device=cuda``); processes a test starts get ``cpu_env()``."""
    import importlib

    build = importlib.import_module("omnispec.runtime.build")  # the module (the package exports its function)
    resolve = build.resolve_device
    build.resolve_device = lambda device: resolve("cpu" if device == "auto" else device)
    yield
    build.resolve_device = resolve


def int8_weight(weight) -> bool:
    """Whether ``weight`` is torchao's int8 weight-only tensor, whatever torchao calls it: ``Int8Tensor`` (its data in
    ``qdata``) in the 0.18 the project pins, ``AffineQuantizedTensor`` (in ``tensor_impl.int_data``) in the 0.17 that
    torch 2.11 machines have."""
    from torchao.utils import TorchAOBaseTensor

    data = getattr(weight, "qdata", None)
    data = getattr(getattr(weight, "tensor_impl", None), "int_data", None) if data is None else data
    return isinstance(weight, TorchAOBaseTensor) and data is not None and str(data.dtype) == "torch.int8"


def cpu_env(*paths: Path, **extra: str) -> dict[str, str]:
    """The environment for a process a test starts that runs models (ranks of a parallel run, a benchmark's smoke
    run): this one's, with CUDA hidden (``_auto_device_is_the_cpu`` for a process of its own) and the repository,
    then ``paths``, first on PYTHONPATH (kept after them: an install there stays importable)."""
    path = os.pathsep.join([str(p) for p in (ROOT, *paths)] + inherited_path())
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", **extra}


@pytest.fixture(autouse=True)
def _omnispec_logger_restored():
    """A CLI command run in a test sets omnispec's logger up for a terminal (its own stderr handler, no
    propagation, a level); later tests read omnispec's messages through caplog, which listens at the root, so each
    test starts from the logger as importing omnispec leaves it, whatever order the tests run in."""
    import logging

    from omnispec.log import logger

    yield
    logger.handlers[:] = [h for h in logger.handlers if isinstance(h, logging.NullHandler)]
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


# ---- hostile inputs: nothing runs from them, each is one error line ------------------------------------------------

PROGRESS_BAR = re.compile(r"\|\s*\d+/\d+ \[")  # a tqdm bar's line, drawn while components load
MARKER_CODE = "import pathlib, os\npathlib.Path(os.environ['OMNISPEC_TEST_MARKER']).write_text('ran')\n"


def refused(argv, *fragments, capsys):
    """``omnispec -q ARGV`` exits 2 with only ``error:`` lines, no traceback, each fragment in them."""
    import logging

    from omnispec.cli import main

    capsys.readouterr()
    environment, level = dict(os.environ), logging.getLogger("omnispec").level
    try:
        assert main(["-q", *argv]) == 2
    finally:  # -q configures logging for the process: undo it for the tests that follow
        os.environ.clear()
        os.environ.update(environment)
        logging.getLogger("omnispec").setLevel(level)
    err = capsys.readouterr().err
    lines = [line for line in re.split(r"[\r\n]", err) if line.strip() and not PROGRESS_BAR.search(line)]
    assert lines and all(line.startswith("error: ") for line in lines), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """A file that hostile code would create (``MARKER_CODE`` writes it): its absence shows that nothing ran."""
    path = tmp_path / "code-ran"
    monkeypatch.setenv("OMNISPEC_TEST_MARKER", str(path))
    return path


qwen_image21_dir = _checkpoint("tiny_qwen_image21", "qwen_image21")
qwen_image21_turbo_dir = _checkpoint("tiny_qwen_image21", "qwen_image21_turbo", turbo=True)
minimax_h3_dir = _checkpoint("tiny_minimax_h3", "minimax_h3")
flux3_dir = _checkpoint("tiny_flux3", "flux3")
flux3_distilled_dir = _checkpoint("tiny_flux3", "flux3_distilled", distilled=True)
