"""Media a user hands omnispec (``--video``, ``--mask``, ``run --from X.mp4``, ``explain X.mp4``, ``video=``,
``mask=``) are data: a hostile or broken one is one ``error:`` line (exit 2) naming the input, refused from its
headers before a decoder allocates what they claim. Every hostile file is built here, in the test."""

import io
import os
import re
import resource
import struct
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from test_untrusted_inputs import refused

from omnispec import records
from omnispec.spec import SpecError, mp4_boxes
from omnispec.spec.errors import SpecTypeError
from omnispec.spec.images import image_condition
from omnispec.spec.videos import open_demuxer, video_condition

from conftest import SPECS

av = pytest.importorskip("av")  # the video extra (in dev)

V2V = str(SPECS / "wan2.1-vace-1.3b-v2v.yaml")
MP4_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"dinf", b"mvex", b"moof", b"traf"}
MEMORY_HEADROOM = 200 << 20  # bytes a refused file may add to the process's peak (each case below claims gigabytes)


# ---- building files ----------------------------------------------------------------------------------------------

def mp4_bytes(frames: int = 2, size: int = 16, fragmented: bool = False, audio: bool = False) -> bytes:
    """A small H.264 MP4 made by PyAV (optionally fragmented, optionally with an AAC track)."""
    out = io.BytesIO()
    options = {"movflags": "frag_keyframe+empty_moov"} if fragmented else {}
    with av.open(out, "w", format="mp4", options=options) as container:
        video = container.add_stream("libx264", rate=8)
        video.width = video.height = size
        video.pix_fmt = "yuv420p"
        sound = container.add_stream("aac", rate=8000) if audio else None
        for k in range(frames):
            picture = np.full((size, size, 3), (k * 40) % 256, np.uint8)
            container.mux(video.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(video.encode())
        if sound is not None:
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            samples.sample_rate = 8000
            container.mux(sound.encode(samples))
            container.mux(sound.encode())
    return out.getvalue()


def parse_boxes(data: bytes) -> list:
    """[type, payload or child list] for each box (32-bit sizes, as PyAV writes small files)."""
    nodes, at = [], 0
    while at + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + size]
        nodes.append([kind, parse_boxes(body) if kind in MP4_CONTAINERS else body])
        at += size
    return nodes


def write_boxes(nodes: list) -> bytes:
    out = b""
    for kind, body in nodes:
        body = write_boxes(body) if isinstance(body, list) else body
        out += struct.pack(">I4s", 8 + len(body), kind) + body
    return out


def every_box(nodes: list):
    for node in nodes:
        yield node
        if isinstance(node[1], list):
            yield from every_box(node[1])


def with_box(data: bytes, kind: bytes, change) -> bytes:
    """The file with each ``kind`` box's payload replaced by ``change(payload)`` (sample offsets are kept: PyAV puts
    the media data before the boxes that change)."""
    nodes = parse_boxes(data)
    for node in every_box(nodes):
        if node[0] == kind:
            node[1] = change(node[1])
    return write_boxes(nodes)


def animated_gif(count: int = 3, size: int = 16) -> bytes:
    frames = [np.zeros((size, size), np.uint8) for _ in range(count)]
    for k, frame in enumerate(frames):
        frame[k, k] = 255
    images = [Image.fromarray(f).convert("P") for f in frames]
    out = io.BytesIO()
    images[0].save(out, "GIF", save_all=True, append_images=images[1:], duration=100, disposal=2)
    return out.getvalue()


def gif_image_offsets(data: bytes) -> list[int]:
    """Where each image descriptor (its ',' byte) lies in a GIF."""
    at = 13 + (3 << ((data[10] & 7) + 1) if data[10] & 0x80 else 0)
    found = []
    while data[at] != 0x3B:
        if data[at] == 0x21:
            at += 2
        else:
            found.append(at)
            flags = data[at + 9]
            at += 11 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
        while data[at]:
            at += data[at] + 1
        at += 1
    return found


