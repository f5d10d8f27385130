"""The device feed (``fedfeat encode --feed device``): Pillow's bicubic resize reproduced bit for bit on torch, the
whole eval transform equal to open_clip's, and encode's features with ``--feed device`` equal to ``--feed pil``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_clip import make_tiny_clip, run_cli, write_imagefolder, write_listfile
from PIL import Image

from fedfeat.encoders.feed import (
    DeviceFeed,
    pil_resize_weights,
    plan_from_transform,
    resize_like_pil,
    vertical_first,
)
from fedfeat.encoders.openclip import import_open_clip
from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FeatureStore

# (h, w) -> (out h, out w): CIFAR upscaling, ImageNet-like downscaling, odd and non-square sizes, one-axis
# resizes, a size Pillow 13 resizes vertically first, a large downscale (the dense-matmul path)
SIZES = [
    ((32, 32), (224, 224)),
    ((375, 500), (224, 298)),
    ((500, 375), (298, 224)),
    ((33, 47), (224, 318)),
    ((31, 17), (13, 9)),
    ((600, 401), (224, 334)),
    ((40, 30), (32, 24)),
    ((64, 64), (64, 100)),
    ((101, 64), (57, 64)),
    ((1, 5), (3, 7)),
    ((900, 211), (129, 30)),
]


def _pil(a: np.ndarray, out_hw, resample=Image.BICUBIC) -> np.ndarray:
    return np.stack([np.asarray(Image.fromarray(x).resize(out_hw[::-1], resample)) for x in a])


@pytest.mark.parametrize("size_in,size_out", SIZES)
def test_resize_is_bit_exact_with_pil(size_in, size_out):
    rng = np.random.default_rng(sum(size_in) + sum(size_out))
    a = rng.integers(0, 256, (2, *size_in, 3), dtype=np.uint8)
    want = _pil(a, size_out)
    got = resize_like_pil(torch.from_numpy(a), size_out).numpy()  # [B, H, W, 3] in, same layout out
    assert got.shape == want.shape and np.array_equal(got, want)
    chw = resize_like_pil(torch.from_numpy(a).permute(0, 3, 1, 2), size_out).permute(0, 2, 3, 1).numpy()
    assert np.array_equal(chw, want)


def test_bilinear_and_the_coefficients():
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, (1, 45, 77, 3), dtype=np.uint8)
    got = resize_like_pil(torch.from_numpy(a), (32, 50), filter="bilinear").numpy()
    assert np.array_equal(got, _pil(a, (32, 50), Image.BILINEAR))
    m = pil_resize_weights(32, 224)
    assert m.shape == (224, 32) and m.dtype == np.int64
    assert np.all(np.abs(m.sum(axis=1) - (1 << 22)) <= 3)  # each row ~1.0 in Pillow's 22-bit fixed point
    assert vertical_first(600, 401, 224, 334) and not vertical_first(375, 500, 224, 298)


def test_a_float_bicubic_is_not_pil():
    """What the bit-exact test guards against: torch's own (antialiased) bicubic differs from Pillow's."""
    rng = np.random.default_rng(0)
    for size_in, size_out in SIZES[:3]:
        a = rng.integers(0, 256, (2, *size_in, 3), dtype=np.uint8)
        x = torch.from_numpy(a).permute(0, 3, 1, 2).float()
        t = torch.nn.functional.interpolate(
            x, size=size_out, mode="bicubic", antialias=True, align_corners=False
        )
        t = t.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        assert not np.array_equal(t, _pil(a, size_out))


def _transform(**cfg):
    import_open_clip()
    from open_clip.transform import PreprocessCfg, image_transform_v2

    return image_transform_v2(PreprocessCfg(**cfg), is_train=False)


@pytest.mark.parametrize("cfg", [{}, {"size": 32}, {"size": 40, "resize_mode": "squash"}])
def test_preprocessing_equals_open_clip_exactly(cfg):
    transform = _transform(**cfg)
    feed = DeviceFeed.from_transform(transform, "cpu")
    rng = np.random.default_rng(1)
    shapes = [
        (32, 32),
        (375, 500),
        (500, 375),
        (47, 33),
        (32, 32),
        (29, 61),
        (375, 500),
    ]  # repeats: one group
    imgs = [rng.integers(0, 256, (*s, 3), dtype=np.uint8) for s in shapes]
    want = torch.stack([transform(Image.fromarray(x)) for x in imgs])
    got = feed([("rgb", torch.from_numpy(x)) for x in imgs])
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want)  # float32 normalize with torchvision's operations: tolerance 0


def test_unreadable_items_and_jpeg_bytes_fall_back_to_pil(tmp_path):
    import io

    transform = _transform(size=32)
    feed = DeviceFeed.from_transform(transform, "cpu")
    assert not feed.decodes_jpeg  # CPU: the readers' PIL decode
    rng = np.random.default_rng(2)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (37, 52, 3), dtype=np.uint8)).save(buf, format="JPEG")
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    bad = torch.frombuffer(bytearray(b"\xff\xd8not a jpeg"), dtype=torch.uint8)
    px, errors = feed.pixels(
        [("jpeg", data, "a.jpg"), None, ("jpeg", bad, "b.jpg")], ["", "cannot read x", ""]
    )
    want = transform(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    assert torch.equal(feed.normalize(px[:1])[0], want)
    assert (
        errors[0] == ""
        and errors[1] == "cannot read x"
        and "b.jpg" in errors[2]
        and "--skip-bad" in errors[2]
    )
    assert not px[1:].any()  # unreadable rows are zeros


def test_refuses_a_transform_it_cannot_reproduce():
    with pytest.raises(FedfeatError) as e:
        plan_from_transform(_transform(size=224, resize_mode="longest"))
    msg = str(e.value)
    assert "\n" not in msg and "--feed pil" in msg and "--feed device" in msg


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    d = tmp_path_factory.mktemp("feed")
    tc = make_tiny_clip(d / "tiny")
    data = {"imagefolder": write_imagefolder(d / "folder"), "listfile": write_listfile(d / "lt")}
    out = {}
    for fmt, fx in data.items():
        for feed in ("pil", "device"):
            r = run_cli(["encode", "--dataset", fmt, "--root", fx.root, "--backbone", tc.config, "--pretrained",
                         tc.weights, "--device", "cpu", "--batch-size", "5", "--out", d / feed, "--feed", feed])  # fmt: skip
            assert r.exit_code == 0, (r.output, r.exception)
            out[fmt, feed] = FeatureStore.open(r.stdout.strip().splitlines()[-1])
    return tc, d, out


def test_encode_with_the_device_feed_equals_pil(encoded):
    """PNGs of 20-47 px (up- and downscaled to 32) and JPEGs through the tiny model: equal features."""
    _, _, out = encoded
    for fmt in ("imagefolder", "listfile"):
        pil, dev = out[fmt, "pil"], out[fmt, "device"]
        for split in pil.splits:
            assert np.array_equal(pil.features(split), dev.features(split))  # tolerance 0 on CPU
        assert "feed" not in pil.fingerprint and dev.fingerprint["feed"] == "device"
        assert pil.attrs["fingerprint_hash"] != dev.attrs["fingerprint_hash"]


def test_an_unknown_feed_is_one_line(encoded, tmp_path):
    tc, d, _ = encoded
    r = run_cli(["encode", "--dataset", "imagefolder", "--root", d / "folder", "--backbone", tc.config,
                 "--pretrained", tc.weights, "--device", "cpu", "--out", tmp_path, "--feed", "gpu"])  # fmt: skip
    assert r.exit_code == 2 and "--feed" in r.output and "pil" in r.output
