"""Conditioning videos (``video=`` / ``--video``, and a mask per frame): every way a user hands frames over reads to
the same checked frames, a hostile or broken file is one error, and a request's video sets its frame count and size
or must agree with them. Spec level only (no model): the VACE family's runs are in test_wan_vace.py."""

import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnispec.spec import SpecError, load_spec
from omnispec.spec import videos as videos_module
from omnispec.spec.errors import SpecTypeError
from omnispec.spec.request import resolve_request
from omnispec.spec.videos import is_video_file, video_condition

from conftest import SPECS

av = pytest.importorskip("av")  # the video extra (in dev)


def pictures(count: int = 5, height: int = 32, width: int = 48, seed: int = 0) -> list[np.ndarray]:
    return [(np.random.RandomState(seed + i).rand(height, width, 3) * 255).astype(np.uint8) for i in range(count)]


def encoded(path, frames: list[np.ndarray], codec: str = "libx264") -> str:
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return str(path)


def animated(path, frames: list[np.ndarray], **options) -> str:
    first, *rest = [Image.fromarray(f) for f in frames]
    first.save(path, save_all=True, append_images=rest, **options)
    return str(path)


@pytest.mark.parametrize("kind", ["mp4", "webm", "gif", "webp", "apng"])
def test_every_file_kind_reads_to_its_frames(tmp_path, kind):
    frames = pictures()
    path = {"mp4": lambda: encoded(tmp_path / "v.mp4", frames),
            "webm": lambda: encoded(tmp_path / "v.webm", frames, "libvpx-vp9"),
            "gif": lambda: animated(tmp_path / "v.gif", frames, duration=100),
            "webp": lambda: animated(tmp_path / "v.webp", frames, lossless=True),
            "apng": lambda: animated(tmp_path / "v.png", frames)}[kind]()
    video = video_condition(path)
    assert len(video.frames) == 5 and video.size == (32, 48) and {f.mode for f in video.frames} == {"RGB"}
    assert video.path == path and is_video_file(path, "request.video")
    if kind in ("webp", "apng"):  # lossless: the very pixels
        assert all(np.array_equal(np.asarray(a), b) for a, b in zip(video.frames, frames))


def test_python_frames_read_alike_and_the_digest_follows_the_pixels(tmp_path):
    frames = pictures()
    listed = video_condition([Image.fromarray(f) for f in frames])
    assert video_condition(np.stack(frames)).digest == listed.digest
    assert video_condition(torch.from_numpy(np.stack(frames))).digest == listed.digest
    assert video_condition(frames).digest == listed.digest  # a list of 8-bit arrays
    paths = [str(tmp_path / f"{i}.png") for i in range(5)]
    for path, frame in zip(paths, frames):
        Image.fromarray(frame).save(path)
    assert video_condition(paths).digest == listed.digest
    changed = [f.copy() for f in frames]
    changed[3][0, 0, 0] ^= 1
    assert video_condition(changed).digest != listed.digest
    assert video_condition(frames[:4]).digest != listed.digest
    grey = [f[..., 0] for f in frames]
    assert video_condition(grey, mask=True).digest != video_condition(grey).digest  # a mask is another thing


@pytest.mark.parametrize("given, error, fragment", [
    (np.zeros((5, 8, 8, 3), np.float32), SpecError, "float frames are refused"),
    (torch.zeros(5, 3, 8, 8), SpecError, "float frames are refused"),
    (np.zeros((3, 4, 4, 5), np.uint8), SpecError, "1 or 3 channels"),
    ([], SpecError, "no frames"),
    ([1, 2], SpecTypeError, "a frame is a path, a PIL image or an 8-bit"),
    ([np.zeros((8, 8, 3), np.float32)], SpecTypeError, "got ndarray of dtype float32"),
    (7, SpecTypeError, "a video is a list of frames"),
    ([Image.new("RGB", (8, 8)), Image.new("RGB", (8, 16))], SpecError, "frame 1 is 8x16, frame 0 8x8"),
])
def test_python_frames_are_checked(given, error, fragment):
    with pytest.raises(error, match=fragment):
        video_condition(given)


