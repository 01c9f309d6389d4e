"""The bridge to torch's internals (``omnispec.kernels.torch_internals``): every private torch name it lists exists in
the installed torch, the installed torch is a version it was checked against, and no private torch module or name is
read anywhere else in omnispec."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from omnispec.kernels import torch_internals

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for p in (ROOT / "omnispec").rglob("*.py") if "__pycache__" not in p.parts)
BRIDGE = ROOT / "omnispec" / "kernels" / "torch_internals.py"


@pytest.mark.parametrize("export, module, name, why", torch_internals.PRIVATE,
                         ids=[f"{m}.{n}" for _, m, n, _ in torch_internals.PRIVATE])
def test_every_private_torch_name_exists_in_the_installed_torch(export, module, name, why):
    assert getattr(torch_internals, export) is not None, f"torch {torch.__version__} has no {module}.{name} ({why})"
    assert why.strip()


def test_the_installed_torch_is_a_version_the_bridge_was_checked_against():
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert minor in torch_internals.CHECKED_AGAINST, (minor, torch_internals.CHECKED_AGAINST)


def test_a_name_not_listed_is_refused():
    with pytest.raises(AttributeError, match="list a private torch name in PRIVATE first"):
        torch_internals._not_a_listed_name  # noqa: B018


def private_torch_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Imports of private torch modules (``torch._x``, ``torch.utils._x``) and private names read through ``torch``
    (``torch._x``, ``torch.ops.aten._x``, ``torch.utils._x``), by line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _private_torch(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            if _private_torch(node.module):
                found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain = ast.unparse(node)
            if chain.split(".")[0] == "torch" and _private_torch(chain):
                found.append((node.lineno, chain))
    return found


def _private_torch(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def test_no_private_torch_name_is_read_outside_the_bridge():
    wrong = [f"{path.relative_to(ROOT)}:{line} {what}" for path in SOURCES if path != BRIDGE
             for line, what in private_torch_uses(ast.parse(path.read_text()))]
    assert not wrong, "private torch names outside omnispec/kernels/torch_internals.py:\n" + "\n".join(wrong)


def test_the_scan_finds_each_kind_of_private_use():
    tree = ast.parse("import torch._dynamo\nfrom torch._inductor import config\nfrom torch.utils import _pytree\n"
                     "x = torch._addmm_activation\ny = torch.ops.aten._foo(1)\nfrom torch.utils._pytree import t\n")
    assert sorted(line for line, _ in private_torch_uses(tree)) == [1, 2, 3, 4, 5, 6]
