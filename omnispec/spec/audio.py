"""Sound a request conditions on (an audio reference, a reference video's soundtrack), checked and brought to a
float32 ``(channels, samples)`` waveform with its sample rate.

From Python: a float numpy array or torch tensor, ``(samples,)`` mono or ``(channels, samples)`` with 1 or 2
channels, finite, with its sample rate. From a file: a PCM WAV file (read by Python's own ``wave`` module: 8-bit
unsigned, 16-, 24- or 32-bit signed samples, scaled to [-1, 1)), or the first audio stream of an MP4/MOV or
WebM/Matroska file (decoded by PyAV, the ``video`` extra, through the same fenced demuxer as videos:
``spec.videos``). Either way the sample count the header claims is checked before any sample is read, and a file
that decodes past ``MAX_AUDIO_SAMPLES`` stops there; a decoding error is one ``SpecError``.
"""

from __future__ import annotations

import hashlib
import wave
from pathlib import Path
from typing import Any

from .base import MAX_AUDIO_SAMPLES, MAX_SAMPLE_RATE, SpecModel
from .errors import SpecError, SpecTypeError
from .files import regular_file

_EXPECTED = "omnispec reads PCM WAV files and the sound of MP4/MOV or WebM/Matroska files"


class AudioCondition(SpecModel):
    """Sound the request conditions on: ``waveform`` a float32 numpy array ``(channels, samples)`` (1 or 2 channels)
    at ``sample_rate`` Hz. ``digest`` identifies the samples and their rate; ``path`` is the file they came from."""

    waveform: Any
    sample_rate: int
    digest: str
    path: str | None = None

    @property
    def seconds(self) -> float:
        return self.waveform.shape[1] / self.sample_rate


def audio_condition(audio: Any, sample_rate: Any = None, where: str = "request.audio") -> AudioCondition:
    """A checked waveform (see the module's docstring): a path, or an array or tensor with its ``sample_rate``."""
    path = None
    if isinstance(audio, (str, Path)):
        path = str(audio)
        if sample_rate is not None:
            raise SpecError.single(f"{path}: a file carries its own sample rate; give sample_rate only with samples",
                                   where)
        waveform, sample_rate = read_audio(path, where)
    else:
        waveform = _checked_samples(audio, where)
        sample_rate = _checked_rate(sample_rate, where)
    return AudioCondition(waveform=waveform, sample_rate=sample_rate, digest=_digest(waveform, sample_rate),
                          path=path)


def _checked_rate(rate: Any, where: str) -> int:
    if rate is None:
        raise SpecError.single("samples in memory need their sample_rate (samples per second)", f"{where}.sample_rate")
    if isinstance(rate, bool) or not isinstance(rate, int):
        raise SpecTypeError.single(f"a sample rate is an integer, got {type(rate).__name__} {rate!r}",
                                   f"{where}.sample_rate")
    if not 1 <= rate <= MAX_SAMPLE_RATE:
        raise SpecError.single(f"sample rate {rate} is outside 1 to {MAX_SAMPLE_RATE:,} Hz", f"{where}.sample_rate")
    return rate


def _checked_samples(audio: Any, where: str) -> Any:
    """A float (samples,) or (channels, samples) array or tensor as float32 numpy (channels, samples)."""
    import numpy as np

    if hasattr(audio, "detach") and hasattr(audio, "dim"):  # a torch tensor (the spec layer never imports torch)
        if getattr(audio, "is_meta", False) or str(audio.layout) != "torch.strided":
            raise SpecError.single("a tensor of samples holds its values in memory (a dense tensor)", where)
        if not audio.is_floating_point():
            raise SpecError.single(f"audio samples are floating point in [-1, 1], got dtype {audio.dtype}", where)
        _check_shape(tuple(int(n) for n in audio.shape), where)
        audio = audio.detach().cpu().float().numpy()
    elif isinstance(audio, np.ndarray):
        if audio.dtype.kind != "f":
            raise SpecError.single(f"audio samples are floating point in [-1, 1], got dtype {audio.dtype}", where)
        _check_shape(audio.shape, where)
    else:
        raise SpecTypeError.single("audio is a path, or a float numpy array or torch tensor of samples, got "
                                   f"{type(audio).__name__}", where)
    waveform = np.ascontiguousarray(audio.reshape(1, -1) if audio.ndim == 1 else audio, dtype=np.float32)
    if not np.isfinite(waveform).all():
        raise SpecError.single("audio samples must be finite (the waveform holds NaN or infinity)", where)
    return waveform


def _check_shape(shape: tuple[int, ...], where: str) -> None:
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[0] not in (1, 2)):
        raise SpecError.single(f"audio is (samples,) or (channels, samples) with 1 or 2 channels, got shape {shape}",
                               where)
    _check_count(shape[-1], 1 if len(shape) == 1 else shape[0], None, where)