def gif_frame_placed(data: bytes, frame: int, left: int, top: int) -> bytes:
    at = gif_image_offsets(data)[frame] + 1
    return data[:at] + struct.pack("<HH", left, top) + data[at + 4:]


def written(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def video_refused(path: str, fragment: str, mask: bool = False) -> None:
    """``video_condition`` refuses the file with ``fragment``, without the process's peak memory growing."""
    before = peak_rss()
    with pytest.raises(SpecError, match=fragment):
        video_condition(path, mask=mask)
    assert peak_rss() - before < MEMORY_HEADROOM


# ---- concat lists and FIFOs --------------------------------------------------------------------------------------

def test_an_mp4_that_is_a_concat_list_naming_a_fifo_is_refused_unopened(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo")
    fake = written(tmp_path / "X.mp4", f"ffconcat version 1.0\nfile {tmp_path / 'fifo'}\n".encode())
    found = []
    worker = threading.Thread(target=lambda: found.append(pytest.raises(SpecError, records.read, fake)), daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "reading the record opened the FIFO"
    assert "an FFmpeg concat list" in str(found[0].value)
    refused(["run", "--from", fake, "--output", str(tmp_path / "o.png")], "X.mp4", "concat list", capsys=capsys)
    refused(["explain", fake], "concat list", capsys=capsys)


def test_ffmpeg_may_demux_no_format_but_mp4_and_matroska(tmp_path):
    listed = written(tmp_path / "list.txt", b"ffconcat version 1.0\nfile other.mp4\n")
    with open(listed, "rb") as handle, pytest.raises(av.FFmpegError):
        open_demuxer(av, handle, "concat")


# ---- sample tables -----------------------------------------------------------------------------------------------

CLAIMS = {
    "stsz one size": (b"stsz", lambda p: p[:4] + struct.pack(">II", 1, 89_000_000), "samples of one size"),
    "stsz table": (b"stsz", lambda p: p[:8] + struct.pack(">I", 50_000_000) + p[12:], "'stsz' claims 50,000,000"),
    "stco": (b"stco", lambda p: p[:4] + struct.pack(">I", 50_000_000) + p[8:], "'stco' claims 50,000,000"),
    "stts": (b"stts", lambda p: p[:4] + struct.pack(">I", 500_000_000) + p[8:], "'stts' claims 500,000,000"),
    "stsc": (b"stsc", lambda p: p[:4] + struct.pack(">I", 50_000_000) + p[8:], "'stsc' claims 50,000,000"),
    "elst": (b"elst", lambda p: p[:4] + struct.pack(">I", 50_000_000) + p[8:], "'elst' claims 50,000,000"),
}


@pytest.mark.parametrize("claim", CLAIMS, ids=list(CLAIMS))
def test_a_sample_table_claiming_millions_of_entries_is_refused_from_its_box(tmp_path, claim):
    kind, change, fragment = CLAIMS[claim]
    video_refused(written(tmp_path / "v.mp4", with_box(mp4_bytes(), kind, change)), fragment)


def test_a_fragment_claiming_millions_of_samples_is_refused(tmp_path):
    run = with_box(mp4_bytes(fragmented=True), b"trun", lambda p: struct.pack(">II", 0x1, 89_000_000) + p[8:12])
    video_refused(written(tmp_path / "v.mp4", run), "fragments list more than 2,000,000 samples")


def test_edits_repeating_a_tracks_samples_count_toward_the_index_limit(tmp_path, monkeypatch):
    def repeated(payload: bytes) -> bytes:
        return payload[:4] + struct.pack(">I", 100) + payload[8:20] * 100

    monkeypatch.setattr(mp4_boxes, "MAX_MEDIA_SAMPLES", 150)
    path = written(tmp_path / "v.mp4", with_box(mp4_bytes(frames=2), b"elst", repeated))
    video_refused(path, r"indexes 2 samples shown by 100 edits, above the limit of 150")


def test_tables_after_a_track_count_toward_it_as_ffmpeg_reads_them(tmp_path, monkeypatch):
    nodes = parse_boxes(mp4_bytes(frames=2))
    moov = next(node for node in nodes if node[0] == b"moov")
    edits = struct.pack(">II", 0, 100) + struct.pack(">IiI", 1000, 0, 0x10000) * 100
    moov[1].append([b"edts", [[b"elst", edits]]])  # beside the trak, not inside it
    monkeypatch.setattr(mp4_boxes, "MAX_MEDIA_SAMPLES", 150)
    video_refused(written(tmp_path / "v.mp4", write_boxes(nodes)), "track 1 .* shown by 100 edits")


def test_a_sample_table_bomb_is_one_error_as_video_and_as_record(tmp_path, capsys):
    bomb = written(tmp_path / "bomb.mp4", with_box(mp4_bytes(), *CLAIMS["stsz one size"][:2]))
    refused(["run", V2V, "--prompt", "x", "--video", bomb, "--output", str(tmp_path / "o.mp4")],
            "request.video", "bomb.mp4: not a readable video (MP4/MOV)", capsys=capsys)
    refused(["run", "--from", bomb, "--output", str(tmp_path / "o.png")], "bomb.mp4", "samples of one size",
            capsys=capsys)


@pytest.mark.parametrize("shape", ["plain", "fragmented", "with audio"])
def test_real_mp4s_pass_the_box_checks(tmp_path, shape):
    data = mp4_bytes(frames=3, fragmented=shape == "fragmented", audio=shape == "with audio")
    assert len(video_condition(written(tmp_path / "v.mp4", data)).frames) == 3


def test_a_box_past_the_end_of_its_file_is_refused_as_truncated(tmp_path):
    video_refused(written(tmp_path / "cut.mp4", mp4_bytes()[:-100]), r"past the .* left \(truncated or corrupt\)")


def test_an_encrypted_track_is_refused(tmp_path):
    data = with_box(mp4_bytes(), b"stsd", lambda p: p.replace(b"avc1", b"encv", 1))
    video_refused(written(tmp_path / "v.mp4", data), "an encrypted track")


# ---- codecs and containers ---------------------------------------------------------------------------------------

def test_an_mp4_with_an_unknown_codec_names_it(tmp_path, capsys):
    data = with_box(mp4_bytes(), b"stsd", lambda p: p.replace(b"avc1", b"zzzz", 1))
    path = written(tmp_path / "v.mp4", data)
    with pytest.raises(SpecError, match="codec 'zzzz' is not one FFmpeg decodes"):
        video_condition(path)
    refused(["run", V2V, "--prompt", "x", "--video", path, "--output", str(tmp_path / "o.mp4")], "'zzzz'",
            capsys=capsys)


@pytest.mark.parametrize("first", [b"moov", b"mdat", b"free"])
def test_a_quicktime_movie_without_ftyp_is_refused_with_the_remux_hint(tmp_path, first):
    nodes = [node for node in parse_boxes(mp4_bytes()) if node[0] != b"ftyp"]
    nodes.sort(key=lambda node: node[0] != first)
    path = written(tmp_path / "v.mov", write_boxes(nodes))
    with pytest.raises(SpecError, match=f"QuickTime movie without an 'ftyp' box .*'{first.decode()}'.* -c copy"):
        video_condition(path)


# ---- GIFs --------------------------------------------------------------------------------------------------------

def test_a_gif_whose_later_frame_grows_the_canvas_past_the_limit_is_refused_from_its_blocks(tmp_path, capsys):
    path = written(tmp_path / "grow.gif", gif_frame_placed(animated_gif(), 2, 13370 - 16, 13370 - 16))
    video_refused(path, "frame 2 is 13370x13370, 178,756,900 pixels, above the limit")
    video_refused(path, "frame 2 is 13370x13370", mask=True)


def test_a_gif_grown_as_a_mask_is_one_error(tmp_path, capsys):
    path = written(tmp_path / "grow.gif", gif_frame_placed(animated_gif(5), 2, 13370 - 16, 13370 - 16))
    video = written(tmp_path / "v.gif", animated_gif(5))
    refused(["run", V2V, "--prompt", "x", "--video", video, "--mask", path, "--output", str(tmp_path / "o.mp4")],
            "request.mask", "frame 2 is 13370x13370", capsys=capsys)


def test_a_gif_whose_frames_change_size_is_refused_before_decoding(tmp_path):
    path = written(tmp_path / "grow.gif", gif_frame_placed(animated_gif(), 1, 16, 0))
    with pytest.raises(SpecError, match="frame 1 is 32x16, frame 0 16x16"):
        video_condition(path)


def test_a_gif_cut_anywhere_is_one_error(tmp_path):
    whole = animated_gif()
    for cut in range(13, len(whole)):
        path = written(tmp_path / "cut.gif", whole[:cut])
        with pytest.raises(SpecError, match=r"cut\.gif: not a readable GIF: it ends .*\(truncated\)"):
            video_condition(path)


def test_a_truncated_gif_is_one_error_on_the_command_line(tmp_path, capsys):
    whole = animated_gif(5)
    cut = written(tmp_path / "cut.gif", whole[:gif_image_offsets(whole)[1] + 5])
    refused(["run", V2V, "--prompt", "x", "--video", cut, "--output", str(tmp_path / "o.mp4")],
            "cut.gif: not a readable GIF: it ends inside frame 1's descriptor (truncated)", capsys=capsys)


# ---- from Python -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, held", [
    (lambda: torch.empty(5, 16, 16, 3, dtype=torch.uint8, device="meta"), "on the meta device"),
    (lambda: torch.empty(5, 16, 16, 3, device="meta"), "on the meta device"),
    (lambda: torch.zeros(5, 16, 16, 3, dtype=torch.uint8).to_sparse(), "with layout torch.sparse_coo"),
], ids=["meta uint8", "meta float", "sparse uint8"])
@pytest.mark.parametrize("mask", [False, True], ids=["video", "mask"])
def test_tensors_without_values_in_memory_are_refused(make, held, mask):
    where = "request.mask" if mask else "request.video"
    with pytest.raises(SpecError, match=f"^{where}: a tensor of frames holds its values in memory .*{held}"):
        video_condition(make(), where, mask=mask)


def closed_png(tmp_path):
    Image.new("RGB", (16, 16)).save(tmp_path / "p.png")
    image = Image.open(tmp_path / "p.png")
    image.close()
    return image


def truncated_png(tmp_path):
    out = io.BytesIO()
    Image.fromarray(np.random.RandomState(0).randint(0, 255, (16, 16, 3), np.uint8)).save(out, "PNG")
    (tmp_path / "cut.png").write_bytes(out.getvalue()[:-40])
    return Image.open(tmp_path / "cut.png")


@pytest.mark.parametrize("make, fragment", [(closed_png, "closed image"), (truncated_png, "truncated")],
                         ids=["closed", "truncated"])
@pytest.mark.parametrize("mask", [False, True], ids=["video", "mask"])
def test_an_unreadable_pil_frame_is_refused_by_its_index(tmp_path, make, fragment, mask):
    good = Image.new("L" if mask else "RGB", (16, 16))
    with pytest.raises(SpecError, match=rf"^request\.video\.2: the PIL image's pixels cannot be read .*{fragment}"):
        video_condition([good, good, make(tmp_path)], "request.video", mask=mask)


def test_an_unreadable_pil_image_is_refused_as_a_conditioning_image(tmp_path):
    with pytest.raises(SpecError, match=r"^request\.image: the PIL image's pixels cannot be read"):
        image_condition(closed_png(tmp_path), 0, "request.image")


def still_file(tmp_path, suffix):
    path = tmp_path / f"still.{suffix}"
    Image.new("RGB", (16, 16)).save(path)
    return str(path)


@pytest.mark.parametrize("make, error, found", [
    (lambda tmp: Image.new("RGB", (16, 16)), SpecTypeError, r"got a single PIL image \(16x16\)"),
    (lambda tmp: still_file(tmp, "png"), SpecError, "a single PNG image, where a video was expected"),
    (lambda tmp: still_file(tmp, "jpg"), SpecError, "a single JPEG image, where a video was expected"),
    (lambda tmp: np.zeros((16, 16, 3), np.uint8), SpecError, r"got a single image \(dtype uint8, shape \(16, 16, 3\)"),
    (lambda tmp: np.zeros((16, 16), np.uint8), SpecError, r"got a single image \(dtype uint8, shape \(16, 16\)"),
    (lambda tmp: np.zeros((16, 16, 3), np.float32), SpecError, "got a single image"),
    (lambda tmp: torch.zeros(3, 16, 16), SpecError, r"got a single image \(dtype torch.float32, shape \(3, 16, 16\)"),
], ids=["PIL", "png path", "jpeg path", "HxWxC uint8", "HxW uint8", "HxWxC float", "CxHxW float tensor"])
def test_a_single_picture_given_as_a_video_says_what_it_is_and_what_to_do(tmp_path, make, error, found):
    with pytest.raises(error, match=f"{found}.*pass it as image="):
        video_condition(make(tmp_path))


def test_a_video_of_one_frame_is_a_list_of_one_picture(tmp_path):
    assert len(video_condition([still_file(tmp_path, "png")]).frames) == 1


def test_a_still_picture_on_the_command_line_is_pointed_to_image(tmp_path, capsys):
    refused(["run", V2V, "--prompt", "x", "--video", still_file(tmp_path, "png"), "--output",
             str(tmp_path / "o.mp4")], "request.video", "a single PNG image", "--image", capsys=capsys)


def test_frames_stay_stacks_where_they_are_no_single_picture():
    grey = np.zeros((5, 16, 16), np.uint8)  # (F, H, W)
    assert len(video_condition(grey).frames) == 5
    assert len(video_condition(torch.from_numpy(grey)).frames) == 5
    assert video_condition(np.zeros((5, 16, 24, 3), np.uint8)).size == (16, 24)  # (F, H, W, C)


# ---- references: sounds and videos with their sound (--reference-audio, --reference-video, references=) ----------

REF2VA = str(SPECS / "minimax-h3-ref2va.yaml")


def wav_bytes(channels: int = 1, width: int = 2, frames: int = 8, rate: int = 320) -> bytes:
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as track:
        track.setnchannels(channels)
        track.setsampwidth(width)
        track.setframerate(rate)
        track.writeframes(bytes(channels * width * frames))
    return out.getvalue()


def with_data_size(data: bytes, size: int) -> bytes:
    at = data.index(b"data") + 4
    return data[:at] + struct.pack("<I", size) + data[at + 4:]


def mkv_bytes(audio: bool) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        video = container.add_stream("ffv1", rate=8)
        video.width = video.height = 16
        video.pix_fmt = "yuv444p"
        sound = container.add_stream("pcm_s16le", rate=320, layout="mono") if audio else None
        for k in range(3):
            container.mux(video.encode(av.VideoFrame.from_ndarray(np.full((16, 16, 3), k * 40, np.uint8), "rgb24")))
        container.mux(video.encode())
        if sound is not None:
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 64), np.int16), format="s16", layout="mono")
            samples.sample_rate = 320
            container.mux(sound.encode(samples))
            container.mux(sound.encode())
    return out.getvalue()


