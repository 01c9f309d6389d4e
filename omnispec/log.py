"""Logging: the ``omnispec`` logger, and how the CLI sets verbosity for itself and the libraries it drives.

As a library omnispec only logs (to ``logging.getLogger("omnispec")``) and leaves handlers and the other
libraries' settings to the application. The CLI calls ``configure``: omnispec's progress lines on stderr, and for
``-q``/``-v`` the verbosity of diffusers, transformers and huggingface_hub through their own environment variables
(``DIFFUSERS_VERBOSITY``, ``TRANSFORMERS_VERBOSITY``, ``HF_HUB_VERBOSITY``, ``HF_HUB_DISABLE_PROGRESS_BARS``),
each only when the user has not set it: without a flag their defaults (and the user's settings) stand.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("omnispec")
logger.addHandler(logging.NullHandler())

# Loggers of dependencies that report their own internals (dynamo's recompiles): nothing a user of the CLI can act
# on; shown with -v.
_INTERNAL = ("torch._dynamo", "torch._inductor")
# Messages dependencies log on import about their own optional parts, harmless for an omnispec user: (the logger
# that creates the record, a piece of its message). They go to omnispec's logger at DEBUG instead (-vv shows them);
# every other message of those loggers, and the user's own filters on them, stay as they are.
HARMLESS = (
    ("torchao", "Failed to load "),  # CUDA-only kernels of torchao on a CPU build of torch
    ("torchao.kernel.intmm", "Detected no triton"),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),  # torchao's registrations
    ("transformers.utils.import_utils", "requires torchvision (not installed); falling back"),  # a PIL backend
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects"),  # NF4 gone
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),  # an optional CPU kernel package
    # the same optional kernel, looked for on the Hub through `kernels` (which transformers 5.25 brings) where the
    # CPU has AVX512-BF16; bitsandbytes is imported by peft, which diffusers' hooks import
    ("kernels._internals.hf_hub", "Skipping publisher trust check"),
    # GGUF: diffusers keeps Wan's time embedder in fp32 (_keep_in_fp32_modules), as it should
    ("diffusers.quantizers.gguf.gguf_quantizer", "is required to remain in FP32, dequantizing now"),
)
_VERBOSITY_VARIABLES = {"diffusers": "DIFFUSERS_VERBOSITY", "transformers": "TRANSFORMERS_VERBOSITY",
                        "huggingface_hub": "HF_HUB_VERBOSITY"}


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (a test's capture, a redirected stream)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(verbosity: int = 0) -> None:
    """Set up logging for the CLI: ``verbosity`` -1 (``-q``: errors only, no progress), 0 (progress lines and bars),
    1 (``-v``: the libraries' info messages too), 2 (``-vv``: debug). Under torchrun the ranks other than 0 run as
    with ``-q``, so one process speaks."""
    if not main_process():
        verbosity = -1
    _shorten_long_messages()
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.ERROR if verbosity < 0 else logging.INFO if verbosity < 2 else logging.DEBUG)
    logger.propagate = False
    if verbosity <= 0:
        for name in _INTERNAL:
            logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notes meant for library authors
        # a library's source compiled at import where no bytecode is cached (read-only site-packages,
        # PYTHONDONTWRITEBYTECODE): its SyntaxWarnings are notes for its authors too
        warnings.filterwarnings("ignore", category=SyntaxWarning)
    if verbosity == 0:
        return
    level = "error" if verbosity < 0 else "info" if verbosity == 1 else "debug"
    for package, variable in _VERBOSITY_VARIABLES.items():
        if variable in os.environ:
            continue  # the user's own setting
        os.environ[variable] = level  # read when the library is first imported
        if package in sys.modules:
            module = __import__(f"{package}.utils.logging" if package != "huggingface_hub" else
                                "huggingface_hub.utils.logging", fromlist=["set_verbosity"])
            module.set_verbosity(getattr(logging, level.upper()))
    if verbosity < 0:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        # tqdm reads TQDM_* when first imported (diffusers' video writer draws a plain tqdm bar); "0" would also
        # disable, since the value is read as a bool: only ever "1"
        os.environ.setdefault("TQDM_DISABLE", "1")


# The longest log message the CLI prints whole: a library may echo a user's input into one (the part of a prompt a
# tokenizer cut), and a 100,000-character prompt would become one line that long.
LONGEST_MESSAGE = 1000


def _shorten_long_messages() -> None:
    """Every log record of the process (the libraries' too) made with its message cut to ``LONGEST_MESSAGE``
    characters, saying how long it was; installed once."""
    make = logging.getLogRecordFactory()
    if getattr(make, "omnispec_shortens", False):
        return

    def shortened(*args: object, **kwargs: object) -> logging.LogRecord:
        record = make(*args, **kwargs)
        text = record.getMessage()
        if len(text) > LONGEST_MESSAGE:
            record.msg, record.args = f"{text[:LONGEST_MESSAGE - 40]}... ({len(text):,} characters)", ()
        return record

    shortened.omnispec_shortens = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(shortened)


class _Demote(logging.Filter):
    """Drops one known harmless message from a dependency's logger, re-logging it on omnispec's at DEBUG."""

    def __init__(self, piece: str):
        super().__init__()
        self.piece = piece

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or self.piece not in record.getMessage():
            return True
        logger.debug(f"{record.name}: {record.getMessage()}")
        return False


@contextmanager
def harmless_messages_demoted() -> Iterator[None]:
    """While dependencies are imported and first used: the ``HARMLESS`` messages go to omnispec's logger at DEBUG.
    Scoped, so the dependencies' loggers are as they were afterwards (they log these once, on import)."""
    filters = [(logging.getLogger(name), _Demote(piece)) for name, piece in HARMLESS]
    for owner, demote in filters:
        owner.addFilter(demote)
    try:
        yield
    finally:
        for owner, demote in filters:
            owner.removeFilter(demote)


def main_process() -> bool:
    """Whether this is the process that speaks: not one of torchrun's other ranks."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


# How long another rank that found a mistake waits for rank 0 to say it before saying it itself.
RANK_ZERO_WAIT_S = 10.0


def say_once_per_launch(lines: list[str]) -> None:
    """Print a mistake every rank of a torchrun launch finds (the same input) once, on stderr, from rank 0.

    torchrun stops the other ranks as soon as one exits with an error, so a rank that found the mistake first and
    exited would take rank 0 down before it spoke. Another rank therefore waits (up to ``RANK_ZERO_WAIT_S``) for rank
    0's word that it spoke, an empty file named after the launch (torchrun's run id and its agent's process id, the
    ranks' common parent) in the temporary directory, and prints the lines itself where that word never comes:
    twice is better than never. Outside torchrun this is a plain print."""
    flag = _spoken_flag()
    if main_process():
        for line in lines:
            print(line, file=sys.stderr)
        sys.stderr.flush()
        if flag is not None:
            try:  # never follow a link planted at that name
                os.close(os.open(flag, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600))
            except OSError:
                pass
        return
    if flag is None:
        return
    deadline = time.monotonic() + RANK_ZERO_WAIT_S
    while time.monotonic() < deadline:
        if os.path.lexists(flag):
            return
        time.sleep(0.05)
    for line in lines:
        print(line, file=sys.stderr)


def _spoken_flag() -> str | None:
    """The file by which rank 0 of this torchrun launch says it spoke; None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or os.environ.get("WORLD_SIZE", "1").strip() in ("", "1"):
        return None
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)[:64]
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"omnispec-spoke-{safe}-{os.getppid()}")