def _check_count(samples: int, channels: int, path: str | None, where: str) -> None:
    named = f"{path}: " if path else ""
    if channels not in (1, 2):
        raise SpecError.single(f"{named}{channels} audio channels; omnispec takes mono or stereo sound (mix it down "
                               "first)", where)
    if samples * channels > MAX_AUDIO_SAMPLES:
        raise SpecError.single(f"{named}{samples:,} samples of {channels} channel(s) pass the limit of "
                               f"{MAX_AUDIO_SAMPLES:,} samples for a sound", where)


def read_audio(path: str, where: str) -> tuple[Any, int]:
    """The waveform and sample rate of a sound file (see the module's docstring)."""
    from .videos import _container, _head

    file = regular_file(path, where, "audio file")
    head = _head(file, where)
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return _wav(file, path, where)
    if _container(head) is not None:
        sound = soundtrack(path, where)
        if sound is None:
            raise SpecError.single(f"{path}: the file has no audio stream", where)
        return sound
    raise SpecError.single(f"{path}: not a sound file omnispec reads ({_EXPECTED})", where)


def _wav(file: Path, path: str, where: str) -> tuple[Any, int]:
    import numpy as np

    try:
        with wave.open(str(file), "rb") as opened:
            channels, width, rate, count = (opened.getnchannels(), opened.getsampwidth(), opened.getframerate(),
                                            opened.getnframes())
            _check_count(count, channels, path, where)
            if width not in (1, 2, 3, 4):
                raise SpecError.single(f"{path}: {8 * width}-bit samples; omnispec reads 8-, 16-, 24- and 32-bit PCM",
                                       where)
            data = opened.readframes(count)
    except SpecError:
        raise
    except (wave.Error, EOFError, OSError, ValueError) as exc:
        raise SpecError.single(f"{path}: not a readable PCM WAV file ({exc})", where) from None
    if not 1 <= rate <= MAX_SAMPLE_RATE:
        raise SpecError.single(f"{path}: sample rate {rate} is outside 1 to {MAX_SAMPLE_RATE:,} Hz", where)
    usable = len(data) // (width * channels) * width * channels
    if usable == 0:
        raise SpecError.single(f"{path}: the file holds no samples", where)
    raw = np.frombuffer(data[:usable], np.uint8)
    if width == 1:
        samples = (raw.astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # little-endian 24-bit: widened to 32 bits, the sign carried by the top byte
        wide = np.zeros((usable // 3, 4), np.uint8)
        wide[:, 1:] = raw.reshape(-1, 3)
        samples = wide.view("<i4").reshape(-1).astype(np.float32) / float(1 << 31)
    else:
        samples = raw.view(f"<i{width}").astype(np.float32) / float(1 << (8 * width - 1))
    return np.ascontiguousarray(samples.reshape(-1, channels).T), rate


def soundtrack(path: str, where: str) -> tuple[Any, int] | None:
    """The first audio stream of an MP4/MOV or WebM/Matroska file as ``(waveform, sample_rate)``, or None without
    one; decoded as FFmpeg gives it, converted to planar float at its own rate and channel layout."""
    import numpy as np

    from .videos import checked_container, import_pyav, open_demuxer

    container = checked_container(path, where)
    av = import_pyav(f"{path}: reading the sound of MP4/MOV or WebM/Matroska files", where,
                     otherwise=" (or give a PCM WAV file)")
    chunks, total = [], 0
    try:
        with Path(path).open("rb") as handle, open_demuxer(av, handle, container) as opened:
            if not opened.streams.audio:
                return None
            stream = opened.streams.audio[0]
            if stream.codec_context is None:
                raise SpecError.single(f"{path}: its audio stream's codec is not one FFmpeg decodes here; convert it "
                                       "(e.g. to AAC)", where)
            rate, channels = int(stream.codec_context.sample_rate), int(stream.codec_context.channels)
            _check_count(0, channels, path, where)
            if not 1 <= rate <= MAX_SAMPLE_RATE:
                raise SpecError.single(f"{path}: sample rate {rate} is outside 1 to {MAX_SAMPLE_RATE:,} Hz", where)
            resampler = av.audio.resampler.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
            for frame in [*opened.decode(stream), None]:
                for planar in resampler.resample(frame):
                    chunk = planar.to_ndarray()
                    total += chunk.shape[1]
                    _check_count(total, chunk.shape[0], path, where)
                    chunks.append(chunk)
    except SpecError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError) as exc:
        raise SpecError.single(f"{path}: not a readable sound ({exc})", where) from None
    if not total:
        raise SpecError.single(f"{path}: its audio stream holds no samples", where)
    return np.ascontiguousarray(np.concatenate(chunks, axis=1), dtype=np.float32), rate


def _digest(waveform: Any, rate: int) -> str:
    digest = hashlib.sha256(f"audio:{waveform.shape}:{rate}".encode())
    digest.update(waveform.reshape(-1).view("uint8"))
    return digest.hexdigest()[:32]


__all__ = ["AudioCondition", "audio_condition", "read_audio", "soundtrack"]