@pytest.mark.parametrize("make, fragment", [
    (lambda: with_data_size(wav_bytes(), 0xFFFFFFF0), "pass the limit of 67,108,864 samples"),
    (lambda: wav_bytes(channels=6), "6 audio channels; omnispec takes mono or stereo"),
    (lambda: with_data_size(wav_bytes(), 0), "holds no samples"),
    (lambda: wav_bytes()[:30], "not a readable PCM WAV file"),
    (lambda: wav_bytes().replace(b"\x01\x00\x01\x00", b"\x03\x00\x01\x00", 1), "not a readable PCM WAV file"),
    (lambda: b"just some text, no sound", "not a sound file omnispec reads"),
    (lambda: mkv_bytes(audio=False), "has no audio stream"),
    (lambda: mkv_bytes(audio=True)[:200], "voice.wav: not a readable sound"),
], ids=["huge header", "six channels", "empty", "cut header", "float wav", "text", "silent mkv", "cut mkv"])
def test_a_bad_sound_file_is_one_error_line(tmp_path, capsys, make, fragment):
    path = written(tmp_path / "voice.wav", make())
    before = peak_rss()
    refused(["run", REF2VA, "--prompt", "x", "--reference-audio", path, "--output", str(tmp_path / "o.mp4")],
            "request.references.0", fragment.replace("voice.wav", path), capsys=capsys)
    assert peak_rss() - before < MEMORY_HEADROOM


