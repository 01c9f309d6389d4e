import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
import sys as _sys

_sys.path.insert(0, str(ROOT))


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


# Tiny checkpoints, built once per test session and shared by every test file.
@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory):
    from omnispec.testing import tiny_flux

    return tiny_flux(tmp_path_factory.mktemp("flux"))


@pytest.fixture(scope="session")
def sd3_dir(tmp_path_factory):
    from omnispec.testing import tiny_sd3

    return tiny_sd3(tmp_path_factory.mktemp("sd3"))


@pytest.fixture(scope="session")
def wan_dir(tmp_path_factory):
    from omnispec.testing import tiny_wan

    return tiny_wan(tmp_path_factory.mktemp("wan"))


@pytest.fixture(scope="session")
def wan22_dir(tmp_path_factory):
    from omnispec.testing import tiny_wan

    return tiny_wan(tmp_path_factory.mktemp("wan22"), two_experts=True)


@pytest.fixture(scope="session")
def wan_i2v_dir(tmp_path_factory):
    from omnispec.testing import tiny_wan_i2v

    return tiny_wan_i2v(tmp_path_factory.mktemp("wan_i2v"))


@pytest.fixture(scope="session")
def wan22_i2v_dir(tmp_path_factory):
    from omnispec.testing import tiny_wan_i2v

    return tiny_wan_i2v(tmp_path_factory.mktemp("wan22_i2v"), two_experts=True)


@pytest.fixture(scope="session")
def photo(tmp_path_factory):
    """A small non-square RGB image on disk (so resizing and aspect handling are exercised)."""
    import numpy as np
    from PIL import Image

    path = tmp_path_factory.mktemp("images") / "photo.png"
    Image.fromarray((np.random.RandomState(0).rand(40, 24, 3) * 255).astype(np.uint8)).save(path)
    return path
