"""Source decoding, frame-rate resampling, bucket choice and resize/crop for `prepare`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.data.bucketing import Bucket, choose_bucket, parse_bucket, resize_crop, validate_buckets
from wanloom_trainer.data.prepare.media import MediaError, load_image, load_media, load_video

BUCKETS = tuple(
    parse_bucket(b) for b in ("1x480x832", "1x832x480", "1x624x624", "81x480x832", "33x480x832", "81x720x1280")
)


@pytest.mark.parametrize(
    ("frames", "height", "width", "is_image", "want"),
    [
        (1, 1080, 1920, True, "1x480x832"),  # landscape image: the only landscape image bucket
        (1, 1000, 600, True, "1x832x480"),  # portrait
        (1, 500, 520, True, "1x624x624"),  # near-square, smaller than the bucket: upscale
        (200, 1080, 1920, False, "81x720x1280"),  # long 1080p clip: most frames, aspect 16:9 beats 480x832
        (200, 600, 1040, False, "81x480x832"),  # long clip whose area is below 720p: downscale only
        (40, 720, 1280, False, "33x480x832"),  # too short for 81 frames
        (20, 720, 1280, False, None),  # shorter than every clip bucket
    ],
    ids=["image-land", "image-portrait", "image-square-up", "clip-720", "clip-480-area", "clip-short", "too-short"],
)
def test_choose_bucket(frames: int, height: int, width: int, is_image: bool, want: str | None) -> None:
    got = choose_bucket(BUCKETS, frames, height, width, is_image)
    assert (str(got) if got else None) == want


def test_bucket_validation_names_the_bucket() -> None:
    validate_buckets(BUCKETS, get_variant("wan2.2-t2v-a14b"))
    with pytest.raises(ValueError, match="bucket 1x720x1280: height and width must be positive multiples of 32"):
        validate_buckets((Bucket(1, 720, 1280),), get_variant("wan2.2-ti2v-5b"))  # VAE stride 16 × patch 2
    with pytest.raises(ValueError, match="is not FRAMESxHEIGHTxWIDTH"):
        parse_bucket("81x480")


def test_resize_crop_covers_then_centre_crops() -> None:
    frames = np.zeros((2, 40, 100, 3), dtype=np.uint8)
    frames[:, :, 40:60] = 255  # a white vertical band in the middle
    out = resize_crop(frames, 32, 32)
    assert out.shape == (2, 32, 32, 3)
    # Scaled to 32x80, cropped to columns 24..56: the band (16..24 after scaling → 32..48) stays centred.
    assert out[0, :, 14:18].mean() > 200 and out[0, :, :4].mean() < 20 and out[0, :, -4:].mean() < 20


def test_video_is_resampled_to_the_training_frame_rate(tmp_path: Path, video_writer) -> None:
    path = tmp_path / "v.mp4"
    video_writer(path, frames=24, height=32, width=48, fps=32)
    clip = load_video(path, fps=16, max_frames=100)
    assert clip.fps == 16 and clip.frames.shape == (12, 32, 48, 3)
    assert load_video(path, fps=16, max_frames=5).frames.shape[0] == 5  # decoding stops early
    slow = load_video(path, fps=64, max_frames=100)  # never invents frames: the source rate caps it
    assert slow.fps == 32 and slow.frames.shape[0] == 24


def test_undecodable_sources_raise_media_error(tmp_path: Path) -> None:
    (tmp_path / "x.mp4").write_bytes(b"not a video")
    (tmp_path / "x.png").write_bytes(b"not an image")
    with pytest.raises(MediaError, match="cannot decode video"):
        load_video(tmp_path / "x.mp4", 16, 10)
    with pytest.raises(MediaError, match="cannot decode image"):
        load_image(tmp_path / "x.png")
    with pytest.raises(MediaError, match="unsupported extension"):
        load_media(tmp_path / "x.txt", 16, 10)