def test_missing_and_fifo_references_are_refused_unopened(tmp_path, capsys):
    refused(["run", REF2VA, "--prompt", "x", "--reference-audio", str(tmp_path / "gone.wav"), "--output",
             str(tmp_path / "o.mp4")], "no such audio file", capsys=capsys)
    fifo = tmp_path / "pipe.mkv"
    os.mkfifo(fifo)
    refused(["run", REF2VA, "--prompt", "x", "--reference-video", str(fifo), "--output", str(tmp_path / "o.mp4")],
            "request.references.0.video", "is a FIFO", capsys=capsys)


def test_a_reference_videos_sound_and_rate_come_with_it_and_a_cut_one_is_one_error(tmp_path, capsys):
    from omnispec.spec.references import references

    clip = written(tmp_path / "clip.mkv", mkv_bytes(audio=True))
    (video,) = references([{"video": clip}])
    assert len(video.frames) == 3 and video.fps == 8.0
    assert video.audio.sample_rate == 320 and video.audio.waveform.shape == (1, 64)
    (silent,) = references([{"video": clip, "audio": None, "fps": 24}])
    assert silent.audio is None and silent.fps == 24.0
    cut = written(tmp_path / "cut.mkv", mkv_bytes(audio=True)[:300])
    refused(["run", REF2VA, "--prompt", "x", "--reference-video", cut, "--output", str(tmp_path / "o.mp4")],
            "request.references.0.video", "cut.mkv", capsys=capsys)


