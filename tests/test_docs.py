"""Every code block of README.md and docs/*.md runs as written (docs/testing.md, "The docs run"), so no snippet can
drift from the code.

Per file, in a fresh folder outside the repository that is the working directory, blocks run in order: each
``python`` block alone, as a user copies it, unless the line right before it, ``_(continues the block above)_``,
says it goes on from the block before (then it shares that block's names); a block that writes files runs a second
time in a row, in the same folder, and must run again; ``bash`` blocks line by line (``omnispec`` through the CLI in
this process, ``torchrun`` as its ranks, forked with torchrun's environment by ``preloaded``; the quick start's
``pip install`` lines are the ones ``.ci/run`` runs), ``yaml`` blocks validated as specs (a fragment onto the spec
an ``<!-- fragment of NAME -->`` comment names), ``json`` parsed. ``text`` blocks are figures and printed output,
not code. The one substitution: a bundled spec of a real model (and a ``/models/...`` checkpoint path) runs on its
family's tiny checkpoint from ``omnispec.testing.tiny_checkpoint``, with its overrides first.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

import omnispec
from omnispec.cli import main
from omnispec.spec import load_spec
from omnispec.spec.catalog import bundled_path
from omnispec.spec.loader import deep_merge, resolve_spec_data
from omnispec.testing import TINY_SPECS, tiny_checkpoint

import preloaded
from conftest import ROOT, cpu_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([A-Za-z]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
FRAGMENT = re.compile(r"<!--\s*fragment of ([\w.\-]+)\s*-->\s*$")
CONTINUES = re.compile(r"^_\(continues the block above\)_\s*$")
EXPECT = re.compile(r"#\s*exit (\d+)\s*$")
LANGUAGES = ("python", "bash", "yaml", "json", "text")


def blocks(page: Path) -> list[tuple[str, str, int, str | None]]:
    """(language, code, line, the spec a fragment belongs to) of each fenced block."""
    return [(language, code, line, fragment) for language, code, line, fragment, _ in marked_blocks(page)]


def marked_blocks(page: Path) -> list[tuple[str, str, int, str | None, bool]]:
    """(language, code, line, the spec a fragment belongs to, whether it continues the block before) of each block."""
    text = page.read_text()
    out = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip().splitlines()
        fragment = FRAGMENT.search(before[-1]) if before else None
        continues = bool(before) and CONTINUES.search(before[-1]) is not None
        out.append((match.group(1), match.group(2), text.count("\n", 0, match.start()) + 1,
                    fragment.group(1) if fragment else None, continues))
    return out


def quick_start() -> list[str]:
    """The README's two set-up commands (the first bash block)."""
    language, code, _, _ = blocks(ROOT / "README.md")[0]
    assert language == "bash"
    return [line for line in code.splitlines() if line.strip()]


def test_every_block_has_a_language_the_docs_test_runs():
    for page in PAGES:
        for language, code, line, _ in blocks(page):
            assert language in LANGUAGES, f"{page.name}:{line}: block language {language!r}"


def test_the_site_builds_strict_and_offline(tmp_path):
    """The API reference from the docstrings and every page, with mkdocs' --strict (a broken link, a docstring
    griffe cannot read or an object documented twice is an error); the config fetches nothing."""
    pytest.importorskip("mkdocstrings")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_ci_runs_the_readme_quick_start_as_written():
    commands = quick_start()
    assert len(commands) == 2 and commands[1].endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "Quick start" in ci and "README.md" in ci  # .ci/run reads them from README, it does not copy them
    assert all("pip install" in c for c in commands) and "--index-url https://download.pytorch.org/whl/cpu" in \
        commands[0]


# ---- the substitution ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-checkpoints")
    return lambda name: tiny_checkpoint(name, folder)


def bundled_name(ref) -> str | None:
    """The bundled spec a reference names (a name, or a path to a file of specs/), or None."""
    text = str(ref)
    name = Path(text).name.removesuffix(".yaml")
    bundled = bundled_path(name)
    if bundled is None:
        return None
    if Path(text).exists():  # a file: the bundled one itself (specs/flux1-dev.yaml), or a user's own
        return name if Path(text).resolve() == bundled.resolve() else None
    return name if bundled_path(text) is not None else None


def real_checkpoint(name: str | None, source) -> bool:
    return name in TINY_SPECS and (source is None or str(source).startswith("/models/"))


def cli_argv(argv: list[str], tiny) -> list[str]:
    """``omnispec run|explain SPEC ...`` of a real model gets its tiny checkpoint and overrides."""
    if not argv or argv[0] not in ("run", "explain") or len(argv) < 2:
        return argv
    source = argv[argv.index("--source") + 1] if "--source" in argv else None
    name = bundled_name(argv[1])
    if not real_checkpoint(name, source):
        return argv
    path, overrides = tiny(name)
    argv = list(argv)
    if source is not None:
        argv[argv.index("--source") + 1] = str(path)
    else:
        argv[2:2] = ["--source", str(path)]
    return argv[:2] + [a for o in overrides for a in ("--set", o)] + argv[2:]


