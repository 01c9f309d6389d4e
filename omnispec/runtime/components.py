"""Load a spec's components with their classes, subfolders and dtypes, through ``from_pretrained``.

Loading goes through diffusers'/transformers' own ``from_pretrained`` so that a local directory and a
Hub id take the same path; ``check_source`` runs first so a missing checkpoint is reported before any
weight is read.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..log import logger, main_process
from ..policies import quantization
from ..spec import Component, PipelineSpec, SpecError
from ..spec.base import MAX_MODULES
from ..spec.errors import first_line, quoted
from ..spec.files import PICKLE_SUFFIXES, check_json_files, path_kind, safetensors_header, user_path
from ..spec.hub import check_reachable, hub_offline, is_hub_id
from ..spec.model import WEIGHTLESS_ROLES as _WEIGHTLESS
from ..spec.weights_file import locate, read_weights_file
from . import single_file
from .families import import_ref

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def component_class(component: Component) -> type:
    ref = component.class_
    if ":" not in ref and ref.count(".") == 1:  # 'diffusers.Name' / 'transformers.Name'
        package, name = ref.split(".")
        ref = f"{package}:{name}"
    cls = import_ref(ref)
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise SpecError.single(f"{component.class_!r} has no from_pretrained", "model.components")
    return cls


def check_source(spec: PipelineSpec, source: str | None, names: Iterable[str] | None = None,
                 trusted: bool = False) -> str:
    """Resolve the checkpoint root and check the components' files are reachable and loadable as data (weights in
    safetensors, unless ``trusted``), loading nothing. A component with its own ``source`` is checked against that
    root instead."""
    wanted = set(spec.model.components if names is None else names)
    root = source or spec.model.source
    if not root:
        raise SpecError.single("no checkpoint: the spec has no model.source and no --source was given", "model.source")
    by_root: dict[tuple[str, str], dict[str, Component]] = {}
    for name, component in spec.model.components.items():
        if name in wanted:
            where = (component.source, f"model.components.{name}.source") if component.source else (root, "model.source")
            by_root.setdefault(where, {})[name] = component
    resolved = _check_root(root, {}, spec.model.revision, "model.source", trusted)
    for (path, where), components in by_root.items():
        _check_root(path, components, spec.model.revision, where, trusted)
    return resolved


def _check_root(root: str, components: Mapping[str, Component], revision: str | None, where: str,
                trusted: bool) -> str:
    local = user_path(root)
    if path_kind(local) is not None:
        if path_kind(local) != "dir":
            raise SpecError.single(f"checkpoint root {root!r} is not a directory", where)
        missing = [f"{name} ({c.subfolder})" for name, c in components.items()  # a file brings its own weights
                   if c.subfolder and c.file is None and path_kind(local / c.subfolder) != "dir"]
        if missing:
            raise SpecError.single(f"checkpoint {root!r} lacks component folder(s): {', '.join(missing)}", where)
        for name, component in components.items():
            _check_files(local, name, component, trusted)
        return str(local)
    if not is_hub_id(root):
        raise SpecError.single(f"checkpoint {quoted(root)} is neither a local directory nor a Hub id (owner/name)",
                               where)
    if not hub_offline():
        check_reachable(root, where)
    else:
        from huggingface_hub import try_to_load_from_cache

        for name, c in components.items():
            probe = f"{c.subfolder}/config.json" if c.subfolder and c.role not in _WEIGHTLESS else None
            found = try_to_load_from_cache(root, probe, revision=revision) if probe else None
            if probe and not isinstance(found, str):
                raise SpecError.single(
                    f"Hub checkpoint {root!r} is not in the local cache (component {name!r}) and HF_HUB_OFFLINE is set: "
                    "give a local checkpoint directory with --source (source= in Python), or unset HF_HUB_OFFLINE to "
                    "download it", where)
            if found:  # the cached snapshot's folder: its files are checked as a local folder's
                _check_files(Path(found).parent.parent, name, c, trusted)
    return root


def _check_files(root: Path, name: str, component: Component, trusted: bool) -> None:
    """A component's folder before any loader reads it: its JSON files within bounds, its weights as data."""
    folder = root / (component.subfolder or "")
    if path_kind(folder) == "dir":
        check_json_files(folder, f"model.components.{name}")
    _check_weight_files(root, name, component, trusted)