@pytest.mark.parametrize("given, fragment", [
    ({"audio": np.zeros((1, 8), np.int16), "sample_rate": 320}, "floating point"),
    ({"audio": np.full((1, 8), np.nan, np.float32), "sample_rate": 320}, "must be finite"),
    ({"audio": np.zeros((3, 8), np.float32), "sample_rate": 320}, "1 or 2 channels"),
    ({"audio": np.zeros((1, 8), np.float32)}, "need their sample_rate"),
    ({"audio": np.zeros((1, 8), np.float32), "sample_rate": 10**9}, "outside 1 to 384,000 Hz"),
    ({"audio": torch.zeros(1, 8, device="meta"), "sample_rate": 320}, "dense tensor"),
    ({"video": np.zeros((4, 16, 16, 3), np.uint8), "fps": 0}, "frame rate 0 is outside"),
    ({"video": np.zeros((4, 16, 16, 3), np.uint8), "sample_rate": 320}, "none is given"),
    ({"sound": "x.wav"}, "got keys ['sound']"),
], ids=["int", "nan", "three channels", "no rate", "rate", "meta", "fps", "rate without sound", "unknown key"])
def test_references_from_python_are_checked(given, fragment):
    from omnispec.spec.references import references

    with pytest.raises(SpecError, match=re.escape(fragment)):
        references([given])


def test_the_sound_of_a_container_without_pyav_names_the_extra(tmp_path, monkeypatch):
    from omnispec.spec.references import references

    clip = written(tmp_path / "clip.mkv", mkv_bytes(audio=True))
    wav = written(tmp_path / "voice.wav", wav_bytes())
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # import av fails
    with pytest.raises(SpecError, match=re.escape("needs PyAV: pip install 'omnispec-diffusion[video]'")):
        references([{"audio": clip}])
    assert references([{"audio": wav}])[0].waveform.shape == (1, 8)  # a WAV file needs nothing