def progress_bars_disabled() -> bool:
    """Whether the user turned progress bars off (``-q``, or ``HF_HUB_DISABLE_PROGRESS_BARS``): then diffusers'
    loading bars and omnispec's own go too."""
    return os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() in ("1", "true", "yes", "on")


@contextmanager
def timed(message: str, level: int = logging.INFO) -> Iterator[None]:
    """Log ``message ...`` when the work starts and ``message: N s`` when it ends."""
    if not logger.isEnabledFor(level):
        yield
        return
    logger.log(level, f"{message} ...")
    start = time.perf_counter()
    yield
    logger.log(level, f"{message}: {time.perf_counter() - start:.1f} s")


@contextmanager
def progress(message: str, after: float = 2.0) -> Iterator[None]:
    """Say ``message ...`` if the work takes longer than ``after`` seconds, and how long it took when it ends
    (nothing for work that ends sooner)."""
    import threading

    start = time.perf_counter()
    announced = threading.Event()

    def announce() -> None:
        announced.set()
        logger.info(f"{message} ...")

    timer = threading.Timer(after, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if announced.is_set():
            logger.info(f"{message}: {time.perf_counter() - start:.1f} s")


__all__ = ["HARMLESS", "configure", "harmless_messages_demoted", "logger", "main_process", "progress",
           "progress_bars_disabled", "timed"]
