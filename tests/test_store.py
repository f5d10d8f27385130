"""The store: layout, chunk bookkeeping, refusal of incomplete / foreign / other-version stores."""

import json

import numpy as np
import pytest

from fedfeat.errors import FedfeatError
from fedfeat.partition import stored
from fedfeat.partition.make import make_partition
from fedfeat.store.featurestore import FORMAT_VERSION, FeatureStore, default_chunk_rows, fingerprint_hash


def _new(tmp_path, n_train=10, n_test=4, d=8, chunk_rows=4):
    return FeatureStore.create(
        tmp_path / "s.zarr",
        backbone="toy",
        pretrained="none",
        embed_dim=d,
        logit_scale=100.0,
        class_names=["a", "b"],
        templates=["a photo of a {}."],
        preprocessing={"kind": "none"},
        fingerprint={"x": 1},
        labels={"train": np.arange(n_train) % 2, "test": np.arange(n_test) % 2},
        chunk_rows=chunk_rows,
    )


def _fill(st, rng):
    for split in st.splits:
        for i in range(st.n_chunks(split)):
            sl = st.chunk_slice(split, i)
            st.write_chunk(split, i, rng.standard_normal((sl.stop - sl.start, st.embed_dim)))
    st.write_text(rng.standard_normal((1, 2, st.embed_dim)))


def test_chunks_are_at_least_one_mib():
    for d in (32, 512, 768, 1024):
        assert default_chunk_rows(d) * d * 2 >= 1 << 20
    assert default_chunk_rows(1024) == 512  # exactly 1 MiB of float16 rows


def test_round_trip_and_chunk_bookkeeping(tmp_path):
    st = _new(tmp_path)
    assert st.n_chunks("train") == 3  # 10 rows in chunks of 4: 4, 4, 2
    assert st.chunk_slice("train", 2) == slice(8, 10)
    assert st.missing() == {"train": 3, "test": 1, "text": 1}
    rng = np.random.default_rng(0)
    _fill(st, rng)
    st.mark_complete()
    st2 = FeatureStore.open(tmp_path / "s.zarr")
    assert st2.features("train").dtype == np.float16 and st2.features("train").shape == (10, 8)
    np.testing.assert_array_equal(st2.labels("train"), np.arange(10) % 2)
    assert st2.text_features().shape == (1, 2, 8)
    assert st2.attrs["fingerprint_hash"] == fingerprint_hash({"x": 1})
    rows = np.array([9, 1])
    np.testing.assert_array_equal(st2.features_rows("train", rows), st2.features("train")[rows])


def test_half_written_store_is_refused(tmp_path):
    """Simulate a writer killed after two of three chunks: open() refuses, naming the way out."""
    st = _new(tmp_path)
    st.write_chunk("train", 0, np.zeros((4, 8)))
    st.write_chunk("train", 1, np.zeros((4, 8)))
    with pytest.raises(RuntimeError):
        st.mark_complete()
    with pytest.raises(FedfeatError, match="incomplete.*resume"):
        FeatureStore.open(tmp_path / "s.zarr")
    assert FeatureStore.open(tmp_path / "s.zarr", allow_incomplete=True).missing()["train"] == 1


def test_creation_killed_before_attributes_is_not_a_store(tmp_path):
    import zarr

    zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=3).require_group("train")
    with pytest.raises(FedfeatError, match="not a fedfeat store"):
        FeatureStore.open(tmp_path / "s.zarr")


def test_other_format_version_and_missing_path_are_refused(tmp_path):
    st = _new(tmp_path)
    _fill(st, np.random.default_rng(0))
    st.mark_complete()
    st.update_attrs(format_version=FORMAT_VERSION + 1)
    with pytest.raises(FedfeatError, match="format version"):
        FeatureStore.open(tmp_path / "s.zarr")
    with pytest.raises(FedfeatError, match="no store at"):
        FeatureStore.open(tmp_path / "nope.zarr")
    (tmp_path / "plain").mkdir()
    with pytest.raises(FedfeatError, match="not a fedfeat store"):
        FeatureStore.open(tmp_path / "plain")


def test_create_refuses_to_overwrite_without_force(tmp_path):
    _new(tmp_path)
    with pytest.raises(FedfeatError, match="--force"):
        _new(tmp_path)


def test_partition_round_trip_is_client_major(tmp_path):
    st = _new(tmp_path, n_train=40)
    _fill(st, np.random.default_rng(0))
    st.mark_complete()
    st = FeatureStore.open(tmp_path / "s.zarr", mode="r+")
    p = make_partition(st.labels("train"), "iid", clients=4, seed=3)
    key = stored.write(st, p)
    assert st.partition_keys() == [key]
    q = stored.read(st, key)
    order, offsets = q.order_and_offsets()
    assert offsets.tolist() == [0, 10, 20, 30, 40]
    for c in range(4):  # client c is one contiguous slice of `order`
        np.testing.assert_array_equal(order[offsets[c] : offsets[c + 1]], p.clients[c])
    with pytest.raises(FedfeatError, match="fedfeat partition"):
        stored.read(st, "nope")


def test_zarr_json_carries_the_attributes(tmp_path):
    _new(tmp_path)
    attrs = json.loads((tmp_path / "s.zarr" / "zarr.json").read_text())["attributes"]
    assert attrs["complete"] is False and attrs["format_version"] == FORMAT_VERSION