def test_broken_and_foreign_files_are_one_error(tmp_path):
    (tmp_path / "garbage.mp4").write_bytes(b"\0\0\0\x18ftypisom" + os.urandom(3000))
    (tmp_path / "garbage.mkv").write_bytes(b"\x1a\x45\xdf\xa3" + bytes(100))
    (tmp_path / "list.m3u8").write_text("#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n")  # a playlist is never demuxed
    (tmp_path / "concat.txt").write_text("ffconcat version 1.0\nfile /etc/passwd\n")
    cut = encoded(tmp_path / "full.mp4", pictures())
    (tmp_path / "cut.mp4").write_bytes(Path(cut).read_bytes()[:200])
    cases = {"garbage.mp4": "not a readable video", "garbage.mkv": "not a readable video",
             "list.m3u8": "not a video omnispec reads", "concat.txt": "not a video omnispec reads",
             "cut.mp4": "not a readable video|no frames", "missing.mp4": "no such video file"}
    for name, fragment in cases.items():
        with pytest.raises(SpecError, match=fragment):
            video_condition(str(tmp_path / name))
    with pytest.raises(SpecError, match="is a directory"):
        video_condition(str(tmp_path))


def test_the_demuxer_may_open_no_other_file(tmp_path, monkeypatch):
    """The demuxer is chosen from magic bytes (MP4, Matroska: neither opens other files), FFmpeg may demux no other
    format, and behind both every nested open is refused: shown here with FFmpeg's HLS demuxer forced on a playlist,
    which would read its segment file."""
    (tmp_path / "secret.ts").write_bytes(b"\x47" * 188)
    playlist = tmp_path / "list.m3u8"
    playlist.write_text("#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\nsecret.ts\n#EXT-X-ENDLIST\n")
    with pytest.raises(SpecError, match="not a readable video"):  # the format whitelist
        list(videos_module._demuxed(playlist, "hls", str(playlist), "request.video"))
    without_whitelist = {k: v for k, v in videos_module._DEMUXER_OPTIONS.items() if k != "format_whitelist"}
    monkeypatch.setattr(videos_module, "_DEMUXER_OPTIONS", without_whitelist)
    with pytest.raises(SpecError, match=r"may not open other resources \(.*secret\.ts\)"):
        list(videos_module._demuxed(playlist, "hls", str(playlist), "request.video"))


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "video.mp4"
    os.mkfifo(fifo)
    found = []
    worker = threading.Thread(target=lambda: found.append(pytest.raises(SpecError, video_condition, str(fifo))),
                              daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "reading a FIFO blocked"
    assert "is a FIFO" in str(found[0].value)


def test_limits_stop_reading_at_the_header_and_at_the_total(tmp_path, monkeypatch):
    path = encoded(tmp_path / "v.mp4", pictures(count=6))
    monkeypatch.setattr(videos_module, "MAX_IMAGE_PIXELS", 32 * 48 - 1)  # one frame too large: the stream's header
    with pytest.raises(SpecError, match="frame 0 is 48x32"):
        video_condition(path)
    monkeypatch.undo()
    monkeypatch.setattr(videos_module, "MAX_VIDEO_PIXELS", 32 * 48 * 4)
    with pytest.raises(SpecError, match="5 frames of 48x32 pass the limit"):
        video_condition(path)
    monkeypatch.setattr(videos_module, "MAX_FRAMES", 3)
    with pytest.raises(SpecError, match="more than 3 frames|above the limit of 3"):
        video_condition(animated(tmp_path / "v.gif", pictures(count=4, height=4, width=4)))
    with pytest.raises(SpecError, match="above the limit of 3"):
        video_condition(pictures(count=4, height=4, width=4))


def test_without_pyav_a_container_names_the_extra(tmp_path, monkeypatch):
    path = encoded(tmp_path / "v.mp4", pictures(count=2))
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(SpecError, match=r"needs PyAV: pip install 'omnispec-diffusion\[video\]'"):
        video_condition(path)


def test_mask_frames_are_grey_and_transparency_is_refused(tmp_path):
    grey = [np.full((8, 8), v, np.uint8) for v in (0, 128, 255)]
    mask = video_condition(grey, mask=True)
    assert [f.mode for f in mask.frames] == ["L"] * 3 and np.asarray(mask.frames[1]).max() == 128
    opaque = [Image.new("RGBA", (8, 8), (255, 255, 255, 255))] * 2
    assert video_condition(opaque, mask=True).frames[0].mode == "L"
    see_through = [Image.new("RGBA", (8, 8), (255, 255, 255, 255)), Image.new("RGBA", (8, 8), (255, 255, 255, 0))]
    with pytest.raises(SpecError, match="mask frame 1 has transparent pixels"):
        video_condition(see_through, mask=True)


# ---- the request: a video-to-video recipe -----------------------------------------------------------------------

V2V = SPECS / "wan2.1-vace-1.3b-v2v.yaml"


@pytest.fixture(scope="module")
def v2v():
    return load_spec(V2V)


def test_the_video_sets_frames_and_size_unless_the_request_does(v2v):
    frames = pictures(count=9, height=32, width=48)
    request = resolve_request(v2v, "x", 0, video=frames)
    assert (request.frames, request.height, request.width) == (9, 32, 48)
    with pytest.raises(SpecError, match="the video has 9 frames and the request asks for 13"):
        resolve_request(v2v, "x", 0, video=frames, frames=13)
    with pytest.raises(SpecError, match="the video is 48x32 and the output 64x32"):
        resolve_request(v2v, "x", 0, video=frames, width=64)
    assert request.condition_digests != resolve_request(v2v, "x", 0, video=frames[::-1]).condition_digests
    with pytest.raises(SpecError, match=r"frames 10 must be k\*4\+1 \(e.g. 9\) \(the video's: cut or resize"):
        resolve_request(v2v, "x", 0, video=pictures(count=10, height=32, width=48))
    with pytest.raises(SpecError, match=r"height 30 is not a multiple of 16 \(the video's"):
        resolve_request(v2v, "x", 0, video=pictures(count=9, height=30, width=48))


def test_masks_of_a_video(v2v, tmp_path):
    frames = pictures(count=9, height=32, width=48)
    one = np.zeros((32, 48), np.uint8)
    request = resolve_request(v2v, "x", 0, video=frames, mask=one)
    assert not hasattr(request.mask, "frames")  # one image, for every frame
    per_frame = resolve_request(v2v, "x", 0, video=frames, mask=[one] * 9)
    assert len(per_frame.mask.frames) == 9
    stacked = resolve_request(v2v, "x", 0, video=frames, mask=np.stack([one] * 9))
    assert stacked.mask.digest == per_frame.mask.digest
    path = animated(tmp_path / "mask.gif", [np.stack([one] * 3, -1), np.full((32, 48, 3), 255, np.uint8)] * 4 +
                    [np.stack([one] * 3, -1)])
    assert len(resolve_request(v2v, "x", 0, video=frames, mask=path).mask.frames) == 9
    with pytest.raises(SpecError, match="8 mask frames for a video of 9"):
        resolve_request(v2v, "x", 0, video=frames, mask=[one] * 8)
    with pytest.raises(SpecError, match="the mask is 8x8 and the video 48x32"):
        resolve_request(v2v, "x", 0, video=frames, mask=np.zeros((8, 8), np.uint8))
    with pytest.raises(SpecError, match="mask_blur is for inpainting masks"):
        resolve_request(v2v, "x", 0, video=frames, mask=one, mask_blur=3)


def test_tasks_and_families_that_take_no_video(v2v):
    frames = pictures(count=9, height=32, width=48)
    with pytest.raises(SpecError, match=r"needs a video: pass video= \(CLI: --video PATH\)"):
        resolve_request(v2v, "x", 0)
    with pytest.raises(SpecError, match="takes no image"):
        resolve_request(v2v, "x", 0, video=frames, image=Image.fromarray(frames[0]))
    keyframes = load_spec(SPECS / "wan2.1-vace-1.3b.yaml")
    with pytest.raises(SpecError, match="takes no video"):
        resolve_request(keyframes, "x", 0, video=frames, image=Image.fromarray(frames[0]))
    with pytest.raises(SpecError, match="takes no mask"):
        resolve_request(keyframes, "x", 0, mask=np.zeros((32, 48), np.uint8), image=Image.fromarray(frames[0]))
    from omnispec.runtime.families import family_class  # checked at build, before any weight loads

    with pytest.raises(SpecError, match="family 'wan' takes no video"):
        family_class("wan").check_spec(load_spec(SPECS / "wan2.1-t2v-1.3b.yaml", ["recipe.task=video-to-video"]))
    family_class("wan_vace").check_spec(v2v)