def _check_weight_files(root: Path, name: str, component: Component, trusted: bool) -> None:
    """A weighted component's files as ``from_pretrained`` would read them: a named ``file`` must not be a pickle,
    and a folder must hold safetensors weights, not only pickled ones (which loading would run code from)."""
    where = f"model.components.{name}"
    folder = root / (component.subfolder or "")
    if component.file is not None:  # a Hub file not yet fetched is checked when it is
        path = locate(component, str(root), f"{where}.file", fetch=False)
        if path is not None:
            read_weights_file(path, f"{where}.file", trusted)
        return
    if component.role in _WEIGHTLESS or path_kind(folder) != "dir":
        return
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    weights = [n for n in names if n.endswith(".safetensors")]
    for name_ in weights:  # a truncated or forged file is refused here, by name, not inside the loader
        safetensors_header(folder / name_, where)
    if weights or trusted or any(n.endswith(".safetensors.index.json") for n in names):
        return
    pickles = [n for n in names if n.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise SpecError.single(f"{folder / pickles[0]}: component {name!r} has pickled weights only, which loading "
                               "would run code from; omnispec loads .safetensors weights unless you pass --trust-code "
                               "(trust_code=True) for a checkpoint you trust", where)


def load_components(spec: PipelineSpec, root: str, only: Mapping[str, Component] | None = None,
                    trusted: bool = False) -> dict[str, Any]:
    """The components (all, or ``only`` these), on the CPU, in their dtypes; placement is a policy step. A
    progress bar counts them (``runtime.progress``); each one's time is logged at debug level. ``trusted`` lets
    the checkpoint's own code and pickled weights load (``--trust-code``)."""
    out: dict[str, Any] = {}
    wanted = only if only is not None else spec.model.components
    start = time.perf_counter()
    bar = tqdm(wanted.items(), desc="loading", unit="component", disable=not spec.runtime.progress or not main_process(),
               leave=False)
    for name, component in bar:
        bar.set_postfix_str(name)
        began = time.perf_counter()
        out[name] = _load_component(spec, root, name, component, trusted)
        logger.debug(f"loaded {name} ({component.class_}) in {time.perf_counter() - began:.1f} s")
    weighted = [name for name, c in wanted.items() if c.role not in _WEIGHTLESS]
    level = logging.INFO if weighted else logging.DEBUG  # tokenizers and schedulers alone: no weights were loaded
    logger.log(level, f"loaded {len(out)} component(s) from {root} in {time.perf_counter() - start:.1f} s")
    return out


def loader_options(cls: type, role: str, trusted: bool) -> dict[str, Any]:
    """What every ``from_pretrained`` call is told about code and pickles: ``trust_remote_code`` explicitly (so no
    loader runs a checkpoint's own Python file, or asks on a terminal whether to) where the loader takes it, and
    ``use_safetensors=True`` for weights unless the user trusts the checkpoint."""
    options: dict[str, Any] = {}
    if _takes_trust_flag(cls):
        options["trust_remote_code"] = trusted
    if role not in _WEIGHTLESS and not trusted:
        options["use_safetensors"] = True
    return options


def _takes_trust_flag(cls: type) -> bool:
    """transformers' models, tokenizers, processors and Auto classes, and diffusers' ``AutoModel``: the loaders that
    can import a checkpoint's own code (concrete diffusers classes never do, and take no such keyword)."""
    module = cls.__module__
    if module.startswith("diffusers"):
        return cls.__name__ == "AutoModel"
    if not module.startswith("transformers"):
        return False
    import transformers

    bases = (transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase, transformers.ProcessorMixin)
    return issubclass(cls, bases) or module.startswith("transformers.models.auto")


# Libraries a component's class may need that omnispec's base install lacks, with the extra that installs each.
EXTRA_FOR = {"torchvision": "qwen-edit", "av": "video", "torchao": "quant", "bitsandbytes": "quant",
             "sentencepiece": "dev", "gguf": "gguf"}
# Libraries a saved component's quantizer may need that no extra installs, with the package that does.
PACKAGE_FOR = {"hqq": "hqq", "modelopt": "nvidia-modelopt", "optimum": "optimum-quanto",
               "optimum-quanto": "optimum-quanto", "auto_round": "auto-round"}


def missing_library(exc: ImportError) -> str:
    """What an ImportError from a loader lacks, and how to install it: the module it names (``exc.name``), else a
    library named as a word of its message ('av' in 'not available' names nothing)."""
    text = first_line(exc) or type(exc).__name__
    named = (exc.name or "").split(".")[0]

    def names(library: str) -> bool:
        if named:
            return library == named
        return re.search(rf"(?<![\w-]){re.escape(library)}(?![\w-])", str(exc), re.IGNORECASE) is not None

    for library, extra in EXTRA_FOR.items():
        if names(library):
            return f"it needs {library} ({text}): pip install 'omnispec-diffusion[{extra}]'"
    for library, package in PACKAGE_FOR.items():
        if names(library):
            return f"it needs {library} ({text}): pip install {package}"
    return text


def _load_component(spec: PipelineSpec, root: str, name: str, component: Component, trusted: bool) -> Any:
    cls = component_class(component)
    kwargs: dict[str, Any] = loader_options(cls, component.role, trusted)
    reports = component.file is None and _reports_loading(cls)
    if reports:
        kwargs["output_loading_info"] = True
    if component.subfolder:
        kwargs["subfolder"] = component.subfolder
    if spec.model.revision:
        kwargs["revision"] = spec.model.revision
    if component.role not in _WEIGHTLESS:
        kwargs["dtype"] = DTYPES[component.dtype or spec.model.dtype]
        kwargs |= quantization.load_kwargs(spec, name, component, cls)
        kwargs |= component.config
    home = component.source or root
    config_file = Path(home) / (component.subfolder or "") / "config.json"
    try:
        with bounded_modules(f"component {name!r}", str(config_file) + (" with the spec's config entries"
                                                                         if component.config else ""),
                             f"model.components.{name}"):
            if component.file:
                module = _load_file(spec, home, name, component, cls, kwargs, trusted)
            else:
                module = cls.from_pretrained(home, **kwargs)
    except SpecError:
        raise
    except ImportError as exc:  # a library the component's class needs (Qwen2VLProcessor's video part: torchvision)
        raise SpecError.single(f"cannot load component {name!r} ({component.class_}): {missing_library(exc)}",
                               f"model.components.{name}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = first_line(exc) or type(exc).__name__
        raise SpecError.single(f"cannot load component {name!r} ({component.class_}) from {home!r}: {first}",
                               f"model.components.{name}") from None
    what, where = f"component {name!r} ({component.class_}) from {home!r}", f"model.components.{name}"
    if reports:
        module, info = module
        check_loading_info(info, what, where)
    if isinstance(module, torch.nn.Module):
        check_finite(module, what, where)
        module.eval().requires_grad_(False)
    return module


def _load_file(spec: PipelineSpec, home: str, name: str, component: Component, cls: type, kwargs: dict[str, Any],
               trusted: bool) -> Any:
    """A component from its single weights file: found, its header read and checked against the model its config
    describes (``single_file.check_file``), then loaded by diffusers' ``from_single_file``."""
    where = f"model.components.{name}.file"
    path = locate(component, home, where, spec.model.revision)
    assert path is not None
    weights = read_weights_file(path, where, trusted)
    config_root, subfolder = _config_home(component, home, spec.model.revision)
    if config_root is None:
        config_root, subfolder = _default_config(cls, weights, where)
    config = dict(cls.load_config(config_root, subfolder=subfolder, revision=spec.model.revision)) | component.config
    if weights.format != "pickle":
        family = spec.model.family if component.role == "denoiser" else None
        single_file.check_file(cls, weights, config, family, component.role, where)
    extra = {k: v for k, v in kwargs.items() if k == "quantization_config"} | component.config
    return single_file.load(cls, path, weights, config_root, subfolder, kwargs["dtype"], extra, spec.model.revision)


def _config_home(component: Component, home: str, revision: str | None) -> tuple[str | None, str | None]:
    """The checkpoint root and subfolder whose ``config.json`` describes the component, when it has one (a local
    folder, or a Hub checkpoint's file in the cache or on the Hub)."""
    from ..spec.hub import hub_file

    relative = f"{component.subfolder}/config.json" if component.subfolder else "config.json"
    if path_kind(user_path(home)) == "dir":
        found = path_kind(user_path(home) / relative) == "file"
    else:
        found = is_hub_id(home) and hub_file(home, relative, revision) is not None
    return (home, component.subfolder) if found else (None, None)


def _default_config(cls: type, weights: Any, where: str) -> tuple[str, str | None]:
    """diffusers' own default checkpoint for the model the file is (``DIFFUSERS_DEFAULT_PIPELINE_PATHS``), whose
    config folder then describes it; offline and not cached, the user is told to give a source."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS

    detected = single_file.detect(weights)
    default = DIFFUSERS_DEFAULT_PIPELINE_PATHS.get(detected.model_type or "")
    if default is None:
        raise SpecError.single(f"{weights.path.name}: no config describes it: the component's folder in model.source "
                               f"has no config.json, and the file is {detected.describe()}; set model.source (or the "
                               "component's source) to the model's diffusers checkpoint", where)
    entry = single_file.loadable_entry(cls, where)
    repo = default["pretrained_model_name_or_path"]
    subfolder = default.get("subfolder") or entry.get("default_subfolder")
    from ..spec.hub import hub_file

    if hub_file(repo, f"{subfolder}/config.json" if subfolder else "config.json") is None:
        raise SpecError.single(f"{weights.path.name} is {detected.describe()}; its config is diffusers' default "
                               f"checkpoint {repo}'s, which is not in the local cache (HF_HUB_OFFLINE) or not on the "
                               "Hub: set model.source to a diffusers checkpoint of this model", where)
    return repo, subfolder


class _TooManyModules(BaseException):
    """Raised from inside a library's model construction; a BaseException so that no ``except Exception`` of the
    library turns it into a fallback (``bounded_modules`` turns it into a ``SpecError``)."""


@contextmanager
def bounded_modules(what: str, config: str, where: str) -> Iterator[None]:
    """Count the modules registered while ``what`` is built from ``config`` and stop past ``MAX_MODULES``: a few
    bytes of config (``num_layers: 1000000``) would otherwise build for minutes and fill memory."""
    count = 0

    def hook(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
        nonlocal count
        count += 1
        if count > MAX_MODULES:
            raise _TooManyModules

    handle = torch.nn.modules.module.register_module_module_registration_hook(hook)
    try:
        yield
    except _TooManyModules:
        raise SpecError.single(f"{what}: {config} describes a model of more than {MAX_MODULES:,} modules (real ones "
                               "have a few thousand); refused while building it", where) from None
    finally:
        handle.remove()


def _reports_loading(cls: type) -> bool:
    """Whether ``from_pretrained`` of ``cls`` can say which weights it found (diffusers' and transformers' models)."""
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    return issubclass(cls, (ModelMixin, PreTrainedModel))


def check_loading_info(info: Mapping[str, Any], what: str, where: str) -> None:
    """Refuse a component whose weights files lack weights of the model (the loader would leave them random or on
    the meta device) or hold weights it has no place for (a config that describes another model)."""
    for key, problem in (("missing_keys", "lacks {n} weight(s) the model has"),
                         ("unexpected_keys", "holds {n} weight(s) the model has no place for"),
                         ("mismatched_keys", "holds {n} weight(s) of another shape than the model's")):
        found = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if found:
            names = ", ".join(found[:5]) + (" ..." if len(found) > 5 else "")
            raise SpecError.single(f"{what}: the checkpoint {problem.format(n=len(found))}: {names} (its config "
                                   "and its weights files describe different models, or a file is incomplete)", where)


def check_finite(module: torch.nn.Module, what: str, where: str) -> None:
    """Refuse a module whose floating-point weights hold NaN or infinity (an output would be black or NaN); one pass
    over the plain tensors (fp8 through a float32 copy, one tensor at a time; quantized subclasses are skipped)."""
    bad = []
    for key, tensor in (*module.named_parameters(), *module.named_buffers()):
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.is_meta or not tensor.is_floating_point():
            continue
        values = tensor.detach()
        if values.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            values = values.float()
        if not bool(torch.isfinite(values).all()):
            bad.append(key)
            if len(bad) == 5:
                break
    if bad:
        raise SpecError.single(f"{what}: weight(s) {', '.join(bad)} hold NaN or infinite values", where)
