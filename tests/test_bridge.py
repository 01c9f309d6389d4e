"""The bridge to diffusers' internals: every private name it lists exists in the installed diffusers, and no
private name of diffusers (or transformers) is read anywhere else in omnispec."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import diffusers
import pytest

from omnispec import bridge

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for p in (ROOT / "omnispec").rglob("*.py") if "__pycache__" not in p.parts)

# torch objects' private attributes read outside the bridge (the bridge is diffusers'; torch's private modules and
# functions are read through omnispec/kernels/torch_internals.py), each for a reason written where used.
TORCH_INTERNALS = {
    "_parameters", "_buffers",  # offload/model.py: swapping a module's tensors in place without Module.to
    "_version",  # offload/model.py: a tensor's in-place version counter, to copy back only what changed
    "_overloadpacket", "_cdata",  # estimate/counting.py: a dispatch mode telling ops and storages apart
    "_compiled_call_impl",  # policies/compile.py: Module.compile's compiled forward, undone by a rebuild
    "_call_impl",  # policies/compile.py: what Module.compile compiles (the call with its hooks), compiled the same
                   # way for a whole-denoiser CUDA graph, whose generation has to start outside the compiled code
}


def resolve(where: str):
    module, _, rest = where.partition(".")
    obj = importlib.import_module(module)
    for part in rest.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(f"{obj.__name__}.{part}")
    return obj


@pytest.mark.parametrize("where, name, why", bridge.PRIVATE, ids=[f"{w}.{n}" for w, n, _ in bridge.PRIVATE])
def test_every_private_name_exists_in_the_installed_diffusers(where, name, why):
    owner = resolve(where)
    if name == bridge.HOOK_REGISTRY_ATTRIBUTE:  # an attribute name written in HookRegistry's code
        import inspect

        assert repr(name) in inspect.getsource(owner) or f'"{name}"' in inspect.getsource(owner)
        return
    missing = object()
    value = getattr(owner, name, missing)  # a class attribute may be None (a processor's _attention_backend)
    if value is missing and isinstance(owner, type) and hasattr(owner, "__members__"):  # an enum member
        value = owner.__members__.get(name.lstrip("_").upper()) or owner.__members__.get(name, missing)
    assert value is not missing, f"diffusers {diffusers.__version__} has no {where}.{name} ({why})"
    assert why.strip()


def test_the_bridge_names_its_constants_as_diffusers_spells_them():
    from diffusers.models.attention_dispatch import AttentionBackendName

    assert AttentionBackendName._NATIVE_FLASH.value == bridge.NATIVE_FLASH_BACKEND
    assert diffusers.__version__.rsplit(".", 1)[0] == bridge.CHECKED_AGAINST.rsplit(".", 1)[0]


def names_defined_in_omnispec() -> set[str]:
    found = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                found.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.add(node.id)
            elif isinstance(node, ast.arg):
                found.add(node.arg)
    return found


def test_no_private_library_name_is_read_outside_the_bridge():
    ours = names_defined_in_omnispec()
    listed = {name for _, name, _ in bridge.PRIVATE}
    wrong = []
    for path in SOURCES:
        if path.name == "bridge.py" and path.parent.name == "omnispec":
            continue
        text = path.read_text()
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("diffusers", "transformers"):
                wrong += [f"{where}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and re.fullmatch(r"_[^_]\w*", node.attr):
                if node.attr not in ours and node.attr not in TORCH_INTERNALS:
                    wrong.append(f"{where}:{node.lineno} reads {ast.unparse(node)}")
        code = "\n".join(line.split("#")[0] for line in text.splitlines())
        for name in listed:
            for m in re.finditer(rf"\.{name}\b|\b{name}\s*\(|import .*\b{name}\b", code):
                wrong.append(f"{where} uses {name}")
    assert not wrong, "private names outside omnispec/bridge.py:\n" + "\n".join(sorted(set(wrong)))