@pytest.fixture
def substituted(tiny, monkeypatch):
    real_build = omnispec.build

    def build(spec_or_path, source=None, overrides=(), *args, **kwargs):
        name = bundled_name(spec_or_path) if isinstance(spec_or_path, (str, os.PathLike)) else None
        if real_checkpoint(name, source):
            source, extra = tiny(name)
            overrides = [*extra, *overrides]
        return real_build(spec_or_path, source, overrides, *args, **kwargs)

    monkeypatch.setattr(omnispec, "build", build)
    return tiny


# ---- running a page --------------------------------------------------------------------------------------

def commands(code: str) -> list[tuple[str, int]]:
    """Logical lines of a bash block (continuations joined, comments kept for ``# exit N``), split at ``&&``."""
    joined = code.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        expected = EXPECT.search(line)
        body = line.split(" #")[0] if " #" in line else line
        for part in body.split("&&"):
            out.append((part.strip(), int(expected.group(1)) if expected else 0))
    return out


def run_command(command: str, expected: int, tiny, where: str) -> None:
    argv = shlex.split(command)
    if argv[:2] == ["pip", "install"]:
        assert command in " && ".join(quick_start()), f"{where}: a pip command other than the quick start's"
        return
    if argv[:3] == ["python", "-m", "pytest"]:
        return  # this suite
    if argv[0] == "omnispec":
        code = main(cli_argv(argv[1:], tiny))
        assert code == expected, f"{where}: {command} exited {code}"
        return
    if argv[0] == "torchrun":
        at = argv.index("omnispec")
        assert argv[at - 1] == "-m" and argv[1] == "--nproc-per-node", f"{where}: torchrun --nproc-per-node N -m omnispec"
        # the page's ranks on gloo, as on a machine without CUDA, with torchrun's environment (``preloaded``)
        with tempfile.TemporaryDirectory() as folder:
            ranks = preloaded.run_ranks(int(argv[2]), "omnispec", cli_argv(argv[at + 1:], tiny),
                                        cpu_env(OMP_NUM_THREADS="1"), Path(folder), timeout=600)
        code = 0 if all(rank.returncode == 0 for rank in ranks) else 1  # torchrun's, when a worker failed
        assert code == expected, f"{where}: {command}\n" + "\n".join(rank.stderr[-3000:] for rank in ranks)
        return
    raise AssertionError(f"{where}: the docs test runs omnispec, torchrun and the quick start's pip, not {argv[0]!r}")


def files_in(folder: Path) -> dict[str, float]:
    """Every file below ``folder`` with its modification time."""
    return {str(p): p.stat().st_mtime for p in folder.rglob("*") if p.is_file()}


def test_a_python_block_runs_alone_unless_marked_as_continuing(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n_(continues the block above)_\n```python\nprint(x)\n```\n\n```python\ny = 2\n```\n")
    assert [continues for *_, continues in marked_blocks(page)] == [False, True, False]


def check_yaml(code: str, fragment_of: str | None, where: str) -> None:
    data = yaml.safe_load(code)
    if fragment_of is None:
        assert isinstance(data, dict) and "omnispec" in data, f"{where}: a YAML block is a whole spec or a fragment"
        load_spec(data)
        return
    base, _ = resolve_spec_data(fragment_of)
    load_spec(deep_merge(base, data))


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_page_runs_as_written(page, substituted, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    chain: list[tuple[str, str]] = []  # the python blocks a block continues, and itself: (code, where)
    namespace: dict = {}
    for language, code, line, fragment_of, continues in marked_blocks(page):
        where = f"{page.name}:{line}"
        if language == "python":
            if not continues:
                chain, namespace = [], {"__name__": "__docs__"}
            chain.append((code, where))
            written = files_in(tmp_path)
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the docs' own code
            if files_in(tmp_path) != written:  # it wrote files: a user runs it again, in the same folder
                again: dict = {"__name__": "__docs__"}
                for earlier, at in chain:
                    exec(compile(earlier, f"{at} (again)", "exec"), again)  # noqa: S102
        elif language == "bash":
            for command, expected in commands(code):
                if page.name == "README.md" and line == blocks(page)[0][2]:
                    continue  # the quick start: .ci/run runs it (test_ci_runs_the_readme_quick_start_as_written)
                run_command(command, expected, substituted, where)
        elif language == "yaml":
            check_yaml(code, fragment_of, where)
        elif language == "json":
            json.loads(code)
