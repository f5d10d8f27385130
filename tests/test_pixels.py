"""``fedfeat encode --pixels``: the store keeps each image as the model's uint8 input after its resize and centre
crop; normalised, the pixels read back equal open_clip's own preprocessing, and the features equal a store encoded
without pixels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_clip import make_tiny_clip, reference_model, run_cli, write_imagefolder
from PIL import Image

from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FeatureStore, normalize_pixels


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("px")
    tc = make_tiny_clip(d / "tiny")
    fx = write_imagefolder(d / "data")
    base = ["encode", "--dataset", "imagefolder", "--root", fx.root, "--backbone", tc.config, "--pretrained",
            tc.weights, "--device", "cpu", "--chunk-rows", "4", "--batch-size", "3"]  # fmt: skip
    stores = {}
    for tag, extra in (("plain", []), ("pixels", ["--pixels"])):
        r = run_cli([*base, "--out", d / tag, *extra])
        assert r.exit_code == 0, (r.output, r.exception)
        stores[tag] = FeatureStore.open(r.stdout.strip().splitlines()[-1])
    return tc, fx, stores


def test_pixels_are_the_models_preprocessing_and_features_are_unchanged(setup):
    tc, fx, stores = setup
    st = stores["pixels"]
    assert st.has_pixels and st.attrs["pixels"]["size"] == [32, 32]
    _, preprocess, _ = reference_model(tc)
    for split in ("train", "test"):
        px = st.pixels(split, np.arange(st.n(split)))
        assert px.dtype == np.uint8 and px.shape == (st.n(split), 3, 32, 32)
        x = normalize_pixels(torch.from_numpy(px), st.attrs["pixels"]["mean"], st.attrs["pixels"]["std"])
        want = torch.stack([preprocess(Image.open(p).convert("RGB")) for p in fx.paths[split]])
        assert float((x - want).abs().max()) <= 1e-6
        assert np.array_equal(st.features(split), stores["plain"].features(split))
    rows = np.array([5, 0, 9])  # any rows, any order, across chunks
    assert np.array_equal(st.pixels("train", rows), st.pixels("train", np.arange(12))[rows])


def test_damaged_pixels_and_a_store_without_pixels_are_one_line_errors(setup, tmp_path):
    import shutil

    import zarr

    _, _, stores = setup
    with pytest.raises(
        FedfeatError, match=r"keeps no pixels; re-encode it with `fedfeat encode \.\.\. --pixels`"
    ):
        stores["plain"].pixels("train", [0])
    copy = tmp_path / "s.zarr"
    shutil.copytree(stores["pixels"].path, copy)
    g = zarr.open_group(str(copy), mode="r+")
    px = g["train/pixels"][4:8]
    px[0, 0, 0, 0] ^= 1  # one bit of chunk 1
    g["train/pixels"][4:8] = px
    st = FeatureStore.open(copy)
    st.pixels("train", [0, 1])  # chunk 0 is intact
    with pytest.raises(FedfeatError, match="train/pixels chunk 1 does not match its checksum"):
        st.pixels("train", [5])
