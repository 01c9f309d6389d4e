"""Keep stderr for omnispec's own progress and errors in the CLI: library warnings and loading bars off."""

from __future__ import annotations

import logging
import warnings


def quiet_libraries() -> None:
    for name in ("torchao", "torch.utils._pytree", "torch._dynamo"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
