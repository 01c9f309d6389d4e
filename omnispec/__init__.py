"""omnispec: one typed spec describes a whole diffusion run; a small interpreter builds and runs it.

``import omnispec`` stays light: the runtime (torch, diffusers) is imported on first use of ``build``,
``replay`` or ``omnispec.rl``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .spec import PipelineSpec, SpecError, compile_plan, dump_spec, json_schema, load_spec, spec_with_overrides
from .version import __version__

if TYPE_CHECKING:
    import torch

    from . import rl
    from .rl.pipeline import RLPipeline
    from .runtime import Output, Pipeline

def _checkout_models() -> None:
    """The embedded model's code is ``omnispec.src_models`` once installed (pyproject maps the repository's
    ``src_models/`` there); in a plain source checkout the same name points at that folder."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "src_models"
    name = f"{__name__}.src_models"
    if name in sys.modules or (here / "src_models").is_dir() or not (checkout / "__init__.py").is_file():
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, checkout / "__init__.py",
                                                  submodule_search_locations=[str(checkout)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_checkout_models()


def build(
    spec_or_path: PipelineSpec | str | os.PathLike[str] | Mapping[str, Any],
    source: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] = (),
    device: str | torch.device | None = None,
    *,
    components: Mapping[str, Any] | None = None,
    process_group: Any = None,
    trust_code: bool = False,
) -> RLPipeline:
    """Build a runnable pipeline (with RL rollouts and replay) from a spec: a ``PipelineSpec``, a spec file, a
    bundled spec's name (``"flux1-dev"``; ``omnispec list`` shows them) or a mapping.

    ``source`` replaces ``model.source`` (a local directory or Hub id); ``overrides`` are dotted ``key=value``
    strings; ``device`` replaces ``runtime.device``; ``components`` hands in modules you already have (the others
    load); ``process_group`` is the group parallel degrees join; ``trust_code`` allows classes outside
    ``diffusers``, ``transformers`` and ``omnispec``. Everything that can be checked without weights is checked
    before the first weight loads; see ``omnispec.runtime.build``.
    """
    from .spec.hub import offline_while_local

    if isinstance(overrides, Iterable) and not isinstance(overrides, (str, bytes)):
        overrides = list(overrides)  # read twice: here and by the runtime
    local_source = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    # a spec that needs nothing from the Hub builds offline, as the CLI runs it: the libraries imported and used on
    # the way ask the Hub nothing (an agent registry, a kernel's publisher)
    spec = _spec_to_run(spec_or_path, overrides, trust_code)
    if spec is not None:  # read once: the runtime takes it as it is
        spec_or_path, overrides = spec, ()
    with offline_while_local(spec, local_source):
        from .rl.pipeline import RLPipeline
        from .runtime import build as _build

        pipe = _build(spec_or_path, source, overrides, device, components=components, process_group=process_group,
                      trust_code=trust_code, pipeline_class=RLPipeline)
    assert isinstance(pipe, RLPipeline)
    return pipe


def _spec_to_run(spec_or_path: Any, overrides: Any, trust_code: Any) -> PipelineSpec | None:
    """The spec ``build`` runs, read before the runtime is imported; None where it cannot be read (``build`` then
    says why, naming the argument)."""
    try:
        if isinstance(spec_or_path, os.PathLike):
            spec_or_path = os.fspath(spec_or_path)
        return spec_with_overrides(spec_or_path, overrides, trust_code=trust_code is True)
    except (SpecError, TypeError):
        return None


def replay(output: str | os.PathLike[str], *, source: str | os.PathLike[str] | None = None,
           device: str | None = None, trust_code: bool = False, allow_version_drift: bool = False) -> Output:
    """Regenerate an output written by omnispec (``.png``, ``.mp4``, or the ``.json`` beside a ``.npy``/``.wav``)
    from what it records: the resolved spec, the request and the checkpoint. ``source`` replaces the recorded
    checkpoint (a moved copy of it); its config files must still match the recorded ones. A record made by another
    omnispec major.minor or diffusers minor is refused unless ``allow_version_drift`` (the new output's record then
    says it drifted). The record is checked whole before any weight loads; it can never turn ``trust_code`` on."""
    from .replaying import replay as _replay

    def rl_pipeline() -> type:
        from .rl.pipeline import RLPipeline

        return RLPipeline

    return _replay(output, source=source, device=device, trust_code=trust_code,
                   allow_version_drift=allow_version_drift, pipeline_loader=rl_pipeline)


def __getattr__(name: str) -> Any:
    if name in ("Pipeline", "Output"):
        from . import runtime

        return getattr(runtime, name)
    if name == "rl":  # on first use: it imports torch and the runtime
        return importlib.import_module(f"{__name__}.rl")
    raise AttributeError(f"module 'omnispec' has no attribute {name!r}")


__all__ = ["Output", "Pipeline", "PipelineSpec", "SpecError", "__version__", "build", "compile_plan", "dump_spec",
           "json_schema", "load_spec", "replay", "rl"]
